"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE, in Flax NNX.

The Llama decoder (``jaxserve.model.models.llama``: pre-norm, grouped-query attention with RoPE,
residuals) with the feed-forward of each layer a ``SparseMoeBlock``
(``jaxserve.model.layers.moe``: top-k router, experts as grouped matmuls over tokens sorted by
expert) or, where the config says so (Qwen's ``mlp_only_layers`` / ``decoder_sparse_step``), a
dense ``GatedMLP``. The architectures differ in switches read from ``ModelArchConfig`` and its
``MoEConfig``:

    Mixtral      top-k renormalised; Mistral's attention (optional sliding window)
    Qwen2-MoE    norm_topk_prob from config; q/k/v bias; a shared expert with a sigmoid gate
    Qwen3-MoE    norm_topk_prob from config; per-head q/k RMSNorm (Qwen3's attention)

and in their checkpoints' names (``weight_source``): our parameter paths are Hugging Face's
module names without ``model.``, with the feed-forward always at ``layers.N.mlp`` (Mixtral
stores it as ``block_sparse_moe``), and each expert stacked on our leading axis:

    ours (layers.N.mlp.)              Mixtral (block_sparse_moe.)   Qwen2/3-MoE (mlp.)
    gate.weight [e, E]                gate.weight [E, e]            gate.weight
    experts.gate_proj.weight [E,e,f]  experts.i.w1.weight [f, e]    experts.i.gate_proj.weight
    experts.up_proj.weight [E,e,f]    experts.i.w3.weight           experts.i.up_proj.weight
    experts.down_proj.weight [E,f,e]  experts.i.w2.weight [e, f]    experts.i.down_proj.weight
    shared_expert.{gate,up,down}_proj, shared_expert_gate            (Qwen2-MoE only)

Every other name (attention, norms, embeddings, dense layers) is the Llama family's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.layers.embedding import Embedding
from jaxserve.model.layers.mlp import GatedMLP
from jaxserve.model.layers.moe import SparseMoeBlock
from jaxserve.model.layers.norm import RMSNorm
from jaxserve.model.layers.self_attention import SelfAttention
from jaxserve.model.models.llama import LlamaForCausalLM
from jaxserve.model.weight_mapping import Layout, TensorSource

if TYPE_CHECKING:
    from jaxserve.model.arch_config import ModelArchConfig
    from jaxserve.model.attention import KVCache, PagedAttentionMetadata

# Our expert projection -> each family's per-expert tensor name.
_MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_TORCH_LINEAR = Layout("linear", 1)


class MoEDecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + moe(norm(x))`` (or a dense MLP)."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = SelfAttention(cfg, layer_idx, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.moe.sparse_layers[layer_idx]:
            self.mlp = SparseMoeBlock(
                cfg.hidden_size, cfg.moe, dtype=dtype, rngs=rngs, layer_index=layer_idx
            )
        else:
            self.mlp = GatedMLP(
                cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs
            )

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache | None = None,
        metadata: PagedAttentionMetadata | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """As ``llama.DecoderLayer``: ``x [T, e]`` paged or ``[B, L, e]`` dense -> ``(x',
        kv_cache)``. On the paged path the bucket's padding tokens reach no expert."""
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, metadata)
        x = x + h
        h = self.post_attention_layernorm(x)
        if not isinstance(self.mlp, SparseMoeBlock):  # dense: the step's adapters (#33)
            return x + self.mlp(h, getattr(metadata, "lora", None)), kv_cache
        if metadata is None:
            return x + self.mlp(h), kv_cache
        real = metadata.query_start_loc[metadata.num_seqs]
        token_mask = jnp.arange(x.shape[0], dtype=jnp.int32) < real
        return x + self.mlp(h, token_mask, metadata.mesh), kv_cache


class MixtralForCausalLM(LlamaForCausalLM):
    """The MoE causal LM (Mixtral; ``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM`` below
    differ only in checkpoint names): token embedding, decoder layers with MoE feed-forwards,
    final RMSNorm, LM head. The paged and dense forwards and ``compute_logits`` are the Llama
    family's.

    Args:
      config: the architecture (``ModelArchConfig.from_hf_config``, with ``moe`` set).
      dtype: parameter and activation dtype; routing, norms, softmax and logits in float32.
      rngs: initialiser keys.
    """

    def __init__(self, config: ModelArchConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        cfg = self.config = config
        if cfg.moe is None:
            raise ValueError(f"{type(self).__name__} needs a config with experts (moe is None)")
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List(
            [MoEDecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        )

    # The HF module name of the feed-forward, and of each expert projection.
    hf_mlp_name = "block_sparse_moe"
    hf_expert_names = _MIXTRAL_EXPERTS

    @classmethod
    def weight_source(cls, path: tuple, config: ModelArchConfig, naming: str) -> TensorSource:
        """Where parameter ``path`` is stored in a checkpoint of ``naming`` ("hf" or
        "jaxserve"; see the module docstring), and its layout.

        Raises:
          KeyError: a path this model does not have; ValueError: an unknown naming, or "gguf"
            (MoE GGUF files are not read).
        """
        parts = [str(p) for p in path]
        if naming == "gguf":
            raise ValueError(f"{config.architecture}: GGUF checkpoints of MoE models are not read")
        routed = len(parts) > 4 and parts[2] == "mlp"
        routed = routed and parts[3] in ("gate", "experts", "shared_expert_gate")
        if naming != "hf" or not routed:  # Llama's names (Qwen2-MoE's shared_expert included)
            return LlamaForCausalLM.weight_source(path, config, naming)
        prefix = f"model.layers.{parts[1]}.{cls.hf_mlp_name}"
        if parts[3] != "experts":  # the router, or the shared expert's gate: torch Linear [out, in]
            return TensorSource((f"{prefix}.{parts[3]}.{parts[-1]}",), _TORCH_LINEAR)
        name = cls.hf_expert_names[parts[4]]
        experts = range(config.moe.num_experts)
        return TensorSource.stack(
            tuple(f"{prefix}.experts.{i}.{name}.{parts[-1]}" for i in experts), _TORCH_LINEAR
        )


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the MoE decoder with q/k/v biases and a shared
    expert; Hugging Face names ``mlp.experts.i.{gate,up,down}_proj``."""

    hf_mlp_name = "mlp"
    hf_expert_names = {p: p for p in _MIXTRAL_EXPERTS}


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the MoE decoder with per-head q/k RMSNorm,
    no shared expert; Qwen2-MoE's names."""
