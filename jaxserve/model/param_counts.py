"""Parameter counts and weight bytes of a model from its ``ModelArchConfig`` alone (jax-free, no
weights): total, active per token (a MoE token reaches only its top-k experts) and the routed
experts' share. For sizing a deployment (weights per device, ``jaxserve plan``) and the MoE
paper plan in docs/PARALLELISM.md; tests check it against the built model's parameters.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.model.arch_config import ModelArchConfig


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model (numbers of weights, not bytes).

    Attributes:
      total: every parameter (embeddings and LM head included).
      active: those one token reads: the total with each MoE layer's routed experts counted
        ``top_k`` times instead of ``num_experts`` (equal to ``total`` for a dense model).
      routed_experts: the MoE layers' routed expert matrices, all experts (0 for a dense model);
        what expert parallelism splits by expert.
    """

    total: int
    active: int
    routed_experts: int

    def weight_bytes(self, bytes_per_param: float = 2.0) -> float:
        """Bytes of all weights at ``bytes_per_param`` (2 for bfloat16)."""
        return self.total * bytes_per_param


def parameter_counts(cfg: ModelArchConfig) -> ParamCounts:
    """Counts ``cfg``'s parameters as jaxserve builds them (llama / MoE families).

    Returns:
      ``ParamCounts``; e.g. Mixtral-8x7B 46.70e9 total, 12.88e9 active; Qwen3-30B-A3B 30.53e9 and 3.35e9.
    """
    e, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    attn = e * hq * d + 2 * e * hkv * d + hq * d * e + 2 * e  # q, k, v, o; two RMSNorms
    if cfg.qkv_bias:
        attn += hq * d + 2 * hkv * d
    if cfg.o_bias:
        attn += e
    if cfg.qk_norm:
        attn += 2 * d
    dense_mlp = 3 * e * cfg.intermediate_size + (
        2 * cfg.intermediate_size + e if cfg.mlp_bias else 0
    )
    total = active = routed = 0
    moe = cfg.moe
    for i in range(cfg.num_layers):
        total += attn
        active += attn
        if moe is None or not moe.sparse_layers[i]:
            total += dense_mlp
            active += dense_mlp
            continue
        one_expert = 3 * e * moe.intermediate_size
        other = e * moe.num_experts  # the router
        if moe.shared_expert_intermediate_size:
            other += 3 * e * moe.shared_expert_intermediate_size + e  # and its gate
        routed += one_expert * moe.num_experts
        total += other + one_expert * moe.num_experts
        active += other + one_expert * moe.top_k
    embed = cfg.vocab_size * e * (1 if cfg.tie_word_embeddings else 2) + e  # final norm
    return ParamCounts(total=total + embed, active=active + embed, routed_experts=routed)
