"""Grouped-query self-attention with RoPE: the projections around the attention call.

q/k/v projections (``Linear``, optional biases) -> optional per-head q/k RMSNorm (Qwen3,
Gemma 3) -> RoPE -> ``jaxserve.model.attention`` (the paged KV cache and kernels, or the dense
causal path) -> o projection. Heads stay a separate axis throughout (``[..., T, h, d]``), as the
kernels read them. Switches come from ``ModelArchConfig``: ``qkv_bias``, ``o_bias``,
``qk_norm``, ``rms_norm_unit_offset``, ``query_pre_attn_scalar`` (the softmax scale),
``attn_logit_softcapping``, ``layer_sliding_windows``, ``rope`` and ``sliding_rope`` (this
layer's RoPE). Each layer hands its own window and soft cap to the attention call, the one
seam every backend sits behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from flax import nnx

from jaxserve.model.attention import dense_causal_attention, paged_attention
from jaxserve.model.layers.linear import Linear
from jaxserve.model.layers.norm import RMSNorm
from jaxserve.model.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from jaxserve.model.arch_config import ModelArchConfig
    from jaxserve.model.attention import KVCache, PagedAttentionMetadata


class SelfAttention(nnx.Module):
    """Grouped-query self-attention (query head ``h`` reads KV head ``h // (Hq // Hkv)``).

    Parameters: ``q_proj [e, Hq, d]``, ``k_proj`` / ``v_proj [e, Hkv, d]``, ``o_proj
    [Hq, d, e]`` (``Linear``; random initialisation draws q, k, v, o in that order), and with
    ``qk_norm`` ``q_norm`` / ``k_norm`` (``RMSNorm`` over ``d``); with an FP8 KV cache also
    float32 scalars ``k_scale`` / ``v_scale`` (added by the loader, ``quant_loading``).

    Args:
      cfg: the architecture.
      layer_idx: this layer's index (its sliding window is ``cfg.layer_sliding_windows[i]``; a
        sliding-window layer uses ``cfg.sliding_rope`` when the config has one).
      dtype: parameter dtype.
      rngs: initialiser keys.
    """

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, dtype, rngs: nnx.Rngs):
        e, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.sliding_window = cfg.layer_sliding_windows[layer_idx]
        self.sm_scale = (cfg.query_pre_attn_scalar or d) ** -0.5
        self.soft_cap = cfg.attn_logit_softcapping
        local = self.sliding_window is not None and cfg.sliding_rope is not None
        self.rotary = RotaryEmbedding(cfg.sliding_rope if local else cfg.rope, d)
        qkv = dict(in_axes=("embed",), bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.q_proj = Linear(e, (hq, d), out_axes=("q_heads", "head_dim"), **qkv)
        self.k_proj = Linear(e, (hkv, d), out_axes=("kv_heads", "head_dim"), **qkv)
        self.v_proj = Linear(e, (hkv, d), out_axes=("kv_heads", "head_dim"), **qkv)
        self.o_proj = Linear(
            (hq, d),
            e,
            in_axes=("q_heads", "head_dim"),
            out_axes=("embed",),
            bias=cfg.o_bias,
            dtype=dtype,
            rngs=rngs,
        )
        norm = dict(unit_offset=cfg.rms_norm_unit_offset)
        self.q_norm = (
            RMSNorm(d, cfg.rms_norm_eps, dtype, "head_dim", **norm) if cfg.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(d, cfg.rms_norm_eps, dtype, "head_dim", **norm) if cfg.qk_norm else None
        )

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache | None = None,
        metadata: PagedAttentionMetadata | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """x ``[..., T, e]``, positions int32 ``[..., T]`` -> (``[..., T, e]`` in the model
        dtype, the updated ``kv_cache`` or None).

        Paged when ``metadata`` is given (x is ``[T, e]``; this step's K/V are written into
        ``kv_cache``), dense causal over positions 0..L-1 otherwise (``[B, L, e]``, no cache).
        """
        lora = None if metadata is None else metadata.lora  # the step's adapters (#33)
        q, k, v = self.q_proj(x, lora), self.k_proj(x, lora), self.v_proj(x, lora)  # [.., T, h, d]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        kw = dict(
            sm_scale=self.sm_scale, soft_cap=self.soft_cap, sliding_window=self.sliding_window
        )
        if metadata is None:
            out = dense_causal_attention(q, k, v, **kw)
        else:
            # FP8 KV cache: the per-tensor scales added at load (quant_loading.add_kv_scales)
            k_scale, v_scale = getattr(self, "k_scale", None), getattr(self, "v_scale", None)
            out, kv_cache = paged_attention(
                q,
                k,
                v,
                kv_cache,
                metadata,
                **kw,
                k_scale=None if k_scale is None else k_scale[...],
                v_scale=None if v_scale is None else v_scale[...],
            )
        return self.o_proj(out, lora), kv_cache

    def head_replication(self, q_replicas: int, kv_replicas: int) -> dict[tuple, tuple]:
        """What ``replicate_heads(q_replicas, kv_replicas)`` does to each parameter, for a loader
        that builds the replicated parameters slice by slice
        (``jaxserve.model.loader.load_weights`` with a mesh).

        Returns:
          ``{(projection, leaf): (axis, repeats, first_only)}``: index ``i`` of ``axis`` is the
          unreplicated parameter's index ``i // repeats``; with ``first_only`` only copies with
          ``i % repeats == 0`` keep their values, the others are zero.
        """
        out: dict[tuple, tuple] = {}
        if q_replicas > 1:
            for leaf, axis in self.q_proj.output_axes(0).items():
                out[("q_proj", leaf)] = (axis, q_replicas, False)
            out[("o_proj", "weight")] = (0, q_replicas, True)
        if kv_replicas > 1:
            for proj in ("k_proj", "v_proj"):
                for leaf, axis in getattr(self, proj).output_axes(0).items():
                    out[(proj, leaf)] = (axis, kv_replicas, False)
        return out

    def replicate_heads(self, q_replicas: int, kv_replicas: int) -> None:
        """Copies each query head ``q_replicas`` times and each KV head ``kv_replicas`` times,
        in place, leaving the layer's output unchanged (tensor parallelism over more devices
        than heads, ``jaxserve.model.sharding.place_model``).

        Query head ``h`` becomes heads ``h * q_replicas ...``; only the first copy keeps its
        ``o_proj`` rows (the others are zero), so the output is the same sum. KV head ``j``
        becomes heads ``j * kv_replicas ...``, so each query head still reads a copy of its own
        KV head once both counts are replicated to the same mesh size.
        """
        if q_replicas > 1:
            self.q_proj.repeat_output(0, q_replicas)
            self.o_proj.repeat_input(0, q_replicas)
        if kv_replicas > 1:
            self.k_proj.repeat_output(0, kv_replicas)
            self.v_proj.repeat_output(0, kv_replicas)
