"""The xla backend's tiled attention against the whole-row oracle
(``ragged_paged_attention_reference``), in jnp and in our C++ kernel (the whole step; prefill
too at head sizes it compiles): ragged mixes of prefill chunks and decodes, decode rows
of very different contexts, prefill chunks over several query tiles and key chunks, chunks of
2..rows tokens, padding tokens and sequences, soft cap and sliding window, bfloat16."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model import cpu_kernels
from jaxserve.model.chunked_attention import CpuAttentionTiling, chunked_paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

# (query_len, context_len): a long prefill chunk after a cached prefix, decodes at chunk edges,
# short rows (a verification's 1 + K) after a prefix and fresh, a fresh prompt, one token
# context.
SEQS = [(20, 70), (1, 33), (3, 40), (1, 32), (1, 64), (9, 9), (4, 4), (1, 1), (1, 50)]
# Decode rows of very different contexts (one long row among short ones), a fresh prompt of
# several tiles, a 2-token chunk and a chunk as long as a tile on cached prefixes.
MIXED = [(1, 3), (1, 150), (33, 33), (1, 7), (2, 61), (8, 100), (1, 1), (1, 96)]


def make_args(rng, seqs, *, num_tokens, num_seq_slots, hkv, group, head_dim, block_size, pages):
    """Attention args of a ragged batch of (query_len, context_len) pairs, blocks shuffled;
    every cache slot (null block included) holds finite random data."""
    need = sum(-(-c // block_size) for _, c in seqs)
    free = list(rng.permutation(np.arange(1, need + 3)))
    block_tables = np.zeros((num_seq_slots, pages), np.int32)
    context_lens = np.zeros(num_seq_slots, np.int32)
    qsl = np.zeros(num_seq_slots + 1, np.int32)
    for i, (q_len, ctx) in enumerate(seqs):
        n = -(-ctx // block_size)
        block_tables[i, :n] = [free.pop() for _ in range(n)]
        context_lens[i] = ctx
        qsl[i + 1] = qsl[i] + q_len
    qsl[len(seqs) + 1 :] = qsl[len(seqs)]
    cache = (need + 3, block_size, hkv, head_dim)
    return (
        jnp.asarray(rng.standard_normal((num_tokens, hkv * group, head_dim)), jnp.float32),
        jnp.asarray(rng.standard_normal(cache), jnp.float32),
        jnp.asarray(rng.standard_normal(cache), jnp.float32),
        jnp.asarray(block_tables),
        jnp.asarray(context_lens),
        jnp.asarray(qsl),
        jnp.int32(len(seqs)),
    )


# The jnp passes, and the C++ kernel where it builds (it must on a machine with a compiler:
# tests/model/test_cpu_attention.py).
NATIVE = (False, True) if cpu_kernels.available() else (False,)


def check(args, seqs, tiling, *, atol=2e-5, **kw):
    ref = ragged_paged_attention_reference(*args, **kw)
    real = sum(q for q, _ in seqs)
    ref = np.asarray(ref, np.float32)
    for native in NATIVE:
        attend = functools.partial(chunked_paged_attention, tiling=tiling, native=native, **kw)
        got = np.asarray(jax.jit(attend)(*args), np.float32)
        np.testing.assert_allclose(got[:real], ref[:real], atol=atol, rtol=0, err_msg=f"{native=}")
        np.testing.assert_array_equal(got[real:], 0.0)  # padding tokens


@pytest.mark.parametrize(
    "tiling,soft_cap,sliding_window",
    [
        (CpuAttentionTiling(16, 3, 8, 16), None, None),
        (CpuAttentionTiling(8, 2, 4, 32), 30.0, None),
        (CpuAttentionTiling(8, 5, 8, 8), None, 13),
        (CpuAttentionTiling(1024, 1, 64, 1024), None, 5),  # one chunk per row; window < block
        (CpuAttentionTiling(), None, None),  # the defaults (one key chunk covers every row)
        # short rows (speculative verification's 1 + K) in tiles of their own: 2..4 and 2
        (CpuAttentionTiling(16, 3, 16, 16, short_rows=4), None, 13),
        (CpuAttentionTiling(8, 2, 32, 32, short_rows=2), 30.0, None),
        # long tiles: 20 = 2 x 8 + 4 in 4-row tiles; 9 = 8 + 1; 3 in a 4-row tile
        (CpuAttentionTiling(16, 3, 4, 16, long_rows=8, long_prefix=0), None, None),
        # 20 = 12 + 8 in 4-row tiles (8 < 3/4 of 12); 9 >= 3/4 of 12: one long tile, 9 live rows
        (CpuAttentionTiling(8, 2, 4, 8, long_rows=12, long_prefix=0), 30.0, 13),
    ],
)
def test_chunked_matches_reference(tiling, soft_cap, sliding_window):
    rng = np.random.default_rng(tiling.decode_keys)
    args = make_args(
        rng,
        SEQS,
        num_tokens=48,  # 41 real tokens + padding
        num_seq_slots=10,  # one padding sequence
        hkv=2,
        group=2,
        head_dim=16,
        block_size=8,
        pages=10,  # 80 keys per row, not a multiple of every chunk size
    )
    check(args, SEQS, tiling, sm_scale=0.25, soft_cap=soft_cap, sliding_window=sliding_window)


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_rows_read_their_own_context(sliding_window):
    """Decode rows from 1 to 150 tokens of context beside prefill chunks of 2, 8 and 33 tokens
    (several tiles of 4 rows and key chunks of 16): each row attends exactly to its own keys."""
    rng = np.random.default_rng(7)
    args = make_args(
        rng,
        MIXED,
        num_tokens=64,  # 48 real tokens + padding
        num_seq_slots=16,
        hkv=1,
        group=4,
        head_dim=8,
        block_size=8,
        pages=20,
    )
    tiling = CpuAttentionTiling(decode_keys=16, decode_items=4, prefill_rows=4, prefill_keys=16)
    check(args, MIXED, tiling, sm_scale=0.3, sliding_window=sliding_window)
    # the 33-token chunk as 2 long tiles of 16 and one row in a 4-row tile; then long tiles
    # only after 64 cached keys: the 8-token chunk at 92 takes them, the fresh 33 does not
    tiling = dataclasses.replace(tiling, long_rows=16, long_prefix=0)
    check(args, MIXED, tiling, sm_scale=0.3, sliding_window=sliding_window)
    tiling = dataclasses.replace(tiling, long_rows=8, short_rows=2, long_prefix=64)
    check(args, MIXED, tiling, sm_scale=0.3, sliding_window=sliding_window)


def test_bfloat16_and_empty_batch():
    rng = np.random.default_rng(3)
    args = make_args(
        rng,
        SEQS,
        num_tokens=48,
        num_seq_slots=10,
        hkv=2,
        group=2,
        head_dim=16,
        block_size=8,
        pages=10,
    )
    bf16 = tuple(a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in args)
    check(bf16, SEQS, CpuAttentionTiling(8, 4, 8, 16, short_rows=4), atol=2e-2, sm_scale=0.25)
    # no real sequence: nothing attends, every row is zero
    empty = (*args[:5], jnp.zeros_like(args[5]), jnp.int32(0))
    check(empty, [], CpuAttentionTiling(8, 4, 8, 16), sm_scale=0.25)


def test_tiling_rejects_non_positive_sizes():
    with pytest.raises(ValueError, match="prefill_rows"):
        CpuAttentionTiling(prefill_rows=0)
