"""Ragged paged attention in pure jnp whose cost follows the context actually present.

The "reference" backend's path (CPU, or any platform without a kernel). The test oracle,
``pallas_kernels.ragged_paged_attention.ragged_paged_attention_reference``, gathers every token's
whole padded block-table row (``[T, P * block_size, Hkv, D]`` per layer, ``P = max_model_len /
block_size``) whatever the contexts are. This path walks the block table in chunks of
``KEYS_PER_CHUNK`` keys with an online softmax (flash attention's running max and sum) and stops
after the chunk holding the step's longest context: a decode batch at 200-token contexts under a
1,024-token ``max_model_len`` reads 256 keys per token instead of 1,024. The trip count is a
traced value (``lax.while_loop``), so one compiled step serves every context length: no extra
buckets, no extra compiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

KEYS_PER_CHUNK = 64
"""Keys per loop iteration (rounded to whole blocks): small enough that short contexts read
little, large enough that the loop's per-iteration cost stays small on CPU."""


def chunked_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    keys_per_chunk: int = KEYS_PER_CHUNK,
) -> jax.Array:
    """Ragged paged attention (the reference's signature and semantics), chunked over keys.

    Args:
      q: ``[T, Hq, D]`` queries.
      k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` with ``Hq % Hkv == 0``; in q's
        dtype or FP8 (each chunk is widened to float32 as it is read).
      block_tables: int32 ``[S, P]``; context_lens: int32 ``[S]``; query_start_loc: int32
        ``[S + 1]``; num_seqs: int32 ``[]`` (see ``PagedAttentionMetadata``).
      sm_scale, soft_cap, sliding_window: as in ``paged_attention``.
      keys_per_chunk: keys read per loop iteration (rounded down to whole blocks, at least one).

    Returns:
      ``[T, Hq, D]`` in ``q.dtype``; scores and softmax in float32; rows of padding tokens are
      zero.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seq_slots, pages_per_seq = block_tables.shape
    group = num_q_heads // num_kv_heads
    chunk_pages = max(1, min(pages_per_seq, keys_per_chunk // block_size))
    chunk_keys = chunk_pages * block_size
    pad = -pages_per_seq % chunk_pages
    if pad:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, pad)))
    num_seqs = jnp.asarray(num_seqs, jnp.int32)

    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start_loc[1:], tokens, side="right", method="compare_all")
    seq = jnp.minimum(seq, num_seq_slots - 1)  # [T]
    token_valid = tokens < query_start_loc[num_seqs]
    token_pos = context_lens[seq] - query_start_loc[seq + 1] + tokens  # [T]
    pages = block_tables[seq]  # [T, P']
    # Chunks to visit: every key of the longest real context (padding sequences have length 0).
    longest = jnp.max(jnp.where(jnp.arange(num_seq_slots) < num_seqs, context_lens, 0))
    num_chunks = (longest + chunk_keys - 1) // chunk_keys
    first = jnp.int32(0)
    if sliding_window is not None:  # chunks wholly before every token's window are skipped
        lowest = jnp.min(jnp.where(token_valid, token_pos - sliding_window + 1, longest))
        first = jnp.clip(lowest, 0, None) // chunk_keys

    q_f32 = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    hi = lax.Precision.HIGHEST

    def body(carry):
        i, m, l, acc = carry
        chunk = lax.dynamic_slice_in_dim(pages, i * chunk_pages, chunk_pages, axis=1)
        k = k_cache[chunk].reshape(num_tokens, chunk_keys, num_kv_heads, head_dim)
        v = v_cache[chunk].reshape(num_tokens, chunk_keys, num_kv_heads, head_dim)
        s = jnp.einsum("tkgd,tlkd->tkgl", q_f32, k.astype(jnp.float32), precision=hi) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = i * chunk_keys + jnp.arange(chunk_keys, dtype=jnp.int32)
        mask = token_valid[:, None] & (key_pos[None, :] <= token_pos[:, None])  # [T, L]
        if sliding_window is not None:
            mask &= key_pos[None, :] > (token_pos - sliding_window)[:, None]
        mask = mask[:, None, None, :]
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))  # -inf while a row has seen no key
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        scale = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        l = l * scale + p.sum(axis=-1)
        pv = jnp.einsum("tkgl,tlkd->tkgd", p, v.astype(jnp.float32), precision=hi)
        acc = acc * scale[..., None] + pv
        return i + 1, m_new, l, acc

    shape = (num_tokens, num_kv_heads, group)
    init = (
        first,
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    _, _, l, acc = lax.while_loop(lambda c: c[0] < num_chunks, body, init)
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
