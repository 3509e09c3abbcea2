"""The Llama family (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3) in Flax NNX.

One pre-norm decoder (Touvron et al. 2023): RMSNorm -> grouped-query attention with RoPE ->
residual -> RMSNorm -> SwiGLU MLP -> residual. The architectures differ only in switches read from
``ModelArchConfig``: q/k/v bias (Qwen2), per-head q/k RMSNorm before RoPE (Qwen3), sliding-window
layers (Mistral), tied embeddings, RoPE scaling. Mirrors transformers' ``modeling_llama.py``; the
layers come from ``jaxserve.model.layers``.

Letters in shape comments: T tokens (B, L: batch and length on the dense path), e hidden, v vocab.

Two forward paths share every layer:
  * paged: ``model(input_ids [T], positions [T], kv_caches, metadata) -> (hidden [T, e], kv_caches)``
    then ``model.compute_logits(hidden [S, e]) -> [S, v]`` float32;
  * dense: ``model.forward_dense(input_ids [B, L]) -> [B, L, v]`` float32, causal, no cache.
Layers are a Python loop (no scan) so each layer's donated cache is updated in place.

Checkpoints (``LlamaForCausalLM.weight_source``): our parameter paths are Hugging Face's module
names without the ``model.`` prefix, so a HF name is ``"model." + path`` (``lm_head.weight``
as is); torch Linear weights ``[out, in]`` are transposed into ``[*in, *out]``. GGUF names
(llama.cpp's ``tensor_mapping.py``):

    token_embd.weight            embed_tokens.weight
    output.weight                lm_head.weight (absent: tied embeddings)
    output_norm.weight           norm.weight
    blk.N.attn_{q,k,v}.{weight,bias}, blk.N.attn_output.weight   self_attn.{q,k,v,o}_proj
    blk.N.attn_{q,k}_norm.weight self_attn.{q,k}_norm.weight (Qwen3)
    blk.N.ffn_{gate,up,down}.weight   mlp.{gate,up,down}_proj.weight
    blk.N.attn_norm / ffn_norm   input_layernorm / post_attention_layernorm

with llama.cpp's q/k row permutation undone for Llama and Mistral files (its converter permutes
them for ``llama`` models only).
"""

from __future__ import annotations

import dataclasses
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


_GGUF_LAYER_NAMES = {**GGUF_LAYER_NAMES, "post_attention_layernorm": "ffn_norm"}
# Architectures whose GGUF q/k rows llama.cpp's converter permutes (GGUF "llama", "mistral").
_PERMUTED_QK = ("LlamaForCausalLM", "MistralForCausalLM")
NAMINGS = ("hf", "gguf", "jaxserve")


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = SelfAttention(cfg, layer_idx, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = GatedMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            bias=cfg.mlp_bias,
            dtype=dtype,
            rngs=rngs,
            activation=cfg.hidden_act,
        )

    def __call__(self, x, positions, kv_cache=None, metadata=None):
        """``x [T, e]`` (paged, with ``kv_cache`` and ``metadata``) or ``[B, L, e]`` (dense),
        positions int32 ``[T]`` / ``[B, L]`` -> ``(x' of x's shape, updated kv_cache or None)``;
        see ``SelfAttention.__call__``."""
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, metadata)
        x = x + h
        lora = getattr(metadata, "lora", None)  # the step's adapters (#33), or None
        return x + self.mlp(self.post_attention_layernorm(x), lora), kv_cache


class LlamaForCausalLM(CausalLM):
    """The causal LM: token embedding, decoder layers, final RMSNorm, LM head.

    Parameters mirror Hugging Face's module names without the ``model.`` prefix:
    ``embed_tokens.weight``, ``layers.N.{input_layernorm, post_attention_layernorm}.weight``,
    ``layers.N.self_attn.{q,k,v,o}_proj.{weight,bias}``, ``layers.N.self_attn.{q,k}_norm.weight``,
    ``layers.N.mlp.{gate,up,down}_proj.{weight,bias}``, ``norm.weight``, ``lm_head.weight``
    (absent when tied).

    Args:
      config: the architecture (``ModelArchConfig.from_hf_config``).
      dtype: parameter and activation dtype (``jnp.float32`` or ``jnp.bfloat16``); RMSNorm,
        softmax and logits are computed in float32.
      rngs: initialiser keys (``nnx.Rngs(seed)``); weights ~ N(0, 0.02), norms 1, biases 0.
    """

    def __init__(self, config: ModelArchConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        cfg = self.config = config
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Embedding(
                cfg.draft_vocab_size or cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs
            )
        )

    @classmethod
    def weight_source(cls, path: tuple, config: ModelArchConfig, naming: str) -> TensorSource:
        """Where parameter ``path`` is stored in a checkpoint of ``naming``, and its layout.

        Args:
          path: a parameter path of this model, e.g. ``("layers", 0, "self_attn", "q_proj",
            "weight")``.
          config: the architecture (GGUF: whether and over how many heads q/k rows are
            permuted).
          naming: "hf" (Hugging Face safetensors), "gguf" (llama.cpp) or "jaxserve" (our orbax
            layout, with the pre-``Linear`` names as a fallback).

        Raises:
          KeyError: a path this model does not have; ValueError: an unknown naming.
        """
        *module, leaf = [str(p) for p in path]
        proj = module[-1] if module[-1].endswith("_proj") else None
        layout = COPY
        if proj is not None:
            layout = Layout("linear", 2 if proj == "o_proj" else 1) if leaf == "weight" else FLATTEN
        if naming == "hf":
            if module == ["lm_head"]:
                return TensorSource((flat_name(path),), layout)
            # a base model saved on its own (sentence-transformers, Qwen3-Embedding) has no
            # "model." prefix
            return TensorSource(("model." + flat_name(path), flat_name(path)), layout)
        if naming == "gguf":
            name = gguf_name(module, leaf, _GGUF_LAYER_NAMES)
            if proj in ("q_proj", "k_proj") and config.architecture in _PERMUTED_QK:
                heads = config.num_heads if proj == "q_proj" else config.num_kv_heads
                layout = dataclasses.replace(layout, permuted_heads=heads)
            return TensorSource((name,), layout)
        if naming == "jaxserve":
            # Before Linear layers: "q_proj" held the weight, "q_bias" the bias, and the
            # embedding and LM head matrices were leaves of their own.
            old = module[:-1] + [proj[: -len("_proj")] + "_bias"] if leaf == "bias" else module
            if leaf == "bias" or proj is not None or module[-1] in ("embed_tokens", "lm_head"):
                return TensorSource((flat_name(path), ".".join(old)))
            return TensorSource((flat_name(path),))
        raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
