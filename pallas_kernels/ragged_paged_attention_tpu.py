"""Ragged paged attention for TPUs: our own Pallas kernel for the Mosaic TPU backend.

Same contract as ``ragged_paged_attention`` (the GPU kernel, whose module docstring gives the
layout and masking rules) and the same jnp reference, ``ragged_paged_attention_reference``:
one call attends a flat batch of prefill chunks and decode tokens over the paged KV cache
``[N, block_size, Hkv, D]`` through the block tables, with GQA, an optional sliding window and
an optional logit soft cap. The KV write stays ``pallas_kernels.kv_cache_write`` (one in-place
XLA scatter through the slot mapping, identical on every platform).

Why our own kernel and not JAX's shipped TPU ``ragged_paged_attention``: JAX's kernel reads a
combined cache ``[pages, page_size, 2 * Hkv, D]`` with K and V heads interleaved, so adopting
it means either a second KV layout on TPU (a different KV write, reference and pool sizing per
platform) or a copy of the whole cache every step; and its signature and tuning table have
changed between JAX releases, which would pin us to one. Ours reads our layout directly.

Design (one program per query tile; Mosaic TPU idioms: scalar prefetch, manual DMA,
double buffering):

* Grid ``(T // block_q,)``: program ``i`` owns tokens ``[i * block_q, (i + 1) * block_q)``, a
  tile that may span several sequences (ragged). The metadata (``query_start_loc``,
  ``context_lens``, the flattened block tables, ``num_seqs``) is scalar-prefetched into SMEM.
* The caches stay in HBM (``memory_space=pl.ANY``). For each sequence that has tokens in the
  tile, the program walks the KV pages the tile's tokens can see (causal end of its last token,
  window start of its first), ``pages_per_step`` pages at a time, DMA'd whole (all KV heads of
  a page, contiguous) into a two-slot VMEM buffer: step ``j + 1`` is in flight while step ``j``
  is computed.
* For each KV head (a static loop, so every page is read from HBM once per tile), the tile's
  query rows of that head group ``[block_q * G, D]`` take a FlashAttention-2 online-softmax
  step against the page block; rows of other sequences are masked and leave their running
  max/sum/accumulator (VMEM scratch, float32) untouched. At the end each row is divided by its
  sum; rows of padding tokens are written as zeros.

Shape rules (checked by ``check_tpu_shapes`` on every call; the engine applies them at
start-up through ``jaxserve.model.attention.token_bucket_multiple`` and ``cache_head_dim``): the
token count is a multiple of the query tile ``TPU_BLOCK_Q`` (the TPU token buckets are, see
``jaxserve.worker.batch_builder.resolve_token_buckets``); compiled on a TPU, the
head dim must be a multiple of 128 (the lane width; ``jaxserve.model.attention`` zero-pads q,
k and v and sizes the cache with the padded head dim, so a model with ``head_dim`` 64 costs
twice the KV memory on TPU) and the block size a multiple of 8 (sublanes). In interpret mode
(``interpret=True``: Pallas' TPU interpreter on CPU, which simulates HBM, VMEM, DMAs and
semaphores) only the token-count rule applies.

Not verified here: this kernel has run only in TPU interpret mode (CI, 2-core CPU box). It has
never been compiled by Mosaic on a TPU; the compiled tests are marked ``tpu`` and skipped
elsewhere. The known risk on a real TPU is the per-head read of a page block
(``k_buf[slot, :, :, h, :]``: a squeezed second-minor index, i.e. a strided sublane load),
which Mosaic may accept only for 32-bit types (JAX's own TPU kernel bitcasts bfloat16 pairs to
uint32 for the same kind of read); the fallbacks are that bitcast or a head-major page layout
on TPU. The engine pads the head dim for this backend in interpret mode too, so CI runs the
shapes a TPU would. Tested (interpret mode) with jax 0.11.2 and 0.12.0.1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import _check_inputs

# Query tokens per program (grid step). Token buckets on TPU are multiples of it. 8 is the TPU
# sublane count; a tile of decode tokens wastes block_q - 1 of every block_q score rows of a
# sequence, so it stays small (decode is bandwidth-bound: see README, "TPU").
TPU_BLOCK_Q = 8
# KV tokens per DMA step (rounded to whole pages, at least one page).
TPU_KV_TOKENS_PER_STEP = 128
# Lane width: compiled head dims are multiples of it.
TPU_LANES = 128
TPU_SUBLANES = 8
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def check_tpu_shapes(
    *, num_tokens: int, head_dim: int, block_size: int, interpret: bool, block_q: int = TPU_BLOCK_Q
) -> None:
    """Raises ValueError (naming the field and the rule) when shapes break the TPU kernel's rules.

    Args:
      num_tokens: T of a call (or a token bucket); must be a multiple of ``block_q``.
      head_dim: D of q and the cache; compiled (``interpret=False``) a multiple of 128.
      block_size: tokens per cache block; compiled a multiple of 8.
      interpret: True for Pallas' TPU interpret mode (then only the token rule applies).
      block_q: query tile of the kernel.
    """
    if num_tokens % block_q:
        raise ValueError(
            f"num_tokens ({num_tokens}) must be a multiple of the TPU kernel's query tile "
            f"({block_q}); the TPU token buckets are"
        )
    if interpret:
        return
    if head_dim % TPU_LANES:
        raise ValueError(
            f"head_dim ({head_dim}) must be a multiple of {TPU_LANES} for the compiled TPU "
            "kernel (jaxserve pads it: see tpu_head_dim)"
        )
    if block_size % TPU_SUBLANES:
        raise ValueError(
            f"block_size ({block_size}) must be a multiple of {TPU_SUBLANES} for the TPU kernel"
        )


def tpu_head_dim(head_dim: int) -> int:
    """Head dim the compiled TPU kernel runs at: ``head_dim`` rounded up to a multiple of 128."""
    return -(-head_dim // TPU_LANES) * TPU_LANES


def _kernel(
    # scalar prefetch (SMEM)
    query_start_loc_ref,  # [S + 1] int32
    context_lens_ref,  # [S] int32
    block_tables_ref,  # [S * P] int32
    num_seqs_ref,  # [1] int32
    # inputs
    q_ref,  # [block_q, Hq, D] VMEM
    k_hbm,  # [N, bs, Hkv, D] HBM
    v_hbm,  # [N, bs, Hkv, D] HBM
    # output
    o_ref,  # [block_q, Hq, D] VMEM
    # scratch
    k_buf,  # [2, pages_per_step, bs, Hkv, D] VMEM
    v_buf,  # [2, pages_per_step, bs, Hkv, D] VMEM
    sems,  # DMA semaphores [2, 2] (slot, k/v)
    m_ref,  # [Hkv, block_q * G, 1] f32
    l_ref,  # [Hkv, block_q * G, 1] f32
    acc_ref,  # [Hkv, block_q * G, D] f32
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_seq: int,
    precision,
):
    block_q, num_q_heads, head_dim = q_ref.shape
    _, pages_per_step, block_size, num_kv_heads, _ = k_buf.shape
    group = num_q_heads // num_kv_heads
    rows = block_q * group
    step_tokens = pages_per_step * block_size
    num_seq_slots = context_lens_ref.shape[0]
    num_seqs = num_seqs_ref[0]
    t0 = pl.program_id(0) * block_q
    t1 = t0 + block_q

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # First sequence with a token in the tile: the number of sequences ending at or before t0
    # (binary search over query_start_loc[1:num_seqs + 1]).
    def search(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) // 2
        ends_before = query_start_loc_ref[jnp.minimum(mid + 1, num_seq_slots)] <= t0
        go_right = (lo < hi) & ends_before
        go_left = (lo < hi) & ~ends_before
        return jnp.where(go_right, mid + 1, lo), jnp.where(go_left, mid, hi)

    steps = max(1, num_seq_slots.bit_length() + 1)
    first_seq, _ = lax.fori_loop(0, steps, search, (jnp.int32(0), num_seqs))

    # Token offset (in the tile) of each score row; rows are token-major: row = tok * G + g.
    row_tok = lax.broadcasted_iota(jnp.int32, (rows, step_tokens), 0) // group
    key_off = lax.broadcasted_iota(jnp.int32, (rows, step_tokens), 1)

    def page_copies(seq, page_lo, step, slot):
        """DMA descriptors of KV step ``step`` of ``seq`` into buffer ``slot``. Pages past the
        block table's end read its last entry (their keys are masked)."""
        copies = []
        for p in range(pages_per_step):
            page = jnp.minimum(page_lo + step * pages_per_step + p, pages_per_seq - 1)
            block = block_tables_ref[seq * pages_per_seq + page]
            copies.append(
                pltpu.make_async_copy(k_hbm.at[block], k_buf.at[slot, p], sems.at[slot, 0])
            )
            copies.append(
                pltpu.make_async_copy(v_hbm.at[block], v_buf.at[slot, p], sems.at[slot, 1])
            )
        return copies

    def seq_body(seq):
        q_start = query_start_loc_ref[seq]
        q_end = query_start_loc_ref[seq + 1]
        ctx = context_lens_ref[seq]
        # Positions of the tile's first and last token of this sequence.
        tok_lo = jnp.maximum(q_start, t0)
        tok_hi = jnp.minimum(q_end, t1)  # exclusive
        pos_first = ctx - q_end + tok_lo
        kv_end = ctx - q_end + tok_hi  # causal end of the last token (exclusive)
        if sliding_window is None:
            kv_start = jnp.int32(0)
        else:
            kv_start = jnp.maximum(pos_first - sliding_window + 1, 0)
        page_lo = kv_start // block_size
        num_steps = jnp.where(
            tok_hi > tok_lo, pl.cdiv(pl.cdiv(kv_end, block_size) - page_lo, pages_per_step), 0
        )
        # Score-row bookkeeping for this sequence: membership and position of each row's token.
        row_t = t0 + row_tok
        row_in_seq = (row_t >= q_start) & (row_t < q_end)
        row_pos = ctx - q_end + row_t

        @pl.when(num_steps > 0)
        def _():
            for c in page_copies(seq, page_lo, 0, 0):
                c.start()

        def kv_step(step, _):
            slot = step % 2

            @pl.when(step + 1 < num_steps)
            def _():
                for c in page_copies(seq, page_lo, step + 1, 1 - slot):
                    c.start()

            for c in page_copies(seq, page_lo, step, slot):
                c.wait()
            key_pos = (page_lo + step * pages_per_step) * block_size + key_off
            mask = row_in_seq & (key_pos <= row_pos)
            if sliding_window is not None:
                mask &= key_pos > row_pos - sliding_window
            for h in range(num_kv_heads):
                # widened to q's dtype here when the cache is FP8
                k = k_buf[slot, :, :, h, :].reshape(step_tokens, head_dim).astype(q_ref.dtype)
                v = v_buf[slot, :, :, h, :].reshape(step_tokens, head_dim).astype(q_ref.dtype)
                q = q_ref[:, h * group : (h + 1) * group, :].reshape(rows, head_dim)
                s = lax.dot_general(
                    q,
                    k,
                    (((1,), (1,)), ((), ())),
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )
                if soft_cap is None:
                    s = s * sm_scale
                else:
                    s = soft_cap * jnp.tanh(s * (sm_scale / soft_cap))
                s = jnp.where(mask, s, MASK_VALUE)
                m_prev = m_ref[h]
                m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
                alpha = jnp.exp(m_prev - m_next)
                p = jnp.exp(s - m_next)
                l_ref[h] = alpha * l_ref[h] + p.sum(axis=1, keepdims=True)
                pv = lax.dot_general(
                    p.astype(v.dtype),
                    v,
                    (((1,), (0,)), ((), ())),
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )
                acc_ref[h] = alpha * acc_ref[h] + pv
                m_ref[h] = m_next
            return 0

        lax.fori_loop(0, num_steps, kv_step, 0)

    def seq_cond(seq):
        return (seq < num_seqs) & (query_start_loc_ref[jnp.minimum(seq, num_seq_slots)] < t1)

    def seq_loop(seq):
        seq_body(seq)
        return seq + 1

    lax.while_loop(seq_cond, seq_loop, first_seq)

    # Normalise; rows of tokens past the real ones (padding) become zeros.
    total = query_start_loc_ref[num_seqs]
    real = (t0 + lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0) // group) < total
    for h in range(num_kv_heads):
        l = l_ref[h]
        out = jnp.where(real, acc_ref[h] / jnp.where(l == 0.0, 1.0, l), 0.0)
        o_ref[:, h * group : (h + 1) * group, :] = out.reshape(block_q, group, head_dim).astype(
            o_ref.dtype
        )


def interpret_params():
    """Pallas' TPU interpret mode (CPU), with scratch memory zeroed rather than NaN-filled."""
    return pltpu.InterpretParams(uninitialized_memory="zero")


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "block_q",
        "pages_per_step",
    ),
)
def ragged_paged_attention_tpu(
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
    block_q: int = TPU_BLOCK_Q,
    pages_per_step: int | None = None,
) -> jax.Array:
    """Attention of a ragged batch of query tokens over a paged KV cache, on a TPU.

    Args:
      q, k_cache, v_cache, block_tables, context_lens, query_start_loc, num_seqs, sm_scale,
        soft_cap, sliding_window: as ``ragged_paged_attention`` (the GPU kernel).
      interpret: run in Pallas' TPU interpret mode (CPU).
      block_q: query tokens per program; ``q.shape[0]`` must be a multiple of it.
      pages_per_step: cache blocks per DMA step; default ``TPU_KV_TOKENS_PER_STEP`` tokens'
        worth, at most the block table's width.

    Returns:
      [T, Hq, D] in ``q.dtype``; rows of padding tokens are zero.

    Raises:
      ValueError: inconsistent shapes or dtypes (naming the field), or shapes that break the
        TPU rules of ``check_tpu_shapes``.
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
    )
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seq_slots, pages_per_seq = block_tables.shape
    check_tpu_shapes(
        num_tokens=num_tokens,
        head_dim=head_dim,
        block_size=block_size,
        interpret=interpret,
        block_q=block_q,
    )
    if pages_per_step is None:
        pages_per_step = max(1, TPU_KV_TOKENS_PER_STEP // block_size)
    pages_per_step = max(1, min(pages_per_step, pages_per_seq))
    group = num_q_heads // num_kv_heads
    rows = block_q * group
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT

    kernel = functools.partial(
        _kernel,
        sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        pages_per_seq=pages_per_seq,
        precision=precision,
    )
    q_spec = pl.BlockSpec((block_q, num_q_heads, head_dim), lambda i, *_: (i, 0, 0))
    buf = pltpu.VMEM((2, pages_per_step, block_size, num_kv_heads, head_dim), k_cache.dtype)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(num_tokens // block_q,),
        in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=q_spec,
        scratch_shapes=[
            buf,
            buf,
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
        ],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret_params() if interpret else False,
        name=f"ragged_paged_attention_tpu_bq{block_q}_pps{pages_per_step}",
    )(
        query_start_loc,
        context_lens,
        block_tables.reshape(num_seq_slots * pages_per_seq),
        jnp.asarray(num_seqs, jnp.int32).reshape(1),
        q,
        k_cache,
        v_cache,
    )
