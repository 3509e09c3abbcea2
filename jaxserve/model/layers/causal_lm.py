"""The forward passes every decoder-only family shares: embed -> decoder layers -> final norm ->
LM head.

A family class derives from ``CausalLM`` and builds ``embed_tokens`` (an ``Embedding``),
``layers`` (decoder layers called ``layer(x, positions, kv_cache, metadata) -> (x, kv_cache)``),
``norm`` and ``lm_head`` (an ``Embedding``, or None for tied embeddings), and sets ``config``;
the paged ``__call__``, ``compute_logits`` and ``forward_dense`` come from here.

``run_layers`` is the one place a layer finds its KV cache and its view of the step's metadata:
layer ``i`` gets ``metadata.for_layer(i)``, the pool's array pair it uses and its KV-cache
group's ``[T]`` slots and ``[S, P]`` block table (#29's hybrid cache, where sliding-window
layers keep only their window: ``jaxserve/core/kv_cache_groups.py``; with one group, pair ``i``
and the step's only table). The families never see the groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

if TYPE_CHECKING:
    from jaxserve.model.attention import KVCache, PagedAttentionMetadata


def run_layers(
    layers: Sequence,
    x: jax.Array,
    positions: jax.Array,
    kv_caches: Sequence[KVCache] | None = None,
    metadata: PagedAttentionMetadata | None = None,
) -> tuple[jax.Array, list[KVCache] | None]:
    """Applies ``layers`` in order: ``x, cache = layer(x, positions, cache, metadata)``.

    Args:
      layers: decoder layers.
      x: ``[T, e]`` (paged) or ``[B, L, e]`` (dense) hidden states.
      positions: int32 ``[T]`` / ``[B, L]``.
      kv_caches: paged: the pool's ``(k_cache, v_cache)`` pairs (one per layer, or per layer of
        a KV-cache group when groups share them: ``metadata.for_layer``); dense: None.
      metadata: paged: the step's ``PagedAttentionMetadata`` (each layer gets its view,
        ``for_layer(i)``); dense: None.

    Returns:
      ``(x after the last layer, the updated caches)``; dense: ``(x, None)``.
    """
    if metadata is None:
        for layer in layers:
            x, _ = layer(x, positions)
        return x, None
    caches = list(kv_caches)
    for i, layer in enumerate(layers):
        pair, layer_md = metadata.for_layer(i)
        x, caches[pair] = layer(x, positions, caches[pair], layer_md)
    return x, caches


class CausalLM(nnx.Module):
    """Base of the family classes (``jaxserve.model.registry``'s contract): the two forward
    paths and the LM head over the attributes the family builds (see the module docstring).

    The LM head soft-caps its logits when ``config.final_logit_softcapping`` is set (Gemma 2).
    """

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
        x = self.embed_tokens(input_ids)  # [T, e]
        x, kv_caches = run_layers(self.layers, x, positions, kv_caches, metadata)
        return self.norm(x), kv_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """``hidden [..., e]`` (output of ``__call__``) -> float32 logits ``[..., v]``."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head.attend(hidden, soft_cap=self.config.final_logit_softcapping)

    def forward_dense(self, input_ids: jax.Array) -> jax.Array:
        """Dense causal forward: int32 ``[B, L]`` at positions 0..L-1 -> float32 logits ``[B, L, v]``.

        No cache; for the dense oracle, HF parity tests and training. Right-padding does not
        change the logits of earlier positions.
        """
        positions = jnp.broadcast_to(
            jnp.arange(input_ids.shape[-1], dtype=jnp.int32), input_ids.shape
        )
        x, _ = run_layers(self.layers, self.embed_tokens(input_ids), positions)  # [B, L, e]
        return self.compute_logits(self.norm(x))
