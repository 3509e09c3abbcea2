"""Ragged paged attention in pure jnp whose cost follows the work: what backend "xla" runs.

The test oracle, ``pallas_kernels.ragged_paged_attention.ragged_paged_attention_reference``,
gathers every token's whole padded block-table row (``[T, P * block_size, Hkv, D]`` per layer)
whatever the contexts are. This path reads each sequence's keys about once per query tile and
only as far as its own context, in two passes over one step (vLLM's CPU backend also splits
decode rows from prefill chunks):

* decode rows (sequences with one query token): a flat work list of (sequence, key chunk)
  items, ``decode_items`` items per loop iteration, so a row reads only its own context, never
  the batch's longest, and a batch of short contexts and one long one costs their sum. Each
  item's partial softmax (max, sum, weighted values) is merged into its sequence's running
  state with scatter-max / scatter-add (flash-decoding's split-K merge).
* prefill chunks (two or more query tokens): query tiles of ``prefill_rows`` consecutive tokens
  of one sequence (``short_rows`` for a sequence of at most that many query tokens: a
  speculative verification's 1 + K, whose keys a 128-row tile would score 25 times over;
  ``long_rows`` for a long chunk's whole tiles, whose keys a 128-row tile would gather and
  transpose four times over); a tile walks its sequence's key chunks (``prefill_keys`` keys per
  step, from the sliding window's start to its last query's position) with an online softmax
  (flash attention), so the keys are gathered once per tile, not once per query token, and
  masked only in the chunks that cross the causal diagonal or the window's edge.

Trip counts are traced values (``lax.while_loop``): one compiled step serves every mix of
context lengths, with no extra buckets or compiles. Every while loop's body has static shapes
sized for XLA CPU: dots of a few hundred rows and keys, block-table gathers of whole blocks
whose indices are materialised once per iteration (``optimization_barrier``), so a fused gather
does not recompute them per element. See benchmarks/RESULTS.md (#34) for the measurements.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.model import cpu_kernels

_HI = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class CpuAttentionTiling:
    """Static work sizes of ``chunked_paged_attention`` (keys are rounded to whole blocks).

    Attributes:
      decode_keys: keys per decode work item (a sequence's context is split into such chunks).
      decode_items: decode work items per loop iteration.
      prefill_rows: query tokens per prefill tile.
      prefill_keys: keys per step of a prefill tile's loop.
      short_rows: query tokens per tile of the sequences with 2 to ``short_rows`` query tokens
        (speculative decoding's verification rows, 1 + K; a pass of their own).
      long_rows: query tokens per tile of a prefill chunk's leading whole tiles of this size
        (a remainder of at least 3/4 of it takes one more such tile; a shorter one goes in
        ``prefill_rows`` tiles); at most ``prefill_rows`` turns them off. Bigger tiles read
        each key chunk fewer times: a 512-token chunk over 12,000 keys is ~1.5x faster in
        512-row tiles than in 128-row ones on the 2-core box (tiny llama; neutral at
        SmolLM2's head shapes; benchmarks/RESULTS.md, #34).
      long_prefix: cached keys before a chunk for its long tiles: a long tile scores its
        whole causal triangle, which short tiles mostly skip (a fresh 512-token prompt is
        ~1.3x slower in one 512-row tile), so only chunks deep into a context take them.
    """

    decode_keys: int = 32
    decode_items: int = 64
    prefill_rows: int = 128
    prefill_keys: int = 256
    short_rows: int = 8
    long_rows: int = 512
    long_prefix: int = 2048

    def __post_init__(self):
        for f in dataclasses.fields(self):
            least = 0 if f.name == "long_prefix" else 1
            if getattr(self, f.name) < least:
                raise ValueError(f"{f.name} must be >= {least}, got {getattr(self, f.name)}")


DEFAULT_TILING = CpuAttentionTiling()


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
    tiling: CpuAttentionTiling = DEFAULT_TILING,
    native: bool | None = None,
) -> jax.Array:
    """Ragged paged attention (the reference's signature and semantics), tiled for XLA CPU.

    Args:
      q: ``[T, Hq, D]`` queries.
      k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` with ``Hq % Hkv == 0``; in q's
        dtype or FP8 (each chunk is widened to float32 as it is read).
      block_tables: int32 ``[S, P]``; context_lens: int32 ``[S]``; query_start_loc: int32
        ``[S + 1]``; num_seqs: int32 ``[]`` (see ``PagedAttentionMetadata``).
      sm_scale, soft_cap, sliding_window: as in ``paged_attention``.
      tiling: static work sizes (``CpuAttentionTiling``).
      native: run the step in our C++ kernel (``jaxserve.model.cpu_kernels``), which reads
        the cache in place instead of gathering it: the rows of short queries (decode rows,
        and the ``short_rows`` pass), and the prefill chunks too where the head size is one of
        its ``PREFILL_HEAD_DIMS`` (else they stay in jnp tiles); None: where it can (the
        default backend is the CPU, the kernel built, the cache dtype one it reads).

    Returns:
      ``[T, Hq, D]`` in ``q.dtype``; scores and softmax in float32; rows of padding tokens are
      zero.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    num_seq_slots = block_tables.shape[0]
    num_seqs = jnp.asarray(num_seqs, jnp.int32)
    q_len = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    real = jnp.arange(num_seq_slots) < num_seqs
    scores = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    q_f32 = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    step = (q_f32, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    # Passes no sequence of a T-token step can need are left out of its program (a smaller
    # executable, compiled sooner): a one-token step only decodes, a long tile needs a chunk
    # of at least 3/4 of it.
    short = tiling.short_rows if 1 < tiling.short_rows < tiling.prefill_rows else 1
    long = tiling.long_rows if tiling.long_rows > tiling.prefill_rows else 0
    long_min = long - long // 4  # the fewest rows a long tile takes
    use_short = short > 1 and num_tokens > 1
    use_prefill = num_tokens > short
    use_long = use_prefill and long > 0 and num_tokens >= long_min
    pad = max(short * use_short, tiling.prefill_rows * use_prefill, long * use_long)
    if native is None:
        native = _native_ok(k_cache.dtype)
    with jax.named_scope("ragged_attention"):
        if native:  # the C++ kernel reads the cache in place
            prefill = use_prefill and head_dim in cpu_kernels.PREFILL_HEAD_DIMS
            rows = cpu_kernels.paged_attention_rows(
                q_f32,
                *step[1:],
                num_seqs,
                min_q_len=1,
                max_q_len=max(short, 1),
                prefill=prefill,
                **scores,
            )
            if prefill:  # prefill chunks too, in the kernel's query tiles
                return rows[:num_tokens].reshape(q.shape).astype(q.dtype)
            out = jnp.pad(rows, ((0, pad), (0, 0), (0, 0), (0, 0)))
            use_short = False
        else:
            out = jnp.zeros((num_tokens + pad, num_kv_heads, group, head_dim))
            decode = real & (q_len == 1)
            out = _decode_pass(
                out, *step, decode, keys=tiling.decode_keys, items=tiling.decode_items, **scores
            )
        if use_short:  # verification rows (1 + K tokens) in tiles of their size
            short_len = jnp.where(real & (q_len > 1) & (q_len <= short), q_len, 0)
            out = _prefill_pass(
                out, *step, short_len, rows=short, keys=tiling.prefill_keys, **scores
            )
        if use_prefill:
            prefill_len = jnp.where(real & (q_len > short), q_len, 0)
            first = jnp.zeros_like(prefill_len)
            if use_long:  # the leading whole long tiles (and a remainder of >= long_min)
                num_long = prefill_len // long + (prefill_len % long >= long_min)
                # only after a long prefix: a long tile scores its whole causal triangle,
                # which short tiles mostly skip (a fresh 512-token prompt is slower in one)
                num_long = jnp.where(context_lens - q_len >= tiling.long_prefix, num_long, 0)
                first = jnp.minimum(num_long * long, prefill_len)
                out = _prefill_pass(
                    out, *step, first, rows=long, keys=tiling.prefill_keys, **scores
                )
            out = _prefill_pass(
                out,
                *step,
                prefill_len - first,
                first_row=first,
                rows=tiling.prefill_rows,
                keys=tiling.prefill_keys,
                **scores,
            )
    return out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _native_ok(cache_dtype) -> bool:
    """Whether ``native=None`` means the C++ kernel: on the CPU backend, for a dtype it reads,
    once it has built (``cpu_kernels.available``)."""
    if jax.default_backend() != "cpu":
        return False
    if not any(jnp.dtype(cache_dtype) == d for d in cpu_kernels.KERNEL_DTYPES):
        return False
    return cpu_kernels.available()


def _whole_blocks(keys: int, block_size: int, pages_per_seq: int) -> int:
    """Blocks per key chunk: ``keys`` rounded down to whole blocks, at least one, at most P."""
    return max(1, min(pages_per_seq, keys // block_size))


def _pad_pages(block_tables: jax.Array, chunk_pages: int) -> jax.Array:
    """The block table padded (null block) to a whole number of chunks per row."""
    pad = -block_tables.shape[1] % chunk_pages
    return jnp.pad(block_tables, ((0, 0), (0, pad))) if pad else block_tables


def _blocks(cache: jax.Array, pages: jax.Array) -> jax.Array:
    """``cache[pages]`` in float32 (``pages`` are valid block ids: no bounds select)."""
    return cache.at[pages].get(mode="promise_in_bounds").astype(jnp.float32)


def _logits(s, sm_scale, soft_cap):
    """Raw scores ``q . k`` -> ``(logits, scale)`` with ``softmax(logits * scale)`` the
    attention weights: without a soft cap the scale is applied inside the exponential
    (``max`` commutes with a positive scale), which saves a pass over the scores."""
    if soft_cap is None:
        return s, sm_scale
    return soft_cap * jnp.tanh(s * (sm_scale / soft_cap)), 1.0


def _decode_pass(
    out,
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    query_start_loc,
    is_decode,
    *,
    keys,
    items,
    sm_scale,
    soft_cap,
    sliding_window,
):
    """Attention of the one-token sequences (``is_decode [S]``), written into their rows of
    ``out [T + R, Hkv, G, D]`` (float32, returned)."""
    num_tokens, hkv, group, head_dim = q.shape
    _, block_size, _, _ = k_cache.shape
    num_seq_slots, pages_per_seq = block_tables.shape
    chunk_pages = _whole_blocks(keys, block_size, pages_per_seq)
    chunk_keys = chunk_pages * block_size
    block_tables = _pad_pages(block_tables, chunk_pages)
    last_pos = context_lens - 1  # [S] the decode token's position
    first_chunk = jnp.zeros_like(last_pos)
    if sliding_window is not None:  # chunks wholly before the window are skipped
        first_chunk = jnp.maximum(last_pos - sliding_window + 1, 0) // chunk_keys
    num_items = jnp.where(is_decode, last_pos // chunk_keys + 1 - first_chunk, 0)  # [S]
    ends = jnp.cumsum(num_items)  # [S] items of sequences 0..i
    total = ends[-1]
    key_offsets = jnp.arange(chunk_keys, dtype=jnp.int32)
    page_offsets = jnp.arange(chunk_pages, dtype=jnp.int32)

    def run(items: int) -> tuple[jax.Array, jax.Array]:
        """The work list, ``items`` items per iteration -> ``(l, acc)`` per sequence."""

        def body(carry):
            it, m, l, acc = carry
            item = it * items + jnp.arange(items, dtype=jnp.int32)  # [W]
            seq = jnp.searchsorted(ends, item, side="right", method="compare_all")
            seq = jnp.minimum(seq, num_seq_slots - 1)
            valid = item < total
            chunk = jnp.where(valid, first_chunk[seq] + item - (ends[seq] - num_items[seq]), 0)
            pages = block_tables[seq[:, None], chunk[:, None] * chunk_pages + page_offsets]
            pages = jnp.where(valid[:, None], pages, 0)  # [W, pages]
            key_pos = chunk[:, None] * chunk_keys + key_offsets  # [W, L]
            row_pos = jnp.where(valid, last_pos[seq], -1)  # [W]
            token = jnp.minimum(query_start_loc[seq], num_tokens - 1)
            pages, key_pos, row_pos, token = lax.optimization_barrier(
                (pages, key_pos, row_pos, token)
            )
            k = _blocks(k_cache, pages).reshape(items, chunk_keys, hkv, head_dim)
            v = _blocks(v_cache, pages).reshape(items, chunk_keys, hkv, head_dim)
            s = jnp.einsum("wkgd,wlkd->wkgl", q[token], k, precision=_HI)  # [W, Hkv, G, L]
            s, scale = _logits(s, sm_scale, soft_cap)
            mask = key_pos <= row_pos[:, None]  # [W, L]
            if sliding_window is not None:
                mask &= key_pos > (row_pos - sliding_window)[:, None]
            s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
            m_item = s.max(-1)  # [W, Hkv, G]
            m_item_safe = jnp.where(jnp.isfinite(m_item), m_item, 0.0)
            p = jnp.exp((s - m_item_safe[..., None]) * scale)
            l_item = p.sum(-1)
            acc_item = jnp.einsum("wkgl,wlkd->wkgd", p, v, precision=_HI)  # [W, Hkv, G, D]
            # split-K merge into the sequences' running state (invalid items go nowhere)
            target = jnp.where(valid, seq, num_seq_slots)
            m_new = m.at[target].max(m_item, mode="drop")  # [S, Hkv, G]
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha = jnp.where(jnp.isfinite(m), jnp.exp((m - m_safe) * scale), 0.0)
            beta = jnp.where(jnp.isfinite(m_item), jnp.exp((m_item - m_safe[seq]) * scale), 0.0)
            l = (l * alpha).at[target].add(l_item * beta, mode="drop")
            acc = (acc * alpha[..., None]).at[target].add(acc_item * beta[..., None], mode="drop")
            return it + 1, m_new, l, acc

        shape = (num_seq_slots, hkv, group)
        init = (
            jnp.int32(0),
            jnp.full(shape, -jnp.inf, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32),
        )
        trips = (total + items - 1) // items
        _, _, l, acc = lax.while_loop(lambda c: c[0] < trips, body, init)
        return l, acc

    # A small step (one short row) would otherwise gather and score a whole iteration of
    # mostly empty items: bucket the iteration width by the step's real work.
    small = max(1, items // 8)
    if small < items:
        l, acc = lax.cond(total <= small, lambda: run(small), lambda: run(items))
    else:
        l, acc = run(items)
    rows = acc / jnp.where(l == 0.0, 1.0, l)[..., None]  # [S, Hkv, G, D]
    target = jnp.where(is_decode, query_start_loc[:-1], out.shape[0])
    return out.at[target].set(rows, mode="drop")


def _prefill_pass(
    out,
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    query_start_loc,
    num_rows,
    *,
    first_row=None,
    rows,
    keys,
    sm_scale,
    soft_cap,
    sliding_window,
):
    """Attention of ``num_rows [S]`` query tokens of each sequence (0: none), from its query
    token ``first_row [S]`` on (default 0), in tiles of ``rows``, written into their rows of
    ``out [T + rows, Hkv, G, D]`` (float32, returned)."""
    _, hkv, group, head_dim = q.shape
    _, block_size, _, _ = k_cache.shape
    num_seq_slots, pages_per_seq = block_tables.shape
    chunk_pages = _whole_blocks(keys, block_size, pages_per_seq)
    chunk_keys = chunk_pages * block_size
    block_tables = _pad_pages(block_tables, chunk_pages)
    q = jnp.pad(q, ((0, rows), (0, 0), (0, 0), (0, 0)))  # a tile may read past the last token
    q_len = query_start_loc[1:] - query_start_loc[:-1]  # [S] the sequences' query tokens
    if first_row is None:
        first_row = jnp.zeros_like(num_rows)
    tiles = (num_rows + rows - 1) // rows  # [S]
    ends = jnp.cumsum(tiles)
    row_offsets = jnp.arange(rows, dtype=jnp.int32)
    key_offsets = jnp.arange(chunk_keys, dtype=jnp.int32)

    def tile_body(carry):
        t, out = carry
        seq = jnp.minimum(jnp.searchsorted(ends, t, side="right"), num_seq_slots - 1)
        row0 = first_row[seq] + (t - (ends[seq] - tiles[seq])) * rows  # in the sequence
        live = jnp.minimum(rows, first_row[seq] + num_rows[seq] - row0)  # the tile's real rows
        token = query_start_loc[seq] + row0
        first_pos = context_lens[seq] - q_len[seq] + row0  # position of the tile's row 0
        last_pos = first_pos + live - 1
        row_pos = first_pos + row_offsets  # [R]
        lo = 0
        if sliding_window is not None:
            lo = jnp.maximum(first_pos - sliding_window + 1, 0) // chunk_keys
        table = block_tables[seq]
        q_tile = lax.dynamic_slice_in_dim(q, token, rows)  # [R, Hkv, G, D]

        def attend(s, key_pos):
            mask = key_pos[None, :] <= row_pos[:, None]  # [R, L]
            if sliding_window is not None:
                mask &= key_pos[None, :] > (row_pos - sliding_window)[:, None]
            return jnp.where(mask[None, :, None, :], s, -jnp.inf)

        def chunk_body(carry):
            c, m, l, acc = carry
            pages = lax.dynamic_slice_in_dim(table, c * chunk_pages, chunk_pages)
            pages = lax.optimization_barrier(pages)
            k = _blocks(k_cache, pages).reshape(chunk_keys, hkv, head_dim)
            v = _blocks(v_cache, pages).reshape(chunk_keys, hkv, head_dim)
            s = jnp.einsum("rkgd,lkd->krgl", q_tile, k, precision=_HI)  # [Hkv, R, G, L]
            s, scale = _logits(s, sm_scale, soft_cap)
            key_pos = c * chunk_keys + key_offsets
            # Only chunks crossing the diagonal (a key after the tile's first row) or the
            # window's lower edge hold a masked pair.
            crossing = key_pos[-1] > first_pos
            if sliding_window is not None:
                crossing |= key_pos[0] <= last_pos - sliding_window
            s = lax.cond(crossing, attend, lambda s, _: s, s, key_pos)
            m_new = jnp.maximum(m, s.max(-1))  # [Hkv, R, G]; -inf while a row saw no key
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp((s - m_safe[..., None]) * scale)
            alpha = jnp.where(jnp.isfinite(m), jnp.exp((m - m_safe) * scale), 0.0)
            l = l * alpha + p.sum(-1)
            pv = jnp.einsum("krgl,lkd->krgd", p, v, precision=_HI)
            return c + 1, m_new, l, acc * alpha[..., None] + pv

        shape = (hkv, rows, group)
        init = (
            jnp.asarray(lo, jnp.int32),
            jnp.full(shape, -jnp.inf, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32),
        )
        stop = last_pos // chunk_keys + 1
        _, _, l, acc = lax.while_loop(lambda c: c[0] < stop, chunk_body, init)
        res = jnp.moveaxis(acc / jnp.where(l == 0.0, 1.0, l)[..., None], 0, 1)  # [R, Hkv, G, D]
        old = lax.dynamic_slice_in_dim(out, token, rows)
        res = jnp.where((row_offsets < live)[:, None, None, None], res, old)
        return t + 1, lax.dynamic_update_slice_in_dim(out, res, token, 0)

    _, out = lax.while_loop(lambda c: c[0] < ends[-1], tile_body, (jnp.int32(0), out))
    return out
