"""KV pool sizing (override, device memory, CPU default) and allocation layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxserve.worker.kv_cache_alloc import (
    CPU_KV_CACHE_CAP_BYTES,
    allocate_kv_caches,
    cpu_default_num_blocks,
    determine_kv_cache_spec,
    device_memory,
)

SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=16)


class FakeDevice:
    """A device reporting memory stats like a GPU does."""

    def __init__(self, limit, in_use):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats


def _spec(device, **kw):
    args = dict(
        SHAPE,
        dtype=jnp.float32,
        block_size=16,
        gpu_memory_utilization=0.5,
        num_gpu_blocks_override=None,
        max_num_seqs=4,
        max_model_len=64,
        device=device,
    )
    args.update(kw)
    return determine_kv_cache_spec(**args)


def test_override_wins():
    spec = _spec(jax.devices()[0], num_gpu_blocks_override=7)
    assert spec.num_blocks == 7 and spec.source == "override"
    assert spec.bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert spec.num_tokens == 6 * 16


def test_cpu_default_holds_max_num_seqs_full_sequences_plus_null_block():
    cpu = jax.devices("cpu")[0]
    assert device_memory(cpu) is None
    spec = _spec(cpu)
    assert spec.source == "cpu-default"
    assert spec.num_blocks == 4 * (64 // 16) + 1
    # capped at CPU_KV_CACHE_CAP_BYTES
    big = _spec(cpu, max_num_seqs=100000, max_model_len=4096)
    assert big.total_bytes <= CPU_KV_CACHE_CAP_BYTES
    assert big.num_blocks == CPU_KV_CACHE_CAP_BYTES // (16 * big.bytes_per_token)
    assert cpu_default_num_blocks(1, 1, 16, 1) == 2


def test_memory_budget_subtracts_in_use_and_activations():
    per_block = 16 * (2 * 2 * 2 * 16 * 4)  # 4 KiB
    dev = FakeDevice(limit=1000 * per_block, in_use=100 * per_block)
    spec = _spec(dev, peak_activation_bytes=50 * per_block)
    # 0.5 * 1000 - 100 - 50 = 350 blocks
    assert spec.num_blocks == 350 and spec.source == "memory"
    with pytest.raises(ValueError, match="blocks"):
        _spec(dev, peak_activation_bytes=400 * per_block)


def test_allocation_layout():
    spec = _spec(jax.devices()[0], num_gpu_blocks_override=5, dtype=jnp.bfloat16)
    caches = allocate_kv_caches(spec)
    assert len(caches) == 2
    for k, v in caches:
        assert k.shape == v.shape == (5, 16, 2, 16)
        assert k.dtype == v.dtype == jnp.bfloat16
        assert not bool(k.any()) and k is not v


def test_tensor_parallel_pool_sized_per_device_by_the_tightest_device():
    """Each of 4 shards holds a quarter of a token's KV: the pool is 4x what one device's budget
    buys for whole tokens, and the device with the least room decides."""
    per_block_device = 16 * (2 * 2 * 4 * 16 * 4) // 4  # 4 KV heads split over 4 devices
    roomy = FakeDevice(limit=1000 * per_block_device, in_use=0)
    tight = FakeDevice(limit=1000 * per_block_device, in_use=200 * per_block_device)
    spec = _spec([roomy, tight, roomy, roomy], num_kv_heads=4, num_shards=4)
    assert spec.num_shards == 4 and spec.bytes_per_token_per_device == 2 * 2 * 16 * 4
    assert spec.num_blocks == 500 - 200 and spec.source == "memory"
    one = _spec(roomy, num_kv_heads=4)
    assert one.num_blocks == 500 // 4
