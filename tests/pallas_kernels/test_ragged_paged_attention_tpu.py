"""The TPU ragged paged-attention kernel against the jnp reference and a float64 oracle.

On CPU (CI) every test runs the kernel in Pallas' TPU interpret mode, which simulates HBM,
VMEM, the DMAs and their semaphores; on a TPU the same tests run it compiled (``interpret`` is
chosen per platform), and the ``tpu``-marked test adds real-model shapes there. Batches are
random and ragged: decode tokens, prefill chunks on top of cached context, fresh prefills,
query tiles spanning several sequences, contexts up to the whole block table, shuffled
physical blocks, padding tokens and padding sequences. Shapes stay tiny: interpreting costs
seconds per distinct shape on the 2-core CI box.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ragged_paged_attention import make_batch, naive_attention, rel_err, valid_rows

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_tpu import (
    TPU_BLOCK_Q,
    check_tpu_shapes,
    ragged_paged_attention_tpu,
    tpu_head_dim,
)

ON_TPU = jax.default_backend() == "tpu"
INTERPRET = not ON_TPU
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def random_seqs(rng, *, num_seqs, block_size, pages_per_seq):
    """``num_seqs`` (query_len, context_len) pairs: decodes, chunks on cached context, fresh
    prefills, and one sequence at the block table's full length."""
    longest = pages_per_seq * block_size
    seqs = []
    for i in range(num_seqs):
        ctx = int(rng.integers(1, longest + 1)) if i else longest
        kind = rng.integers(3)
        q_len = 1 if kind == 0 else ctx if kind == 1 else int(rng.integers(1, ctx + 1))
        seqs.append((q_len, ctx))
    return seqs


def random_batch(
    rng, *, pad_tokens=3, extra_slots=2, num_seqs, group, num_kv_heads, head_dim, block_size
):
    pages_per_seq = 3
    seqs = random_seqs(rng, num_seqs=num_seqs, block_size=block_size, pages_per_seq=pages_per_seq)
    num_tokens = sum(q for q, _ in seqs) + pad_tokens
    num_tokens = -(-num_tokens // TPU_BLOCK_Q) * TPU_BLOCK_Q
    return make_batch(
        rng,
        seqs,
        num_tokens=num_tokens,
        num_seq_slots=num_seqs + extra_slots,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        pages_per_seq=pages_per_seq,
    )


def check_against_reference(batch, dtype, *, pages_per_step=None, **kw):
    head_dim = batch.q.shape[-1]
    kw = dict(sm_scale=head_dim**-0.5, **kw)
    out = ragged_paged_attention_tpu(
        *batch.args(dtype), interpret=INTERPRET, pages_per_step=pages_per_step, **kw
    )
    ref = ragged_paged_attention_reference(*batch.args(dtype), **kw)
    assert out.shape == batch.q.shape and out.dtype == dtype
    n = valid_rows(batch)
    assert rel_err(ref[:n], naive_attention(batch, dtype, **kw)[:n]) <= TOL[dtype]
    assert rel_err(out[:n], ref[:n]) <= TOL[dtype]
    assert np.all(np.asarray(out[n:], np.float32) == 0.0)  # padding tokens: zeros


# Compiled, head dims are multiples of 128; interpreted, small ones keep CI fast.
D = 128 if ON_TPU else 16

CASES = [
    # dtype, num_kv_heads, group, block_size, soft_cap, sliding_window, pages_per_step
    pytest.param(jnp.float32, 2, 1, 8, None, None, 2, id="f32-mha-bs8"),
    pytest.param(jnp.float32, 1, 8, 16, 5.0, 11, None, id="f32-gqa8-softcap-window"),
    pytest.param(jnp.bfloat16, 2, 3, 8, None, 6, 1, id="bf16-gqa3-window-page-steps"),
    pytest.param(jnp.float32, 2, 4, 8, 3.0, None, 3, id="f32-gqa4-softcap-ragged-steps"),
]


@pytest.mark.parametrize("dtype,num_kv_heads,group,block_size,soft_cap,window,pps", CASES)
def test_kernel_matches_reference(dtype, num_kv_heads, group, block_size, soft_cap, window, pps):
    rng = np.random.default_rng(group * 10 + num_kv_heads)
    batch = random_batch(
        rng,
        num_seqs=6,
        group=group,
        num_kv_heads=num_kv_heads,
        head_dim=D,
        block_size=block_size,
    )
    check_against_reference(
        batch, dtype, pages_per_step=pps, soft_cap=soft_cap, sliding_window=window
    )


@pytest.mark.slow
def test_kernel_matches_reference_other_gqa_ratios():
    """GQA ratios 2, 5, 6 and 7 (CASES has 1, 3, 4 and 8), mixed with window and soft cap."""
    for group in (2, 5, 6, 7):
        rng = np.random.default_rng(100 + group)
        batch = random_batch(
            rng, num_seqs=4, extra_slots=0, group=group, num_kv_heads=1, head_dim=D, block_size=8
        )
        window = 9 if group % 2 else None
        soft_cap = 4.0 if group > 5 else None
        check_against_reference(batch, jnp.float32, soft_cap=soft_cap, sliding_window=window)


def test_tile_shared_by_many_decodes_and_empty_batch():
    """Eight decode tokens in one query tile (eight sequences per program), then a step whose
    every token is padding (num_seqs = 0)."""
    rng = np.random.default_rng(3)
    seqs = [(1, int(c)) for c in rng.integers(1, 24, size=8)]
    batch = make_batch(
        rng,
        seqs,
        num_tokens=16,
        num_seq_slots=8,  # no padding slot: the sequence search's upper edge
        num_kv_heads=1,
        group=2,
        head_dim=D,
        block_size=8,
        pages_per_seq=3,
    )
    check_against_reference(batch, jnp.float32)
    batch.num_seqs = 0
    batch.query_start_loc[:] = 0
    batch.context_lens[:] = 0
    out = ragged_paged_attention_tpu(*batch.args(jnp.float32), sm_scale=0.25, interpret=INTERPRET)
    assert np.all(np.asarray(out) == 0.0)


def test_kernel_detects_wrong_context():
    """The comparison is sensitive: the kernel reading one token less of context differs."""
    rng = np.random.default_rng(4)
    batch = make_batch(
        rng,
        [(3, 20)],
        num_tokens=8,
        num_seq_slots=1,
        num_kv_heads=1,
        group=1,
        head_dim=D,
        block_size=8,
        pages_per_seq=3,
    )
    expected = naive_attention(batch, jnp.float32, sm_scale=0.25)
    batch.context_lens = batch.context_lens - 1
    out = ragged_paged_attention_tpu(*batch.args(jnp.float32), sm_scale=0.25, interpret=INTERPRET)
    assert rel_err(out[:3], expected[:3]) > 1e-3


def test_tpu_shape_rules():
    check_tpu_shapes(num_tokens=16, head_dim=64, block_size=4, interpret=True)
    check_tpu_shapes(num_tokens=16, head_dim=256, block_size=16, interpret=False)
    with pytest.raises(ValueError, match="num_tokens .* multiple of the TPU kernel's query tile"):
        check_tpu_shapes(num_tokens=12, head_dim=128, block_size=16, interpret=True)
    with pytest.raises(ValueError, match="head_dim .* multiple of 128"):
        check_tpu_shapes(num_tokens=16, head_dim=64, block_size=16, interpret=False)
    with pytest.raises(ValueError, match="block_size .* multiple of 8"):
        check_tpu_shapes(num_tokens=16, head_dim=128, block_size=4, interpret=False)
    assert [tpu_head_dim(d) for d in (32, 64, 128, 192, 256)] == [128, 128, 128, 256, 256]


def test_kernel_rejects_bad_inputs_before_tracing():
    """Shape errors name the field (shared checks with the GPU kernel) or the TPU rule."""
    rng = np.random.default_rng(5)
    args = make_batch(
        rng,
        [(1, 5)],
        num_tokens=8,
        num_seq_slots=2,
        num_kv_heads=2,
        group=2,
        head_dim=16,
        block_size=8,
        pages_per_seq=2,
    ).args(jnp.float32)
    with pytest.raises(ValueError, match="context_lens"):
        ragged_paged_attention_tpu(*args[:4], args[4][:1], *args[5:], sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="query tile"):
        ragged_paged_attention_tpu(args[0][:6], *args[1:], sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="head_dim"):
        ragged_paged_attention_tpu(*args, sm_scale=0.1, interpret=False)


@pytest.mark.tpu
@pytest.mark.skipif(not ON_TPU, reason="compiled-kernel check needs a TPU")
@pytest.mark.parametrize("group,soft_cap,window", [(4, None, None), (8, 30.0, 700)])
def test_tpu_compiled_llama_shapes(group, soft_cap, window):
    """Compiled on a TPU: Llama-3-8B's KV heads (8) and head dim (128), bf16, block size 16,
    decodes and chunks over contexts up to 1,024."""
    rng = np.random.default_rng(group)
    pages_per_seq = 64
    seqs = [(1, int(c)) for c in rng.integers(1, 1024, size=24)]
    seqs += [(int(rng.integers(1, 200)), 1024), (1, 1024)]
    num_tokens = -(-(sum(q for q, _ in seqs) + 5) // TPU_BLOCK_Q) * TPU_BLOCK_Q
    batch = make_batch(
        rng,
        seqs,
        num_tokens=num_tokens,
        num_seq_slots=32,
        num_kv_heads=8,
        group=group,
        head_dim=128,
        block_size=16,
        pages_per_seq=pages_per_seq,
    )
    kw = dict(sm_scale=128**-0.5, soft_cap=soft_cap, sliding_window=window)
    out = ragged_paged_attention_tpu(*batch.args(jnp.bfloat16), **kw)
    ref = ragged_paged_attention_reference(*batch.args(jnp.bfloat16), **kw)
    n = valid_rows(batch)
    assert rel_err(out[:n], ref[:n]) <= TOL[jnp.bfloat16]
    assert np.all(np.asarray(out[n:], np.float32) == 0.0)
