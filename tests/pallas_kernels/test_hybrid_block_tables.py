"""Sliding-window layers under the hybrid KV cache: every attention backend reads a layer's
group table whose entries before the window are stale.

The KV manager frees a sliding-window group's blocks once no query can read them and hands them
to other requests; the runner's copy of the table keeps the old ids (append-only), so those
entries point at blocks that now hold another request's K/V (jaxserve/core/kv_cache_manager.py).
Each backend must give the same output as with the null block there, and both must match the
float64 oracle: the TPU and GPU kernels in interpret mode on CPU (compiled on their devices),
the reference backend's chunked path, and the whole-row reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ragged_paged_attention import make_batch, naive_attention, rel_err, valid_rows

from jaxserve.model.chunked_attention import CpuAttentionTiling, chunked_paged_attention
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.ragged_paged_attention_tpu import ragged_paged_attention_tpu

BS = 8
WINDOW = 12
ON_TPU = jax.default_backend() == "tpu"
ON_GPU = jax.default_backend() == "gpu"
BACKENDS = {
    "reference": ragged_paged_attention_reference,
    "chunked": functools.partial(
        chunked_paged_attention,
        tiling=CpuAttentionTiling(decode_keys=16, decode_items=8, prefill_rows=16, prefill_keys=16),
    ),
    "pallas-gpu": functools.partial(ragged_paged_attention, interpret=not ON_GPU),
    "pallas-tpu": functools.partial(ragged_paged_attention_tpu, interpret=not ON_TPU),
}


def stale_and_null_tables(batch, rng):
    """Two copies of the batch's block tables: blocks wholly before every one of a sequence's
    queries' windows replaced by extra blocks of large random K/V (stale), or by the null block
    (what the KV manager's own table holds); the cache grows by the extra blocks."""
    stale, null = batch.block_tables.copy(), batch.block_tables.copy()
    extra = []
    for i in range(batch.num_seqs):
        q_len = batch.query_start_loc[i + 1] - batch.query_start_loc[i]
        first_pos = batch.context_lens[i] - q_len
        skip = max(0, first_pos - WINDOW + 1) // BS  # the manager's rule
        for j in range(skip):
            extra.append((i, j))
    n = batch.k_cache.shape[0]
    shape = (len(extra), *batch.k_cache.shape[1:])
    batch.k_cache = np.concatenate([batch.k_cache, 1e3 * rng.standard_normal(shape)]).astype(
        np.float32
    )
    batch.v_cache = np.concatenate([batch.v_cache, 1e3 * rng.standard_normal(shape)]).astype(
        np.float32
    )
    for k, (i, j) in enumerate(extra):
        stale[i, j] = n + k
        null[i, j] = 0
    assert extra, "the batch must leave blocks behind its windows"
    return stale, null


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_stale_entries_before_the_window_change_nothing(backend):
    rng = np.random.default_rng(7)
    head_dim = 128 if ON_TPU else 16
    # a decode deep in its context, a chunk on cached context, a fresh prefill shorter than
    # the window, one padding sequence; 16 tokens (the TPU kernel's 8-token query tiles)
    seqs = [(1, 40), (5, 37), (9, 9)]
    batch = make_batch(
        rng,
        seqs,
        num_tokens=16,
        num_seq_slots=4,
        num_kv_heads=2,
        group=2,
        head_dim=head_dim,
        block_size=BS,
        pages_per_seq=6,
    )
    stale, null = stale_and_null_tables(batch, rng)
    kw = dict(sm_scale=head_dim**-0.5, sliding_window=WINDOW)
    fn = jax.jit(functools.partial(BACKENDS[backend], **kw))  # one trace for both tables
    outs = []
    for table in (stale, null):
        batch.block_tables = table
        outs.append(np.asarray(fn(*batch.args(jnp.float32))))
    n = valid_rows(batch)
    np.testing.assert_array_equal(outs[0][:n], outs[1][:n])
    assert rel_err(outs[1][:n], naive_attention(batch, jnp.float32, **kw)[:n]) <= 1e-5
