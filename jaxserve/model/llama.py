"""The Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3) in Flax NNX.

One pre-norm decoder (Touvron et al. 2023): RMSNorm -> grouped-query attention with RoPE ->
residual -> RMSNorm -> SwiGLU MLP -> residual. The architectures differ only in switches read from
``ModelArchConfig``: q/k/v bias (Qwen2), per-head q/k RMSNorm before RoPE (Qwen3), sliding-window
layers (Mistral), tied embeddings, RoPE scaling. Mirrors transformers' ``modeling_llama.py``.

Letters in einsums and shape comments: T tokens (b, l: batch and length on the dense path),
e hidden (embed), h heads, d head_dim, f MLP width, v vocab.

Two forward paths share every layer:
  * paged: ``model(input_ids [T], positions [T], kv_caches, metadata) -> (hidden [T, e], kv_caches)``
    then ``model.compute_logits(hidden [S, e]) -> [S, v]`` float32;
  * dense: ``model.forward_dense(input_ids [B, L]) -> [B, L, v]`` float32, causal, no cache.
Layers are a Python loop (no scan) so each layer's donated cache is updated in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.attention import (
    KVCache,
    PagedAttentionMetadata,
    dense_causal_attention,
    paged_attention,
)
from jaxserve.model.config import ModelArchConfig
from jaxserve.model.rope import apply_rope, inverse_frequencies

INIT_STD = 0.02  # HF initializer_range


def _param(
    rngs: nnx.Rngs | None,
    shape: tuple[int, ...],
    dtype,
    axes: tuple[str, ...],
    init: str = "normal",
) -> nnx.Param:
    """A parameter carrying its logical axis names (mapped to mesh axes by ``sharding.py``)."""
    assert len(shape) == len(axes), (shape, axes)
    if init == "normal":
        value = INIT_STD * jax.random.normal(rngs.params(), shape, dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        value = jnp.zeros(shape, dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019): normalise in float32, cast back, scale by ``weight [dim]``."""

    def __init__(self, dim: int, eps: float, dtype, axis: str = "embed"):
        self.eps = eps
        self.weight = _param(None, (dim,), dtype, (axis,), init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [..., dim]`` -> ``[..., dim]`` in the model dtype; normalised in float32 and cast
        back before the scale by ``weight``, HF ``LlamaRMSNorm``'s order."""
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return xf.astype(x.dtype) * self.weight[...]


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE; the kernels keep heads apart as ``[e, h, d]``."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, dtype, rngs: nnx.Rngs):
        e, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.sliding_window = cfg.layer_sliding_windows[layer_idx]
        self.sm_scale = d**-0.5
        self.q_proj = _param(rngs, (e, hq, d), dtype, ("embed", "q_heads", "head_dim"))
        self.k_proj = _param(rngs, (e, hkv, d), dtype, ("embed", "kv_heads", "head_dim"))
        self.v_proj = _param(rngs, (e, hkv, d), dtype, ("embed", "kv_heads", "head_dim"))
        self.o_proj = _param(rngs, (hq, d, e), dtype, ("q_heads", "head_dim", "embed"))
        bias = cfg.qkv_bias
        self.q_bias = (
            _param(None, (hq, d), dtype, ("q_heads", "head_dim"), "zeros") if bias else None
        )
        self.k_bias = (
            _param(None, (hkv, d), dtype, ("kv_heads", "head_dim"), "zeros") if bias else None
        )
        self.v_bias = (
            _param(None, (hkv, d), dtype, ("kv_heads", "head_dim"), "zeros") if bias else None
        )
        self.o_bias = _param(None, (e,), dtype, ("embed",), "zeros") if cfg.o_bias else None
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, "head_dim") if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, "head_dim") if cfg.qk_norm else None

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        inv_freq,
        kv_cache: KVCache | None = None,
        metadata: PagedAttentionMetadata | None = None,
    ):
        """x ``[..., T, e]``, positions ``[..., T]`` -> (``[..., T, e]``, updated kv_cache or None).

        Paged when ``metadata`` is given (x is ``[T, e]``), dense causal otherwise (``[B, L, e]``).
        """
        q = jnp.einsum("...te,ehd->...thd", x, self.q_proj[...])
        k = jnp.einsum("...te,ehd->...thd", x, self.k_proj[...])
        v = jnp.einsum("...te,ehd->...thd", x, self.v_proj[...])
        if self.q_bias is not None:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        if metadata is None:
            out = dense_causal_attention(
                q, k, v, sm_scale=self.sm_scale, sliding_window=self.sliding_window
            )
        else:
            out, kv_cache = paged_attention(
                q,
                k,
                v,
                kv_cache,
                metadata,
                sm_scale=self.sm_scale,
                sliding_window=self.sliding_window,
            )
        y = jnp.einsum("...thd,hde->...te", out, self.o_proj[...])
        if self.o_bias is not None:
            y = y + self.o_bias[...]
        return y, kv_cache


class MLP(nnx.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelArchConfig, dtype, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _param(rngs, (e, f), dtype, ("embed", "mlp"))
        self.up_proj = _param(rngs, (e, f), dtype, ("embed", "mlp"))
        self.down_proj = _param(rngs, (f, e), dtype, ("mlp", "embed"))
        bias = cfg.mlp_bias
        self.gate_bias = _param(None, (f,), dtype, ("mlp",), "zeros") if bias else None
        self.up_bias = _param(None, (f,), dtype, ("mlp",), "zeros") if bias else None
        self.down_bias = _param(None, (e,), dtype, ("embed",), "zeros") if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [..., e]`` -> ``[..., e]`` in the model dtype."""
        gate = jnp.einsum("...e,ef->...f", x, self.gate_proj[...])
        up = jnp.einsum("...e,ef->...f", x, self.up_proj[...])
        if self.gate_bias is not None:
            gate, up = gate + self.gate_bias[...], up + self.up_bias[...]
        y = jnp.einsum("...f,fe->...e", jax.nn.silu(gate) * up, self.down_proj[...])
        return y + self.down_bias[...] if self.down_bias is not None else y


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer_idx, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, positions, inv_freq, kv_cache=None, metadata=None):
        """``x [T, e]`` (paged, with ``kv_cache`` and ``metadata``) or ``[B, L, e]`` (dense),
        positions int32 ``[T]`` / ``[B, L]``, ``inv_freq`` float32 ``[D // 2]`` ->
        ``(x' of x's shape, updated kv_cache or None)``; see ``Attention.__call__``."""
        h, kv_cache = self.self_attn(
            self.input_layernorm(x), positions, inv_freq, kv_cache, metadata
        )
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class LlamaForCausalLM(nnx.Module):
    """The causal LM: token embedding, decoder layers, final RMSNorm, LM head.

    Args:
      config: the architecture (``ModelArchConfig.from_hf_config``).
      dtype: parameter and activation dtype (``jnp.float32`` or ``jnp.bfloat16``); RMSNorm,
        softmax and logits are computed in float32.
      rngs: initialiser keys (``nnx.Rngs(seed)``); weights ~ N(0, 0.02), norms 1, biases 0.
    """

    def __init__(self, config: ModelArchConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        cfg = self.config = config
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = _param(
            rngs, (cfg.vocab_size, cfg.hidden_size), dtype, ("vocab", "embed")
        )
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, ("vocab", "embed"))
        )

    def _inv_freq(self):
        return inverse_frequencies(self.config.rope, self.config.head_dim)  # [d/2] float32, static

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_caches: list[KVCache],
        metadata: PagedAttentionMetadata,
    ) -> tuple[jax.Array, list[KVCache]]:
        """Paged forward over a flat (ragged) token batch.

        Args:
          input_ids: int32 ``[T]``; positions: int32 ``[T]`` (padding tokens: any valid position).
          kv_caches: the pool's ``(k_cache, v_cache)`` pairs, each ``[num_blocks, block_size,
            Hkv, D]`` in the model dtype (one per layer, or per layer of a KV-cache group when
            groups share them: ``metadata.for_layer``); donate them into the jitted step.
          metadata: ``PagedAttentionMetadata`` of the step.

        Returns:
          ``(hidden [T, e]`` after the final norm, model dtype; ``kv_caches`` with this step's
          K/V written).
        """
        inv_freq = self._inv_freq()
        x = jnp.take(self.embed_tokens[...], input_ids, axis=0)  # [T, e]
        caches = list(kv_caches)
        for i, layer in enumerate(self.layers):
            pair, layer_md = metadata.for_layer(i)
            x, caches[pair] = layer(x, positions, inv_freq, caches[pair], layer_md)
        return self.norm(x), caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """``hidden [..., e]`` (output of ``__call__``) -> float32 logits ``[..., v]``."""
        w_ve = self.embed_tokens[...] if self.lm_head is None else self.lm_head[...]
        return jnp.einsum("...e,ve->...v", hidden, w_ve, preferred_element_type=jnp.float32)

    def forward_dense(self, input_ids: jax.Array) -> jax.Array:
        """Dense causal forward: int32 ``[B, L]`` at positions 0..L-1 -> float32 logits ``[B, L, v]``.

        No cache; for the reference generator, HF parity tests and training. Right-padding does
        not change the logits of earlier positions.
        """
        inv_freq = self._inv_freq()
        positions = jnp.broadcast_to(
            jnp.arange(input_ids.shape[-1], dtype=jnp.int32), input_ids.shape
        )
        x = jnp.take(self.embed_tokens[...], input_ids, axis=0)  # [B, L, e]
        for layer in self.layers:
            x, _ = layer(x, positions, inv_freq)
        return self.compute_logits(self.norm(x))
