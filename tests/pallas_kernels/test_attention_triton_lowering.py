"""The attention kernel lowers to Triton IR for an H200, checked on CPU.

JAX lowers for CUDA without a GPU when an abstract GPU device is in scope,
running the Pallas Triton lowering rules; a kernel that uses an op or shape
Triton cannot take fails here rather than on the GPU machine. Also checks the
static tile choices of ``attention_tuning.choose_config``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.attention_tuning import (
    SMEM_BUDGET,
    KernelConfig,
    choose_config,
    shared_memory_estimate,
)
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.triton_aot import triton_ir

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def shapes(T, S, Hq, Hkv, D, N, bs, P, dtype):
    sds = jax.ShapeDtypeStruct
    kv = sds((N, bs, Hkv, D), dtype)
    return (
        sds((T, Hq, D), dtype),
        kv,
        kv,
        sds((S, P), jnp.int32),
        sds((S,), jnp.int32),
        sds((S + 1,), jnp.int32),
        sds((), jnp.int32),
    )


@pytest.mark.parametrize(
    "shape_args,kwargs",
    [
        # Llama-3-8B decode, batch 64: flash-decoding splits.
        ((64, 64, 32, 8, 128, 8192, 16, 128, jnp.bfloat16), {}),
        # Llama-3-8B prefill chunk: 64-row tiles, wgmma-sized dots.
        ((2048, 4, 32, 8, 128, 8192, 16, 256, jnp.bfloat16), {}),
        # float32, head dim 256, soft cap and sliding window, GQA 3 (padded to 4).
        ((256, 8, 12, 4, 256, 512, 64, 16, jnp.float32), dict(soft_cap=30.0, sliding_window=100)),
        # Explicit config: half a KV block per step, MHA, 64-bit offsets (> 4 GiB cache).
        (
            (32, 32, 8, 8, 64, 1 << 17, 32, 64, jnp.bfloat16),
            dict(
                config=KernelConfig(block_q=16, block_k=16, num_splits=4, num_warps=8, num_stages=3)
            ),
        ),
    ],
    ids=["decode", "prefill", "f32-d256-softcap-window-gqa3", "mha-64bit-offsets"],
)
def test_lowers_to_triton(shape_args, kwargs):
    T, S, Hq, Hkv, D, N, bs, P, dtype = shape_args
    kernels = triton_ir(ragged_paged_attention, *shapes(*shape_args), sm_scale=D**-0.5, **kwargs)
    assert len(kernels) == 1
    [kernel] = kernels
    assert kernel["name"].startswith("ragged_paged_attention")
    ttir = kernel["ttir"]
    assert "tt.func" in ttir and "scf.for" in ttir
    assert ttir.count("tt.dot") >= 2  # QK^T and PV
    config = kwargs.get("config") or choose_config(
        num_tokens=T,
        num_seqs=S,
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        head_dim=D,
        block_size=bs,
        pages_per_seq=P,
        dtype=dtype,
    )
    assert kernel["num_warps"] == config.num_warps
    assert kernel["num_stages"] == config.num_stages
    assert kernel["grid"][1:] == [Hkv, config.num_splits]


def test_choose_config_decode_splits_context():
    kw = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=jnp.bfloat16)
    one = choose_config(num_tokens=1, num_seqs=1, pages_per_seq=512, **kw)
    many = choose_config(num_tokens=256, num_seqs=256, pages_per_seq=512, **kw)
    # Few sequences: split the context to fill the GPU; many: one split.
    assert one.num_splits >= 16 and many.num_splits == 1
    # Decode tiles are 16 rows: 4 tokens x 4 query heads of a KV group.
    assert one.block_q * 4 == 16
    # 64 tokens of K per step (16 KiB in bf16 at head dim 128).
    assert one.block_k == 64


def test_choose_config_prefill():
    cfg = choose_config(
        num_tokens=4096,
        num_seqs=1,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        pages_per_seq=512,
        dtype=jnp.bfloat16,
    )
    assert cfg.block_q * 4 >= 64 and cfg.num_splits == 1
    short = choose_config(
        num_tokens=8,
        num_seqs=1,
        num_q_heads=8,
        num_kv_heads=8,
        head_dim=64,
        block_size=16,
        pages_per_seq=2,
        dtype=jnp.float32,
    )
    # A KV step never spans more than the block table holds.
    assert short.block_k <= 32 and short.num_splits <= 1


def test_kernel_config_validates():
    with pytest.raises(ValueError, match="block_q"):
        KernelConfig(block_q=3, block_k=16)
    with pytest.raises(ValueError, match="num_stages"):
        KernelConfig(block_q=4, block_k=16, num_stages=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("head_dim,block_size", [(256, 64), (128, 16), (64, 32)])
@pytest.mark.parametrize("num_tokens,num_seqs", [(64, 64), (4096, 1)])
def test_choose_config_fits_shared_memory(dtype, head_dim, block_size, num_tokens, num_seqs):
    cfg = choose_config(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=head_dim,
        block_size=block_size,
        pages_per_seq=256,
        dtype=dtype,
    )
    block_m = cfg.block_q * 4
    itemsize = jnp.dtype(dtype).itemsize
    assert (
        shared_memory_estimate(block_m, cfg.block_k, head_dim, itemsize, cfg.num_stages)
        <= SMEM_BUDGET
    )
    assert cfg.num_stages >= 2  # these layouts all keep a pipelined KV loop
