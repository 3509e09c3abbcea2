"""Ragged paged attention: one kernel for prefill chunks and decode tokens.

One call serves a whole scheduler step (vLLM V1's "unified attention"): the
query tokens of many sequences are concatenated, each sequence contributing a
prefill chunk or a single decode token, and every token attends causally to
its sequence's cached context plus the sequence's own new tokens, reading K/V
from the paged cache through the sequence's block table. Padding tokens (past
``query_start_loc[num_seqs]``) and padding sequences (index >= ``num_seqs``)
are ignored.

Layout (docs/ARCHITECTURE.md):

    q               [T, Hq, D]                    model dtype
    k_cache/v_cache [N, block_size, Hkv, D]       model dtype, or FP8 (widened per KV tile)
    block_tables    [S, P] int32                  padded with block 0 (null)
    context_lens    [S] int32    tokens in the cache after this step's writes
    query_start_loc [S + 1] int32  cumulative query lengths
    num_seqs        [] int32     real sequences

Token ``j`` of sequence ``i`` sits at position ``context_lens[i] - q_len_i + j``
and sees key positions ``k`` with ``k <= pos`` and, with a sliding window
``W``, ``k > pos - W`` (the last ``W`` tokens including itself, as in
Mistral / vLLM's ``window_size=(W - 1, 0)``). Optional logit soft-capping
(Gemma 2) replaces a logit ``x`` by ``soft_cap * tanh(x / soft_cap)``.

The file has the four layers of the JAX Pallas ops: the kernel body, the
``pallas_call`` wrapper with its grid and block specs, the public jitted
function that validates inputs, and a pure-jnp reference with the same
signature. The kernel targets the Pallas Triton backend (GPU) and runs in
interpret mode on CPU for tests.

Algorithm: FlashAttention-2's online softmax (Dao, 2023) over KV tiles gathered
through the block table (PagedAttention, Kwon et al., 2023), with GQA packing
(all query heads of a KV head share one program, so each KV tile is read once
per group) and flash-decoding (the context is split over several programs and
the partial results merged by log-sum-exp) when the query tiles alone do not
fill the GPU. Tile sizes come from ``attention_tuning.choose_config``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention_tuning import KernelConfig, choose_config
from pallas_kernels.bucketing import is_power_of_2, next_power_of_2

# Logit of a masked (query, key) pair, finite so fully masked rows stay NaN-free.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Running max before any key was seen; below MASK_VALUE so that a split whose
# keys are all masked gets zero weight in the merge.
_M_INIT = float(np.finfo(np.float32).min)
_LOG2E = math.log2(math.e)
_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# FP8 caches (``--kv-cache-dtype fp8``): the kernels widen each KV tile to q's dtype as they read
# it; the per-tensor scales are applied by the caller (``jaxserve.model.attention``).
FP8_CACHE_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static sizes of one kernel launch, derived in the wrapper from the config and shapes.

    Attributes:
      block_q: query tokens per program.
      group: query heads per KV head; group_pad: rounded up to a power of two.
      block_m: query-tile rows, ``block_q * group_pad`` (token, head) pairs, token-major.
      block_k: KV tokens per inner-loop step.
      block_size: tokens per cache block; pages_per_seq: block-table width P.
      num_splits: programs sharing one query tile's KV range (flash-decoding).
      step_pages: cache blocks a KV step touches (1 when a block is larger than a step).
      step_tokens_per_page: tokens a KV step reads from each of those blocks.
      chunk_steps: KV steps whose block ids are loaded at once (a program's whole share when
        small; at most 512 block ids, a few registers per thread).
      chunk_pages: block ids loaded per chunk (doubled for part-block steps, since a chunk of
        them may start mid-block).
    """

    block_q: int
    group: int
    group_pad: int
    block_m: int
    block_k: int
    block_size: int
    pages_per_seq: int
    num_splits: int
    step_pages: int
    step_tokens_per_page: int
    chunk_steps: int
    chunk_pages: int


def kernel_tiling(
    config: KernelConfig, num_q_heads: int, num_kv_heads: int, block_size: int, pages_per_seq: int
) -> Tiling:
    """The launch's static sizes (see :class:`Tiling`).

    Raises:
      ValueError: the config's query tile (``block_q * group_pad`` rows) or ``block_k`` is below
        16 (tensor-core dots need 16 rows).
    """
    group = num_q_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    block_q, block_k, num_splits = config.block_q, config.block_k, config.num_splits
    if block_q * group_pad < 16 or block_k < 16:
        raise ValueError(
            f"config {config} gives a query tile of {block_q * group_pad} rows or a "
            f"KV tile of {block_k} tokens; both must be >= 16"
        )
    step_pages = max(1, block_k // block_size)
    total_steps = -(-(pages_per_seq * block_size) // block_k)
    steps_per_split = -(-total_steps // num_splits)
    chunk_steps = min(next_power_of_2(steps_per_split), max(1, 512 // step_pages))
    chunk_pages = max(1, chunk_steps * block_k // block_size)
    if block_k < block_size:
        chunk_pages *= 2
    return Tiling(
        block_q=block_q,
        group=group,
        group_pad=group_pad,
        block_m=block_q * group_pad,
        block_k=block_k,
        block_size=block_size,
        pages_per_seq=pages_per_seq,
        num_splits=num_splits,
        step_pages=step_pages,
        step_tokens_per_page=min(block_size, block_k),
        chunk_steps=chunk_steps,
        chunk_pages=chunk_pages,
    )


# Layer 1: the kernel body (one program = one query tile x KV head x split).
def _find_tile(tile, query_start_loc_ref, context_lens_ref, num_seqs_ref, *, block_q, num_tokens):
    """Maps query tile ``tile`` (grid axis 0) to its tokens, as vLLM's Triton
    ``unified_attention`` does: sequence ``i`` owns the tiles from
    ``query_start_loc[i] // block_q + i`` on (one more than it may need, so no
    prefix sum is needed), found by binary search. Tiles after the last
    sequence's cover the padding tokens, which attend to no keys (zero rows).

    Returns scalars: first token, end token (exclusive), position of the first
    token (``-block_q`` when the tile has no keys), sequence index.
    """
    num_seq_slots = context_lens_ref.shape[0]

    def tile_start(i):  # first tile of sequence i (i == S: of the padding tokens)
        return lax.div(query_start_loc_ref[i], block_q) + i

    def search(_, bounds):  # invariant: tile_start(lo) <= tile < tile_start(hi)
        lo, hi = bounds
        mid = lax.div(lo + hi, 2)
        below = tile_start(mid) <= tile
        return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

    steps = max(1, (num_seq_slots + 1).bit_length())
    seq, _ = lax.fori_loop(0, steps, search, (jnp.int32(0), jnp.int32(num_seq_slots + 1)))
    seq_start = query_start_loc_ref[seq]
    offset = (tile - tile_start(seq)) * block_q
    tok_start = jnp.minimum(seq_start + offset, num_tokens)
    is_padding = seq >= num_seq_slots
    seq = jnp.minimum(seq, num_seq_slots - 1)
    seq_end = query_start_loc_ref[seq + 1]
    tok_end = jnp.where(is_padding, num_tokens, seq_end)
    # Padding tokens, tokens of padding sequences and spare tiles see no keys.
    no_keys = is_padding | (seq >= num_seqs_ref[0]) | (tok_start >= tok_end)
    pos_start = jnp.where(no_keys, -block_q, context_lens_ref[seq] - (seq_end - seq_start) + offset)
    return tok_start, tok_end, pos_start, seq


def _attention_kernel(
    query_start_loc_ref,  # [S + 1] int32
    context_lens_ref,  # [S] int32
    num_seqs_ref,  # [1] int32
    block_tables_ref,  # [S, P] int32
    q_ref,  # [T, Gp, D]: this program's KV head group
    k_ref,  # [N * block_size, D]: this KV head's cache slots
    v_ref,  # [N * block_size, D]
    *out_refs,  # o [T, Gp, D] | acc [T, Gp, D] f32, m [T, Gp] f32, l [T, Gp] f32
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    tiling: Tiling,
    precision,
):
    tile = pl.program_id(0)
    split = pl.program_id(2)
    head_dim = q_ref.shape[-1]
    block_q, group, group_pad, block_m = (
        tiling.block_q,
        tiling.group,
        tiling.group_pad,
        tiling.block_m,
    )
    block_k, block_size, num_splits = tiling.block_k, tiling.block_size, tiling.num_splits
    pages_per_seq = tiling.pages_per_seq
    step_pages, step_tokens_per_page = tiling.step_pages, tiling.step_tokens_per_page
    chunk_steps, chunk_pages = tiling.chunk_steps, tiling.chunk_pages

    # Phase 1: the query tokens this program owns, and their positions.
    tok_start, tok_end, pos_start, seq = _find_tile(
        tile,
        query_start_loc_ref,
        context_lens_ref,
        num_seqs_ref,
        block_q=block_q,
        num_tokens=q_ref.shape[0],
    )

    # Rows of the query tile are (token, head-in-group) pairs, token-major.
    tok_valid = tok_start + jnp.arange(block_q, dtype=jnp.int32) < tok_end  # [block_q]
    rows = jnp.arange(block_m, dtype=jnp.int32)
    row_tok = lax.div(rows, group_pad)  # [block_m] token offset in the tile
    row_valid = tok_start + row_tok < tok_end
    row_pos = pos_start + row_tok  # [block_m] position of the row's token

    # Phase 2: the KV range. Keys of the tile: up to the causal end of its last token, from the window
    # start of its first token, aligned down to a whole KV tile; the iterations
    # are shared out over the splits.
    num_tok = jnp.clip(tok_end - tok_start, 0, block_q)
    kv_end = pos_start + num_tok  # <= 0 for tiles without keys
    if sliding_window is None:
        kv_start = jnp.int32(0)
    else:
        kv_start = jnp.maximum(pos_start - sliding_window + 1, 0)
    kv_lo = lax.div(kv_start, block_k) * block_k
    num_iters = lax.div(jnp.maximum(kv_end - kv_lo, 0) + block_k - 1, block_k)
    iters_per_split = lax.div(num_iters + num_splits - 1, num_splits)
    it_lo = jnp.minimum(split * iters_per_split, num_iters)
    it_hi = jnp.minimum(it_lo + iters_per_split, num_iters)

    # Phase 3: the query tile, scaled for base-2 softmax (or for the soft cap).
    tok_rows = pl.ds(tok_start, block_q)
    q = plgpu.load(q_ref.at[tok_rows, :, :], mask=tok_valid[:, None, None], other=0.0)
    q = q.reshape(block_m, head_dim)
    if soft_cap is None:
        q_scale = sm_scale * _LOG2E  # base-2 logits: exp(x) = exp2(x * log2 e)
    else:
        q_scale = sm_scale / soft_cap

    # Phase 4: online softmax over the KV steps [it_lo, it_hi): masked steps at the edges,
    # unmasked ones in between.
    def body(it, carry, *, masked: bool, chunk, page_base):
        acc, m_prev, l_prev = carry
        kv0 = kv_lo + it * block_k
        # This step's block ids, picked from the block-table chunk in registers:
        # K/V addresses then depend on no load inside the loop, so Triton can
        # pipeline the K/V loads several steps deep.
        want = lax.div(kv0, block_size) - page_base + jnp.arange(step_pages, dtype=jnp.int32)
        pick = jnp.arange(chunk_pages, dtype=jnp.int32)[:, None] == want[None, :]
        pages = jnp.sum(jnp.where(pick, chunk[:, None], 0), axis=0)  # [step_pages]
        in_page = lax.rem(kv0, block_size) + jnp.arange(step_tokens_per_page, dtype=jnp.int32)
        slots = (pages[:, None] * block_size + in_page[None, :]).reshape(block_k)
        # [block_k, D], widened to q's dtype here when the cache is FP8
        k = k_ref[slots].astype(q.dtype)
        v = v_ref[slots].astype(q.dtype)
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * q_scale
        if soft_cap is not None:
            s = jnp.tanh(s) * (soft_cap * _LOG2E)
        if masked:
            key_pos = kv0 + jnp.arange(block_k, dtype=jnp.int32)
            mask = row_valid[:, None] & (key_pos[None, :] <= row_pos[:, None])
            if sliding_window is not None:
                mask &= key_pos[None, :] > (row_pos - sliding_window)[:, None]
            s = jnp.where(mask, s, MASK_VALUE)  # [block_m, block_k]

        m_next = jnp.maximum(m_prev, s.max(axis=-1))
        alpha = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s - m_next[:, None])
        l_next = l_prev * alpha + p.sum(axis=-1)
        pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)  # [block_m, D]
        return acc * alpha[:, None] + pv, m_next, l_next

    # KV tiles that every valid row sees whole skip the mask: those ending at or
    # before the first token's position and, with a window, starting after the
    # last token's window start. Invalid rows then see finite garbage (q = 0),
    # which is never stored.
    full_hi = lax.div(jnp.maximum(pos_start + 1 - kv_lo, 0), block_k)
    if sliding_window is None:
        full_lo = it_lo
    else:
        pos_last = pos_start + num_tok - 1
        last_window_end = pos_last - sliding_window - kv_lo  # last key outside the window
        full_lo = jnp.where(
            last_window_end < 0, 0, lax.div(jnp.maximum(last_window_end, 0), block_k) + 1
        )
    unmasked_lo = jnp.clip(full_lo, it_lo, it_hi)
    unmasked_hi = jnp.clip(full_hi, unmasked_lo, it_hi)

    def run(lo, hi, carry, *, masked):
        """KV steps [lo, hi), in chunks of `chunk_steps` whose block ids are
        loaded once per chunk."""

        def chunk_body(c, carry):
            chunk_lo = lo + c * chunk_steps
            page_base = lax.div(kv_lo + chunk_lo * block_k, block_size)
            page_ids = page_base + jnp.arange(chunk_pages, dtype=jnp.int32)
            chunk = plgpu.load(
                block_tables_ref.at[seq, pl.ds(page_base, chunk_pages)],
                mask=page_ids < pages_per_seq,
                other=0,
            )  # [chunk_pages]
            step = functools.partial(body, masked=masked, chunk=chunk, page_base=page_base)
            return lax.fori_loop(chunk_lo, jnp.minimum(chunk_lo + chunk_steps, hi), step, carry)

        num_chunks = lax.div(jnp.maximum(hi - lo, 0) + chunk_steps - 1, chunk_steps)
        return lax.fori_loop(0, num_chunks, chunk_body, carry)

    carry = (
        jnp.zeros((block_m, head_dim), jnp.float32),
        jnp.full((block_m,), _M_INIT, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
    )
    if sliding_window is not None:
        carry = run(it_lo, unmasked_lo, carry, masked=True)
    carry = run(unmasked_lo, unmasked_hi, carry, masked=False)
    acc, m_i, l_i = run(unmasked_hi, it_hi, carry, masked=True)

    # Phase 5: store rows of real heads of valid tokens (padding tokens get zeros): the
    # normalised output, or this split's partials for the merge.
    head_valid = jnp.arange(group_pad, dtype=jnp.int32) < group
    out_mask = tok_valid[:, None] & head_valid[None, :]  # [block_q, Gp]
    if num_splits == 1:
        (o_ref,) = out_refs
        out = acc / jnp.where(l_i == 0.0, 1.0, l_i)[:, None]
        out = out.astype(o_ref.dtype).reshape(block_q, group_pad, head_dim)
        plgpu.store(o_ref.at[tok_rows, :, :], out, mask=out_mask[:, :, None])
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc = acc.reshape(block_q, group_pad, head_dim)
        plgpu.store(acc_ref.at[tok_rows, :, :], acc, mask=out_mask[:, :, None])
        plgpu.store(m_ref.at[tok_rows, :], m_i.reshape(block_q, group_pad), mask=out_mask)
        plgpu.store(l_ref.at[tok_rows, :], l_i.reshape(block_q, group_pad), mask=out_mask)


def merge_split_partials(acc: jax.Array, m: jax.Array, l: jax.Array, *, dtype) -> jax.Array:
    """The flash-decoding merge of per-split partial results (Dao et al., Flash-Decoding, 2023).

    ``out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s`` with ``M = max_s m_s``; a row
    whose keys were all masked in every split (``l`` sums to 0) comes out as zeros.

    Args:
      acc: float32 [splits, T, Hkv, Gp, D], unnormalised partial outputs.
      m: float32 [splits, T, Hkv, Gp], running maxima of the scores (base-2 logits).
      l: float32 [splits, T, Hkv, Gp], softmax denominators relative to ``m``.
      dtype: output dtype.

    Returns:
      [T, Hkv, Gp, D] in ``dtype``.
    """
    m_max = m.max(axis=0)
    w = jnp.exp2(m - m_max[None])  # [splits, T, Hkv, Gp]
    l_sum = (w * l).sum(axis=0)
    o = (w[..., None] * acc).sum(axis=0)
    return (o / jnp.where(l_sum == 0.0, 1.0, l_sum)[..., None]).astype(dtype)


# Layer 2: the pallas_call wrapper: grid, block specs, split merge.
def num_query_tiles(num_tokens: int, num_seq_slots: int, block_q: int) -> int:
    """Static size of grid axis 0: each sequence's tiles start at
    ``query_start_loc[i] // block_q + i``, then the padding tokens' tiles."""
    return num_tokens // block_q + num_seq_slots + 1


def _ragged_paged_attention_pallas(
    q,  # [T, Hq, D]
    k_cache,  # [N, bs, Hkv, D]
    v_cache,  # [N, bs, Hkv, D]
    block_tables,  # [S, P] int32
    context_lens,  # [S] int32
    query_start_loc,  # [S + 1] int32
    num_seqs,  # [] int32
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    config: KernelConfig,
    interpret: bool,
):
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seq_slots, pages_per_seq = block_tables.shape
    tiling = kernel_tiling(config, num_q_heads, num_kv_heads, block_size, pages_per_seq)
    group, group_pad = tiling.group, tiling.group_pad
    block_q, num_splits = tiling.block_q, tiling.num_splits
    num_tiles = num_query_tiles(num_tokens, num_seq_slots, block_q)

    # Views without copies (except padding the group to a power of two):
    # q as [T, Hkv, Gp, D] and the caches as flat slots [N * bs, Hkv, D].
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if group_pad != group:
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    num_slots = num_blocks * block_size
    k_slots = k_cache.reshape(num_slots, num_kv_heads, head_dim)
    v_slots = v_cache.reshape(num_slots, num_kv_heads, head_dim)

    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
    kernel = functools.partial(
        _attention_kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        tiling=tiling,
        precision=precision,
    )
    kv_spec = pl.BlockSpec((num_slots, None, head_dim), lambda t, h, s: (0, h, 0))
    group_block = (num_tokens, None, group_pad, head_dim)
    in_specs = [
        pl.BlockSpec((num_seq_slots + 1,), lambda t, h, s: (0,)),
        pl.BlockSpec((num_seq_slots,), lambda t, h, s: (0,)),
        pl.BlockSpec((1,), lambda t, h, s: (0,)),
        pl.BlockSpec((num_seq_slots, pages_per_seq), lambda t, h, s: (0, 0)),
        pl.BlockSpec(group_block, lambda t, h, s: (0, h, 0, 0)),
        kv_spec,
        kv_spec,
    ]
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct(q4.shape, q.dtype)]
        out_specs = [pl.BlockSpec(group_block, lambda t, h, s: (0, h, 0, 0))]
    else:
        part = (num_splits, num_tokens, num_kv_heads, group_pad)
        out_shape = [
            jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, *group_block), lambda t, h, s: (s, 0, h, 0, 0)),
            pl.BlockSpec((None, num_tokens, None, group_pad), lambda t, h, s: (s, 0, h, 0)),
            pl.BlockSpec((None, num_tokens, None, group_pad), lambda t, h, s: (s, 0, h, 0)),
        ]
    outs = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name=f"ragged_paged_attention_bq{block_q}_bk{config.block_k}_s{num_splits}",
    )(query_start_loc, context_lens, num_seqs.reshape(1), block_tables, q4, k_slots, v_slots)

    if num_splits == 1:
        (o,) = outs  # [T, Hkv, Gp, D]
    else:
        o = merge_split_partials(*outs, dtype=q.dtype)
    if group_pad != group:
        o = o[:, :, :group]
    return o.reshape(num_tokens, num_q_heads, head_dim)


# Layers 3 and 4: the public jitted function and the pure-jnp reference.
def _check_inputs(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    query_start_loc,
    num_seqs,
    sm_scale,
    soft_cap,
    sliding_window,
    *,
    for_kernel: bool = False,
):
    """Raises ValueError naming the offending field for malformed inputs; ``for_kernel`` adds
    the kernel's own limits (power-of-two head dim >= 16 and block size)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    if k_cache.ndim != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {k_cache.shape}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {v_cache.shape} != k_cache shape {k_cache.shape}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) != head_dim of k_cache ({cache_head_dim})")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if not any(q.dtype == d for d in _SUPPORTED_DTYPES):
        raise ValueError(f"q dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if v_cache.dtype != k_cache.dtype or not (
        k_cache.dtype == q.dtype or any(k_cache.dtype == d for d in FP8_CACHE_DTYPES)
    ):
        raise ValueError(
            f"k_cache/v_cache dtype ({k_cache.dtype}/{v_cache.dtype}) must equal q dtype "
            f"({q.dtype}), or both be float8_e4m3fn or float8_e5m2 (an FP8 cache)"
        )
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError(
            f"block_tables must be int32 [num_seqs, max_blocks_per_seq], got "
            f"{block_tables.dtype}{list(block_tables.shape)}"
        )
    num_seq_slots = block_tables.shape[0]
    if num_seq_slots < 1:
        raise ValueError("block_tables must have at least one row")
    if context_lens.shape != (num_seq_slots,) or context_lens.dtype != jnp.int32:
        raise ValueError(
            f"context_lens must be int32 [{num_seq_slots}], got "
            f"{context_lens.dtype}{list(context_lens.shape)}"
        )
    if query_start_loc.shape != (num_seq_slots + 1,) or query_start_loc.dtype != jnp.int32:
        raise ValueError(
            f"query_start_loc must be int32 [{num_seq_slots + 1}], got "
            f"{query_start_loc.dtype}{list(query_start_loc.shape)}"
        )
    if jnp.shape(num_seqs) != ():
        raise ValueError(f"num_seqs must be a scalar, got shape {jnp.shape(num_seqs)}")
    if num_tokens < 1:
        raise ValueError("q must hold at least one token")
    if not isinstance(sm_scale, numbers.Real) or not sm_scale > 0:
        raise ValueError(f"sm_scale must be a positive float, got {sm_scale!r}")
    if soft_cap is not None and not (isinstance(soft_cap, numbers.Real) and soft_cap > 0):
        raise ValueError(f"soft_cap must be None or a positive float, got {soft_cap!r}")
    if sliding_window is not None and not (
        isinstance(sliding_window, numbers.Integral) and sliding_window >= 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if for_kernel:
        block_size = k_cache.shape[1]
        if not is_power_of_2(head_dim) or head_dim < 16:
            raise ValueError(
                f"head_dim must be a power of two >= 16 for the kernel, got {head_dim}"
            )
        if not is_power_of_2(block_size):
            raise ValueError(f"block_size must be a power of two for the kernel, got {block_size}")


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "sliding_window", "interpret", "config"),
)
def ragged_paged_attention(
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
    interpret: bool = False,
    config: KernelConfig | None = None,
) -> jax.Array:
    """Attention of a ragged batch of query tokens over a paged KV cache.

    Args:
      q: [T, Hq, D] queries of all step tokens, sequences concatenated in order;
        float32, bfloat16 or float16.
      k_cache, v_cache: [N, block_size, Hkv, D], same dtype as ``q``; already
        hold this step's new K/V (see ``write_kv_cache``).
      block_tables: int32 [S, P]; row ``i`` lists sequence ``i``'s cache blocks
        in token order, padded with block 0.
      context_lens: int32 [S]; tokens of sequence ``i`` in the cache after this
        step's writes (cached + new); at most ``P * block_size``.
      query_start_loc: int32 [S + 1]; sequence ``i``'s tokens are
        ``q[query_start_loc[i]:query_start_loc[i + 1]]``, its last tokens.
      num_seqs: int32 []; sequences past it are padding (query length 0).
      sm_scale: softmax scale, usually ``head_dim ** -0.5``.
      soft_cap: optional logit soft cap (``cap * tanh(logit / cap)``).
      sliding_window: optional window ``W``: a token at position ``p`` sees keys
        at positions ``p - W + 1 .. p``.
      interpret: run the Pallas kernel in interpret mode (CPU).
      config: optional tiling override; by default ``choose_config`` picks one
        from the static shapes.

    Returns:
      [T, Hq, D] in ``q.dtype``. Rows of padding tokens are zero.

    Raises:
      ValueError: on inconsistent shapes or dtypes (the message names the
        field), on a head dim that is not a power of two >= 16 or a block size
        that is not a power of two, on a non-positive
        ``sm_scale``/``soft_cap``/``sliding_window``, or on a ``config`` whose
        query tile (``block_q * group_pad`` rows) or ``block_k`` is below 16.
    """
    _check_inputs(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        num_seqs,
        sm_scale,
        soft_cap,
        sliding_window,
        for_kernel=True,
    )
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if config is None:
        config = choose_config(
            num_tokens=num_tokens,
            num_seqs=block_tables.shape[0],
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            pages_per_seq=block_tables.shape[1],
            dtype=q.dtype,
        )
    return _ragged_paged_attention_pallas(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        jnp.asarray(num_seqs, jnp.int32),
        sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        config=config,
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "interpret"))
def ragged_paged_attention_reference(
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
    interpret: bool = False,
) -> jax.Array:
    """Pure-jnp ragged paged attention with the kernel's signature and semantics.

    Each token gathers its sequence's block-table row and attends over the
    ``P * block_size`` gathered key slots with a causal (and window) mask, in
    float32. Static shapes throughout, so it runs inside the jitted model step;
    memory is ``O(T * P * block_size * Hkv * D)``, fine for CPU-sized models.

    Args: as ``ragged_paged_attention``; ``interpret`` is accepted and ignored.

    Returns:
      [T, Hq, D] in ``q.dtype``; rows of padding tokens are zero.

    Raises:
      ValueError: on inconsistent shapes or dtypes (naming the field).
    """
    del interpret
    _check_inputs(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        num_seqs,
        sm_scale,
        soft_cap,
        sliding_window,
    )
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seq_slots, pages_per_seq = block_tables.shape
    group = num_q_heads // num_kv_heads
    num_keys = pages_per_seq * block_size
    num_seqs = jnp.asarray(num_seqs, jnp.int32)

    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start_loc[1:], tokens, side="right", method="compare_all")
    seq = jnp.minimum(seq, num_seq_slots - 1)  # [T]
    token_valid = tokens < query_start_loc[num_seqs]
    token_pos = context_lens[seq] - query_start_loc[seq + 1] + tokens  # [T]

    pages = block_tables[seq]  # [T, P]
    # an FP8 cache is widened to q's dtype as it is gathered
    k = k_cache[pages].reshape(num_tokens, num_keys, num_kv_heads, head_dim).astype(q.dtype)
    v = v_cache[pages].reshape(num_tokens, num_keys, num_kv_heads, head_dim).astype(q.dtype)
    q_grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    hi = lax.Precision.HIGHEST
    logits = (
        jnp.einsum(
            "tkgd,tlkd->tkgl", q_grouped, k, precision=hi, preferred_element_type=jnp.float32
        )
        * sm_scale
    )  # [T, Hkv, G, L]
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)

    key_pos = jnp.arange(num_keys, dtype=jnp.int32)
    mask = token_valid[:, None] & (key_pos[None, :] <= token_pos[:, None])  # [T, L]
    if sliding_window is not None:
        mask &= key_pos[None, :] > (token_pos - sliding_window)[:, None]
    mask = mask[:, None, None, :]
    logits = jnp.where(mask, logits, -jnp.inf)
    m = logits.max(axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(logits - jnp.where(mask.any(-1, keepdims=True), m, 0.0)), 0.0)
    l = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(l == 0.0, 1.0, l)
    out = jnp.einsum("tkgl,tlkd->tkgd", p, v.astype(jnp.float32), precision=hi)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
