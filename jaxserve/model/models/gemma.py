"""The Gemma family (Gemma 2, Gemma 3, and the language model of Gemma 3's multimodal
checkpoints) in Flax NNX.

A "sandwich" decoder (Gemma Team 2024, "Gemma 2"): RMSNorm -> attention -> RMSNorm -> residual,
then RMSNorm -> GeGLU MLP -> RMSNorm -> residual, every RMSNorm scaling by ``1 + weight``. Around
the Llama family's layers it switches (all read from ``ModelArchConfig``):

  * GeGLU with the tanh GELU (``hidden_act`` "gelu_pytorch_tanh");
  * token embeddings scaled by ``sqrt(hidden_size)`` rounded to the model dtype, as HF does;
    the LM head is the tied embedding (unscaled);
  * the softmax scale ``query_pre_attn_scalar ** -0.5``;
  * Gemma 2: attention-logit soft cap (``attn_logit_softcapping``, 50) and final-logit soft
    cap (``final_logit_softcapping``, 30); even layers attend through a sliding window
    (4,096), odd layers globally;
  * Gemma 3: per-head q/k RMSNorm, five local layers (window 1,024 in the released models)
    per global one (``sliding_window_pattern`` or ``layer_types``), local RoPE base 10,000
    and global RoPE with its own base (1e6) and scaling (``sliding_rope`` / ``rope``).

Mirrors transformers' ``modeling_gemma2.py`` / ``modeling_gemma3.py``. Letters in shape
comments: T tokens (B, L on the dense path), e hidden, v vocab.

Checkpoints (``GemmaForCausalLM.weight_source``): parameter paths are HF's module names without
the language model's prefix: ``model.`` for ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``; for
``Gemma3ForConditionalGeneration`` ``language_model.model.`` (the checkpoints Google published,
and transformers 5's ``save_pretrained``) or ``model.language_model.`` (transformers 4.52-4.x);
the vision tower's tensors are not read. GGUF (llama.cpp's ``gemma2`` / ``gemma3``): as the Llama family's names, plus

    blk.N.post_attention_norm   post_attention_layernorm
    blk.N.ffn_norm              pre_feedforward_layernorm
    blk.N.post_ffw_norm         post_feedforward_layernorm

with every norm stored as ``1 + weight`` (llama.cpp's converter adds the one) and no q/k row
permutation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
from flax import nnx

from jaxserve.model.layers.causal_lm import CausalLM
from jaxserve.model.layers.embedding import Embedding
from jaxserve.model.layers.mlp import GatedMLP
from jaxserve.model.layers.norm import RMSNorm
from jaxserve.model.layers.self_attention import SelfAttention
from jaxserve.model.weight_mapping import (
    COPY,
    FLATTEN,
    GGUF_LAYER_NAMES,
    Layout,
    TensorSource,
    flat_name,
    gguf_name,
)

if TYPE_CHECKING:
    from jaxserve.model.arch_config import ModelArchConfig

_GGUF_LAYER_NAMES = {
    **GGUF_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# Prefixes of the language model's tensors in a Gemma3ForConditionalGeneration checkpoint:
# Google's published checkpoints (and transformers 5's save_pretrained) use the first,
# transformers 4.52-4.x the second.
_MULTIMODAL_PREFIXES = ("language_model.model.", "model.language_model.")
_MULTIMODAL_HEADS = ("language_model.lm_head.", "lm_head.")
NAMINGS = ("hf", "gguf", "jaxserve")


class GemmaDecoderLayer(nnx.Module):
    """``x + post_attn_norm(attn(input_norm(x)))`` then
    ``x + post_ffw_norm(mlp(pre_ffw_norm(x)))``."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, dtype, rngs: nnx.Rngs):
        e, eps = cfg.hidden_size, cfg.rms_norm_eps
        norm = dict(unit_offset=cfg.rms_norm_unit_offset)
        self.input_layernorm = RMSNorm(e, eps, dtype, **norm)
        self.self_attn = SelfAttention(cfg, layer_idx, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(e, eps, dtype, **norm)
        self.pre_feedforward_layernorm = RMSNorm(e, eps, dtype, **norm)
        self.mlp = GatedMLP(
            e,
            cfg.intermediate_size,
            bias=cfg.mlp_bias,
            dtype=dtype,
            rngs=rngs,
            activation=cfg.hidden_act,
        )
        self.post_feedforward_layernorm = RMSNorm(e, eps, dtype, **norm)

    def __call__(self, x, positions, kv_cache=None, metadata=None):
        """``x [T, e]`` (paged, with ``kv_cache`` and ``metadata``) or ``[B, L, e]`` (dense),
        positions int32 ``[T]`` / ``[B, L]`` -> ``(x' of x's shape, updated kv_cache or None)``;
        see ``SelfAttention.__call__``."""
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, metadata)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), getattr(metadata, "lora", None))
        return x + self.post_feedforward_layernorm(h), kv_cache


class GemmaForCausalLM(CausalLM):
    """The Gemma 2 / Gemma 3 causal LM: scaled token embedding, decoder layers, final RMSNorm,
    tied LM head with an optional final-logit soft cap.

    Parameters mirror Hugging Face's module names without the language model's prefix:
    ``embed_tokens.weight``, ``layers.N.{input_layernorm, post_attention_layernorm,
    pre_feedforward_layernorm, post_feedforward_layernorm}.weight``,
    ``layers.N.self_attn.{q,k,v,o}_proj.weight`` (``.bias`` with ``attention_bias``),
    ``layers.N.self_attn.{q,k}_norm.weight`` (Gemma 3), ``layers.N.mlp.{gate,up,down}_proj.weight``,
    ``norm.weight``, and ``lm_head.weight`` only for a config with untied embeddings (no
    released Gemma has one).

    Args:
      config: the architecture (``ModelArchConfig.from_hf_config``), one of
        ``GEMMA_ARCHITECTURES``.
      dtype: parameter and activation dtype (``jnp.float32`` or ``jnp.bfloat16``); RMSNorm,
        softmax and logits are computed in float32.
      rngs: initialiser keys (``nnx.Rngs(seed)``); weights ~ N(0, 0.02), norm weights 0 (a
        scale of 1), biases 0.
    """

    def __init__(self, config: ModelArchConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        cfg = self.config = config
        self.dtype = jnp.dtype(dtype)
        e = cfg.hidden_size
        self.embed_tokens = Embedding(cfg.vocab_size, e, dtype=dtype, rngs=rngs, scale=e**0.5)
        self.layers = nnx.List(
            [GemmaDecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(e, cfg.rms_norm_eps, dtype, unit_offset=cfg.rms_norm_unit_offset)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Embedding(cfg.vocab_size, e, dtype=dtype, rngs=rngs)
        )

    @classmethod
    def weight_source(cls, path: tuple, config: ModelArchConfig, naming: str) -> TensorSource:
        """Where parameter ``path`` is stored in a checkpoint of ``naming``, and its layout.

        Args:
          path: a parameter path of this model, e.g. ``("layers", 0, "self_attn", "q_proj",
            "weight")``.
          config: the architecture (the HF prefix of a multimodal checkpoint).
          naming: "hf" (Hugging Face safetensors), "gguf" (llama.cpp) or "jaxserve" (our orbax
            layout).

        Raises:
          KeyError: a path this model does not have; ValueError: an unknown naming.
        """
        *module, leaf = [str(p) for p in path]
        proj = module[-1] if module[-1].endswith("_proj") else None
        layout = COPY
        if proj is not None:
            layout = Layout("linear", 2 if proj == "o_proj" else 1) if leaf == "weight" else FLATTEN
        name = flat_name(path)
        if naming == "hf":
            if config.architecture == "Gemma3ForConditionalGeneration":
                if module == ["lm_head"]:
                    return TensorSource(tuple(p + leaf for p in _MULTIMODAL_HEADS), layout)
                return TensorSource(tuple(p + name for p in _MULTIMODAL_PREFIXES), layout)
            return TensorSource((name if module == ["lm_head"] else "model." + name,), layout)
        if naming == "gguf":
            if module[-1].endswith("norm"):  # llama.cpp stores 1 + weight
                layout = Layout(offset=1.0)
            return TensorSource((gguf_name(module, leaf, _GGUF_LAYER_NAMES),), layout)
        if naming == "jaxserve":
            return TensorSource((name,))
        raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
