"""Ragged paged attention: kernel vs reference vs a naive numpy oracle.

The same tests run the Pallas kernel in interpret mode on CPU and compiled on
a GPU (JAX's Pallas test convention). Batches are random and ragged: decode
tokens, prefill chunks on top of cached context, lengths that are not a
multiple of the block size, the longest context the block table allows,
shuffled physical blocks, padding tokens and padding sequences.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention_tuning import KernelConfig
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = jax.default_backend() == "cpu"
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@dataclasses.dataclass
class Batch:
    q: np.ndarray  # [T, Hq, D]
    k_cache: np.ndarray  # [N, bs, Hkv, D]
    v_cache: np.ndarray
    block_tables: np.ndarray  # [S, P] int32
    context_lens: np.ndarray  # [S] int32
    query_start_loc: np.ndarray  # [S + 1] int32
    num_seqs: int

    def args(self, dtype):
        return (
            jnp.asarray(self.q, dtype),
            jnp.asarray(self.k_cache, dtype),
            jnp.asarray(self.v_cache, dtype),
            jnp.asarray(self.block_tables),
            jnp.asarray(self.context_lens),
            jnp.asarray(self.query_start_loc),
            jnp.int32(self.num_seqs),
        )


def make_batch(
    rng,
    seqs,
    *,
    num_tokens,
    num_seq_slots,
    num_kv_heads,
    group,
    head_dim,
    block_size,
    pages_per_seq,
    num_blocks=None,
) -> Batch:
    """Builds a ragged batch; ``seqs`` lists (query_len, context_len) pairs."""
    assert sum(q for q, _ in seqs) <= num_tokens and len(seqs) <= num_seq_slots
    need = sum(-(-c // block_size) for _, c in seqs)
    num_blocks = num_blocks or need + 3
    # Physical blocks 1.. in random order; block 0 is the null block.
    free = list(rng.permutation(np.arange(1, num_blocks)))
    block_tables = np.zeros((num_seq_slots, pages_per_seq), np.int32)
    context_lens = np.zeros(num_seq_slots, np.int32)
    query_start_loc = np.zeros(num_seq_slots + 1, np.int32)
    for i, (q_len, ctx) in enumerate(seqs):
        assert 1 <= q_len <= ctx <= pages_per_seq * block_size
        n = -(-ctx // block_size)
        block_tables[i, :n] = [free.pop() for _ in range(n)]
        context_lens[i] = ctx
        query_start_loc[i + 1] = query_start_loc[i] + q_len
    query_start_loc[len(seqs) + 1 :] = query_start_loc[len(seqs)]
    hq = num_kv_heads * group
    # Every slot, used or not (and the null block), holds finite random data.
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return Batch(
        q=rng.standard_normal((num_tokens, hq, head_dim)).astype(np.float32),
        k_cache=rng.standard_normal(cache_shape).astype(np.float32),
        v_cache=rng.standard_normal(cache_shape).astype(np.float32),
        block_tables=block_tables,
        context_lens=context_lens,
        query_start_loc=query_start_loc,
        num_seqs=len(seqs),
    )


def naive_attention(batch: Batch, dtype, *, sm_scale, soft_cap=None, sliding_window=None):
    """Dense per-token attention in float64 over contiguous per-sequence K/V."""
    cast = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
    q, kc, vc = cast(batch.q), cast(batch.k_cache), cast(batch.v_cache)
    num_tokens, hq, _ = q.shape
    block_size, hkv = kc.shape[1], kc.shape[2]
    out = np.zeros_like(q)
    for i in range(batch.num_seqs):
        ctx = int(batch.context_lens[i])
        start, end = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
        blocks = batch.block_tables[i, : -(-ctx // block_size)]
        k = kc[blocks].reshape(-1, hkv, kc.shape[-1])[:ctx]
        v = vc[blocks].reshape(-1, hkv, vc.shape[-1])[:ctx]
        for j, t in enumerate(range(start, end)):
            pos = ctx - (end - start) + j
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(hq):
                kh = h // (hq // hkv)
                logits = k[lo : pos + 1, kh] @ q[t, h] * sm_scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                p = np.exp(logits - logits.max())
                out[t, h] = (p / p.sum()) @ v[lo : pos + 1, kh]
    return out


def valid_rows(batch: Batch) -> int:
    return int(batch.query_start_loc[batch.num_seqs])


def rel_err(x, y) -> float:
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30))


# (query_len, context_len) per sequence: a decode token, a fresh prefill whose
# length is not a multiple of the block size, a prefill chunk on top of cached
# context, and the longest context of the block table.
def mixed_seqs(block_size, pages_per_seq):
    longest = pages_per_seq * block_size
    return [
        (1, block_size + 3),
        (block_size + 5, block_size + 5),
        (7, 2 * block_size + 1),
        (1, longest),
        (3, longest),
    ]


# bf16 first: compiled on a GPU, float32 tilings compile slowest (see the GPU
# section below). The float32 cases cover GQA ratios 1, 3 and 4 in float32.
CASES = [
    # dtype, num_kv_heads, group, head_dim, block_size, soft_cap, sliding_window
    pytest.param(jnp.bfloat16, 1, 8, 256, 16, None, None, id="bf16-gqa8-d256-bs16"),
    pytest.param(jnp.float32, 2, 1, 64, 16, None, None, id="f32-mha-d64-bs16"),
    pytest.param(jnp.float32, 1, 4, 128, 32, 20.0, None, id="f32-gqa4-d128-bs32-softcap"),
    pytest.param(jnp.float32, 2, 3, 64, 64, None, 40, id="f32-gqa3-d64-bs64-window"),
]


@pytest.mark.parametrize("dtype,num_kv_heads,group,head_dim,block_size,soft_cap,window", CASES)
def test_kernel_matches_reference(
    dtype, num_kv_heads, group, head_dim, block_size, soft_cap, window
):
    rng = np.random.default_rng(hash((num_kv_heads, group, head_dim, block_size)) % 2**32)
    pages_per_seq = 4
    seqs = mixed_seqs(block_size, pages_per_seq)
    num_tokens = sum(q for q, _ in seqs) + 5  # 5 padding tokens
    batch = make_batch(
        rng,
        seqs,
        num_tokens=num_tokens,
        num_seq_slots=len(seqs) + 2,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        pages_per_seq=pages_per_seq,
    )
    kw = dict(sm_scale=head_dim**-0.5, soft_cap=soft_cap, sliding_window=window)
    out = ragged_paged_attention(*batch.args(dtype), interpret=INTERPRET, **kw)
    ref = ragged_paged_attention_reference(*batch.args(dtype), **kw)
    assert out.shape == batch.q.shape and out.dtype == dtype
    n = valid_rows(batch)
    # The reference against the float64 oracle, then the kernel against the reference.
    assert rel_err(ref[:n], naive_attention(batch, dtype, **kw)[:n]) <= TOL[dtype]
    assert rel_err(out[:n], ref[:n]) <= TOL[dtype]
    # Padding tokens come back as finite zeros from both.
    assert np.all(np.asarray(out[n:], np.float32) == 0.0)
    assert np.all(np.asarray(ref[n:], np.float32) == 0.0)


@pytest.mark.parametrize(
    "config,block_size",
    [
        (KernelConfig(block_q=4, block_k=16, num_splits=1), 16),
        (KernelConfig(block_q=4, block_k=32, num_splits=4), 16),
        (KernelConfig(block_q=16, block_k=16, num_splits=2), 32),
    ],
    ids=[
        "one-split-block-per-step",
        "flash-decoding-4-two-blocks-per-step",
        "prefill-tile-2-splits-half-block-steps",
    ],
)
def test_kernel_configs(config, block_size):
    """Explicit tilings: several tiles per sequence, context split over programs,
    KV steps of one, two or half a cache block."""
    rng = np.random.default_rng(7)
    seqs = [(1, 90), (1, 17), (37, 60), (1, 96), (2, 2)]
    batch = make_batch(
        rng,
        seqs,
        num_tokens=48,
        num_seq_slots=6,
        num_kv_heads=2,
        group=4,
        head_dim=64,
        block_size=block_size,
        pages_per_seq=96 // block_size,
    )
    kw = dict(sm_scale=0.125, sliding_window=33)
    out = ragged_paged_attention(*batch.args(jnp.float32), interpret=INTERPRET, config=config, **kw)
    expected = naive_attention(batch, jnp.float32, **kw)
    n = valid_rows(batch)
    assert rel_err(out[:n], expected[:n]) <= 1e-5
    assert np.all(np.asarray(out[n:]) == 0.0)


def test_reference_detects_wrong_context():
    """The oracle comparison is sensitive: one token less of context changes it."""
    rng = np.random.default_rng(4)
    batch = make_batch(
        rng,
        [(2, 20)],
        num_tokens=2,
        num_seq_slots=1,
        num_kv_heads=1,
        group=1,
        head_dim=16,
        block_size=8,
        pages_per_seq=3,
    )
    expected = naive_attention(batch, jnp.float32, sm_scale=0.25)
    batch.context_lens = batch.context_lens - 1
    ref = ragged_paged_attention_reference(*batch.args(jnp.float32), sm_scale=0.25)
    assert rel_err(ref, expected) > 1e-3


def _valid_args():
    rng = np.random.default_rng(5)
    return make_batch(
        rng,
        [(1, 5)],
        num_tokens=4,
        num_seq_slots=2,
        num_kv_heads=2,
        group=2,
        head_dim=64,
        block_size=16,
        pages_per_seq=2,
    ).args(jnp.float32)


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda a: (a[0][:, :3],) + a[1:], "num_q_heads"),
        (lambda a: (a[0][..., :32],) + a[1:], "head_dim"),
        (lambda a: (a[0].astype(jnp.bfloat16),) + a[1:], "dtype"),
        (lambda a: a[:3] + (a[3].astype(jnp.float32),) + a[4:], "block_tables"),
        (lambda a: a[:4] + (a[4][:1],) + a[5:], "context_lens"),
        (lambda a: a[:5] + (a[5][:2],) + a[6:], "query_start_loc"),
        (lambda a: a[:6] + (jnp.zeros((2,), jnp.int32),), "num_seqs"),
    ],
)
@pytest.mark.parametrize("fn", [ragged_paged_attention, ragged_paged_attention_reference])
def test_invalid_inputs_raise(mutate, field, fn):
    with pytest.raises(ValueError, match=field):
        fn(*mutate(_valid_args()), sm_scale=0.1, interpret=INTERPRET)


def test_invalid_options_raise():
    args = _valid_args()
    with pytest.raises(ValueError, match="sliding_window"):
        ragged_paged_attention(*args, sm_scale=0.1, sliding_window=0, interpret=INTERPRET)
    with pytest.raises(ValueError, match="soft_cap"):
        ragged_paged_attention(*args, sm_scale=0.1, soft_cap=-1.0, interpret=INTERPRET)
    q = jnp.zeros((4, 4, 48), jnp.float32)
    kv = jnp.zeros((3, 16, 2, 48), jnp.float32)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        ragged_paged_attention(q, kv, kv, *args[3:], sm_scale=0.1, interpret=INTERPRET)


# ---------------------------------------------------------------------------
# Compiled on a GPU only (interpret mode would take minutes). Ordered so that
# a run cut short by its time budget (scripts/gpu_kernel_check.sh) has the
# most important checks: flash-decoding at Llama-3-8B's layout in bf16, then
# the bf16 sweep, then a reduced float32 sweep (float32 tilings spill
# registers and compile slowest; the first H200 run spent its budget there).
# Distinct kernel compiles: 3 + 12 + 5 (was 3 + 24 with float32 everywhere);
# reference compiles: 1 + 12 + 5 (was 3 + 24).
# ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _llama_decode_batch() -> Batch:
    """32 decode tokens at Llama-3-8B's head layout, contexts up to 4,096 (built
    once: the host-side random cache is ~1 GB of float32)."""
    rng = np.random.default_rng(1)
    seqs = [(1, int(c)) for c in rng.integers(1, 4096, size=30)] + [(1, 4096), (1, 1)]
    return make_batch(
        rng,
        seqs,
        num_tokens=40,
        num_seq_slots=34,
        num_kv_heads=8,
        group=4,
        head_dim=128,
        block_size=16,
        pages_per_seq=256,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled-kernel check needs a GPU")
@pytest.mark.parametrize("num_splits", [1, 8, 64])
def test_gpu_decode_splits(num_splits):
    """Flash-decoding at Llama-3-8B's head layout, long contexts, bf16. One
    batch for the three split counts: one reference compile, three kernels."""
    batch = _llama_decode_batch()
    config = KernelConfig(block_q=4, block_k=128, num_splits=num_splits)
    kw = dict(sm_scale=128**-0.5)
    out = ragged_paged_attention(*batch.args(jnp.bfloat16), config=config, **kw)
    ref = ragged_paged_attention_reference(*batch.args(jnp.bfloat16), **kw)
    n = valid_rows(batch)
    assert rel_err(out[:n], ref[:n]) <= 1e-2
    assert np.all(np.asarray(out[n:], np.float32) == 0.0)


# (group, head_dim, block_size): every GQA ratio 1-8, head dim and block size.
GPU_SWEEP = [
    (1, 64, 16),
    (2, 128, 32),
    (4, 256, 64),
    (8, 64, 32),
    (3, 128, 16),
    (4, 128, 16),
    (8, 128, 64),
    (2, 256, 16),
    (6, 64, 64),
    (7, 128, 64),
    (5, 64, 32),
    (8, 256, 16),
]
# float32 runs the GQA ratios CASES does not compile in float32 (2, 5, 6, 7, 8),
# choosing per ratio the entry whose float32 tiling compiles fastest (Triton +
# ptxas for sm_90 on the CPU box, pallas_kernels/triton_aot.py: these five take
# 59 s there, all twelve 169 s, entry 1 alone 21 s). Head dims 64-256, block
# sizes 16-64; entries 7, 9 and 11 have soft cap and window.
F32_SWEEP = [7, 8, 9, 10, 11]
GPU_SWEEP_CASES = [pytest.param(jnp.bfloat16, i, id=f"bf16-{i}") for i in range(len(GPU_SWEEP))] + [
    pytest.param(jnp.float32, i, id=f"f32-{i}") for i in F32_SWEEP
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled-kernel sweep needs a GPU")
@pytest.mark.parametrize("dtype,index", GPU_SWEEP_CASES)
def test_gpu_sweep(dtype, index):
    """Every GQA ratio, head dim and block size (bf16; float32 on a subset),
    decode and prefill mixed, long contexts; every other entry with soft cap
    and sliding window."""
    group, head_dim, block_size = GPU_SWEEP[index]
    soft_cap, window = (30.0, 700) if index % 2 else (None, None)
    rng = np.random.default_rng(index)
    pages_per_seq = 1024 // block_size
    longest = pages_per_seq * block_size
    lens = rng.integers(1, longest, size=24)
    seqs = [(1, int(c)) for c in lens[:16]]  # decode tokens
    seqs += [(int(min(c, rng.integers(1, 300))), int(c)) for c in lens[16:]]  # chunks
    seqs += [(1, longest), (64, longest)]
    batch = make_batch(
        rng,
        seqs,
        num_tokens=sum(q for q, _ in seqs) + 13,
        num_seq_slots=len(seqs) + 3,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        pages_per_seq=pages_per_seq,
    )
    kw = dict(sm_scale=head_dim**-0.5, soft_cap=soft_cap, sliding_window=window)
    out = ragged_paged_attention(*batch.args(dtype), **kw)
    ref = ragged_paged_attention_reference(*batch.args(dtype), **kw)
    n = valid_rows(batch)
    assert rel_err(out[:n], ref[:n]) <= TOL[dtype]
    assert np.all(np.asarray(out[n:], np.float32) == 0.0)


def test_gpu_sweep_covers_every_gqa_ratio_in_both_dtypes():
    """The reduced float32 sweep plus CASES still compile every GQA ratio 1-8
    in float32; the bf16 sweep has all of them."""
    f32 = {GPU_SWEEP[i][0] for i in F32_SWEEP}
    f32 |= {p.values[2] for p in CASES if p.values[0] == jnp.float32}
    bf16 = {g for g, _, _ in GPU_SWEEP}
    assert f32 == bf16 == set(range(1, 9))
