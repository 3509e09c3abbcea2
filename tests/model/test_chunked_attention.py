"""The reference backend's key-chunked attention against the whole-row oracle
(``ragged_paged_attention_reference``): ragged mixes of prefill chunks and decodes, several
chunks per sequence, padding tokens and sequences, soft cap and sliding window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.chunked_attention import chunked_paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

# (query_len, context_len): a long prefill chunk after a cached prefix, decodes at chunk edges,
# a fresh prompt, one token context.
SEQS = [(20, 70), (1, 33), (1, 32), (1, 64), (9, 9), (1, 1), (1, 50)]


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


@pytest.mark.parametrize(
    "keys_per_chunk,soft_cap,sliding_window",
    [(16, None, None), (32, 30.0, None), (8, None, 13), (1024, None, None)],
)
def test_chunked_matches_reference(keys_per_chunk, soft_cap, sliding_window):
    rng = np.random.default_rng(keys_per_chunk)
    args = make_args(
        rng,
        SEQS,
        num_tokens=40,  # 34 real tokens + padding
        num_seq_slots=8,  # one padding sequence
        hkv=2,
        group=2,
        head_dim=16,
        block_size=8,
        pages=10,  # 80 keys per row, not a multiple of every chunk size
    )
    kw = dict(sm_scale=0.25, soft_cap=soft_cap, sliding_window=sliding_window)
    ref = ragged_paged_attention_reference(*args, **kw)
    got = jax.jit(lambda *a: chunked_paged_attention(*a, keys_per_chunk=keys_per_chunk, **kw))(
        *args
    )
    real = sum(q for q, _ in SEQS)
    np.testing.assert_allclose(np.asarray(got[:real]), np.asarray(ref[:real]), atol=2e-5, rtol=0)
    assert np.all(np.isfinite(np.asarray(got)))
