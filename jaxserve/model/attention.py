"""Attention dispatch: the paged path (KV cache + ragged paged attention) and the dense path.

The paged path writes the step's new K/V into the per-layer cache through the slot mapping,
then attends every query token to its sequence's cached tokens through the block table
(vLLM's PagedAttention, Kwon et al. 2023, in its ragged form: prefill chunks and decodes mixed in
one flat token batch). The metadata describing the batch is an explicit pytree passed into the
jitted step (see docs/ARCHITECTURE.md, "Attention metadata").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.kv_cache_write import write_kv_cache
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

ATTENTION_BACKENDS = ("reference", "pallas")


@dataclasses.dataclass(frozen=True)
class PagedAttentionMetadata:
    """Where this step's tokens go in the paged KV cache and what each one attends to.

    T is the padded token bucket, S the padded sequence bucket.

    Attributes:
      slot_mapping: int32 ``[T]``, flat cache slot of each step token
        (``block_table[pos // block_size] * block_size + pos % block_size``); -1 for padding,
        which writes nowhere.
      block_tables: int32 ``[S, max_blocks_per_seq]``, block ids of each sequence, padded with the
        null block 0.
      context_lens: int32 ``[S]``, tokens of each sequence in the cache after this step's writes
        (cached + new); 0 for padding sequences.
      query_start_loc: int32 ``[S + 1]``, cumulative query lengths; sequence i's tokens are
        ``q[query_start_loc[i]:query_start_loc[i + 1]]``, the last tokens of the sequence.
      num_seqs: int32 ``[]``, real sequences (the rest of S is padding).
      backend: static; "reference" (pure jnp) or "pallas" (the kernel; interpreted on CPU).
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    query_start_loc: jax.Array
    num_seqs: jax.Array
    backend: str = "reference"

    def __post_init__(self):
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(f"backend must be one of {ATTENTION_BACKENDS}, got {self.backend!r}")


jax.tree_util.register_dataclass(
    PagedAttentionMetadata,
    data_fields=["slot_mapping", "block_tables", "context_lens", "query_start_loc", "num_seqs"],
    meta_fields=["backend"],
)

KVCache = tuple[jax.Array, jax.Array]  # (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: KVCache,
    metadata: PagedAttentionMetadata,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> tuple[jax.Array, KVCache]:
    """Writes this step's K/V into the cache, then runs ragged paged attention.

    Args:
      q: ``[T, Hq, D]`` queries (RoPE applied).
      k, v: ``[T, Hkv, D]`` new keys (RoPE applied) and values, cache dtype.
      kv_cache: ``(k_cache, v_cache)``, each ``[num_blocks, block_size, Hkv, D]``; donate them.
      metadata: the step's ``PagedAttentionMetadata``.
      sm_scale: softmax scale, usually ``head_dim ** -0.5``.
      soft_cap: attention-logit soft cap (``cap * tanh(s / cap)``), or None.
      sliding_window: keys at positions ``> q_pos - sliding_window`` are visible, or None (all).

    Returns:
      ``(out [T, Hq, D] in q's dtype, (k_cache, v_cache))``; rows for padding tokens are
      unspecified (finite).
    """
    k_cache, v_cache = write_kv_cache(kv_cache[0], kv_cache[1], k, v, metadata.slot_mapping)
    kwargs = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if metadata.backend == "pallas":
        attend = ragged_paged_attention
        kwargs["interpret"] = jax.default_backend() == "cpu"
    else:
        attend = ragged_paged_attention_reference
    out = attend(
        q,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.context_lens,
        metadata.query_start_loc,
        metadata.num_seqs,
        **kwargs,
    )
    return out.astype(q.dtype), (k_cache, v_cache)


def dense_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Causal grouped-query attention over whole sequences at positions 0..L-1, no cache.

    Args:
      q: ``[B, L, Hq, D]``; k, v: ``[B, L, Hkv, D]`` with ``Hq % Hkv == 0`` (query head h reads
        kv head ``h // (Hq // Hkv)``, as HF's ``repeat_kv``).
      sm_scale, soft_cap, sliding_window: as in ``paged_attention``.

    Returns:
      ``[B, L, Hq, D]`` in q's dtype; scores and softmax in float32. Right-padding after the
      real tokens cannot change them (causality).
    """
    b, l, hq, d = q.shape
    hkv = k.shape[2]
    q_blkgd = q.reshape(b, l, hkv, hq // hkv, d)
    s_bkgls = (
        jnp.einsum("blkgd,bskd->bkgls", q_blkgd, k, preferred_element_type=jnp.float32) * sm_scale
    )
    if soft_cap is not None:
        s_bkgls = soft_cap * jnp.tanh(s_bkgls / soft_cap)
    q_pos = jnp.arange(l)[:, None]
    k_pos = jnp.arange(l)[None, :]
    mask_ls = k_pos <= q_pos
    if sliding_window is not None:
        mask_ls &= k_pos > q_pos - sliding_window
    s_bkgls = jnp.where(mask_ls, s_bkgls, -jnp.inf)
    p_bkgls = jax.nn.softmax(s_bkgls, axis=-1).astype(v.dtype)
    out_blkgd = jnp.einsum("bkgls,bskd->blkgd", p_bkgls, v, preferred_element_type=jnp.float32)
    return out_blkgd.reshape(b, l, hq, d).astype(q.dtype)
