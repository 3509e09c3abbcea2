"""Sizing and allocating the paged KV cache on the device (vLLM's ``determine_available_memory``).

The pool gets what is left of ``gpu_memory_utilization × device memory`` once the weights (and
anything else already on the device) and the step's peak activation memory are accounted for:

    kv_bytes = utilization * bytes_limit - bytes_in_use - peak_activation_bytes
    num_blocks = kv_bytes // (block_size * bytes_per_token)

``bytes_limit`` / ``bytes_in_use`` come from ``device.memory_stats()``; the activation peak from
``compiled.memory_analysis()`` of the largest step bucket (temporaries plus outputs that do not
alias a donated input), measured by the runner before the pool exists. CPU devices report no
memory stats; there the pool holds ``max_num_seqs`` full-length sequences (plus the null block),
capped at ``CPU_KV_CACHE_CAP_BYTES`` (1 GiB per device); a sequence's blocks are counted per
KV-cache group (``jaxserve.core.kv_cache_groups.blocks_per_sequence``: a sliding-window group
holds its window only). ``num_gpu_blocks_override`` bypasses both.

Tensor parallel (``num_shards`` > 1): every device holds ``1 / num_shards`` of each token's KV
(its KV heads), so the pool is sized from each device's own budget and its share of a token's
bytes, and the device with the least room decides (the pool has the same blocks on all of them);
over several processes, the process with the least room (``min_over_processes``).

Layout (docs/ARCHITECTURE.md): one ``(k_cache, v_cache)`` pair per layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype; block 0 is the null block.
With KV-cache groups (``jaxserve/core/kv_cache_groups.py``) the groups share the pairs: one pair
per layer of a group (``KVCacheLayout.num_tensors``), so a block is that many layers' memory.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.kv_cache_groups import KVCacheLayout, blocks_per_sequence
from jaxserve.core.kv_cache_utils import compute_num_gpu_blocks, kv_cache_bytes_per_token

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.model.arch_config import ModelArchConfig

logger = logging.getLogger(__name__)

CPU_KV_CACHE_CAP_BYTES = 1 << 30
"""Largest KV pool sized automatically on a device without memory stats (CPU), bytes."""

KVCaches = list[tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """The resolved KV pool.

    Attributes:
      num_blocks: blocks in the pool, the null block included.
      block_size: tokens per block.
      num_layers: ``(k_cache, v_cache)`` pairs in the pool: the model's layers, or the layers
        of one KV-cache group when the groups share the pairs (``KVCacheLayout.num_tensors``).
      num_kv_heads, head_dim: per-layer array shape parts.
      dtype: element dtype name ("float32", "bfloat16").
      bytes_per_token: ``2 * num_layers * num_kv_heads * head_dim * itemsize``, bytes: one
        block-slot's bytes (a token's K/V in one group's layers).
      source: how num_blocks was chosen: "override", "memory" or "cpu-default".
      num_shards: devices the KV heads are split over (tensor parallel size).
    """

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_token: int
    source: str
    num_shards: int = 1

    @property
    def num_tokens(self) -> int:
        """Token slots the usable blocks hold (the null block excluded)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def bytes_per_token_per_device(self) -> int:
        """One device's share of a token's KV bytes (its KV heads)."""
        return self.bytes_per_token // self.num_shards

    @property
    def total_bytes(self) -> int:
        """Device bytes of the whole pool, K and V of every layer, the null block included."""
        return self.num_blocks * self.block_size * self.bytes_per_token

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        """``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


def device_memory(device: jax.Device) -> tuple[int, int] | None:
    """``(bytes_limit, bytes_in_use)`` from ``device.memory_stats()``, or None when the device
    reports none (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        stats = None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def cpu_default_num_blocks(
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    bytes_per_token: int,
    blocks_per_seq: int | None = None,
) -> int:
    """Blocks for ``max_num_seqs`` sequences of ``max_model_len`` tokens plus the null block,
    capped at ``CPU_KV_CACHE_CAP_BYTES``; at least 2. ``blocks_per_seq``: one sequence's
    blocks, all KV-cache groups together (default ``ceil(max_model_len / block_size)``)."""
    if blocks_per_seq is None:
        blocks_per_seq = math.ceil(max_model_len / block_size)
    wanted = max_num_seqs * blocks_per_seq + 1
    cap = CPU_KV_CACHE_CAP_BYTES // (block_size * bytes_per_token)
    return max(2, min(wanted, cap))


def determine_kv_cache_spec(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: jnp.dtype,
    block_size: int,
    gpu_memory_utilization: float,
    num_gpu_blocks_override: int | None,
    max_num_seqs: int,
    max_model_len: int,
    device: jax.Device | Sequence[jax.Device],
    peak_activation_bytes: int = 0,
    num_shards: int = 1,
    blocks_per_seq: int | None = None,
    extra_bytes_per_token: int = 0,
    device_memories: Sequence[tuple[int, int] | None] | None = None,
) -> KVCacheSpec:
    """Chooses the number of KV blocks (see the module docstring for the rule).

    Args:
      num_layers, num_kv_heads, head_dim: the pool's array shape (``num_layers``: its
        ``(k_cache, v_cache)`` pairs, ``KVCacheSpec.num_layers``; ``num_kv_heads`` counts every
        shard's heads, replicated ones included).
      dtype: the KV cache dtype (the model dtype).
      block_size: tokens per block.
      gpu_memory_utilization: fraction of the device's memory the engine may use, in (0, 1].
      num_gpu_blocks_override: use exactly this many blocks when not None.
      max_num_seqs, max_model_len: size of the CPU default.
      device: where the pool will live: one device, or this process's devices of the mesh.
      peak_activation_bytes: the largest step's activation memory per device, bytes (from
        ``compiled.memory_analysis()``); ignored on CPU and with an override.
      num_shards: devices the KV heads are split over; each holds ``1 / num_shards`` of a token.
      blocks_per_seq: one ``max_model_len`` sequence's blocks, all KV-cache groups together
        (``blocks_per_sequence``), for the CPU default; None: ``ceil(max_model_len /
        block_size)``.
      extra_bytes_per_token: bytes per token slot of another pool with the same blocks (a
        speculative draft model's K/V, split the same way); the blocks are sized for both.
      device_memories: ``(bytes_limit, bytes_in_use)`` per device (None: a device without
        memory stats) instead of asking ``device``: ``jaxserve plan`` sizes a device it does not
        have.

    Returns:
      The KVCacheSpec.

    Raises:
      ValueError: the memory left holds fewer than 2 blocks (message gives the bytes).
    """
    itemsize = np.dtype(dtype).itemsize
    per_token = kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, itemsize)
    common = dict(
        block_size=block_size,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=np.dtype(dtype).name,
        bytes_per_token=per_token,
        num_shards=num_shards,
    )
    if num_gpu_blocks_override is not None:
        return KVCacheSpec(num_blocks=int(num_gpu_blocks_override), source="override", **common)
    per_device = (per_token + extra_bytes_per_token) // num_shards
    devices = (
        [device] if isinstance(device, jax.Device) or not isinstance(device, Sequence) else device
    )
    mems = (
        list(device_memories)
        if device_memories is not None
        else [device_memory(d) for d in devices]
    )
    if any(m is None for m in mems):
        blocks = cpu_default_num_blocks(
            max_num_seqs, max_model_len, block_size, per_device, blocks_per_seq
        )
        return KVCacheSpec(num_blocks=blocks, source="cpu-default", **common)
    # The device with the least room decides: every device holds the same blocks.
    limit, in_use = min(mems, key=lambda m: int(gpu_memory_utilization * m[0]) - m[1])
    available = int(gpu_memory_utilization * limit) - in_use - int(peak_activation_bytes)
    logger.info(
        "KV cache budget%s: %.2f GiB = %.2f x %.2f GiB limit - %.2f GiB in use - %.2f GiB "
        "peak activations",
        f" per device (tightest of {len(devices)})" if len(devices) > 1 else "",
        available / 2**30,
        gpu_memory_utilization,
        limit / 2**30,
        in_use / 2**30,
        peak_activation_bytes / 2**30,
    )
    blocks = compute_num_gpu_blocks(available, per_device, block_size)
    return KVCacheSpec(num_blocks=blocks, source="memory", **common)


def size_kv_cache(
    config: EngineConfig,
    arch: ModelArchConfig,
    kv_layout: KVCacheLayout,
    kv_head_dim: int,
    kv_dtype,
    *,
    device: jax.Device | Sequence[jax.Device] = (),
    device_memories: Sequence[tuple[int, int] | None] | None = None,
    peak_activation_bytes: int = 0,
    num_shards: int = 1,
    extra_bytes_per_token: int = 0,
) -> KVCacheSpec:
    """The engine's KV pool for ``config`` (``determine_kv_cache_spec`` with the engine's
    arguments): the runner calls it at start-up, ``jaxserve plan`` with a device's memory, so the
    two cannot drift.

    Args:
      config: the resolved EngineConfig (block size, memory knobs, max_num_seqs,
        max_model_len, the chunk budget, speculative lookahead).
      arch: the model as placed (``num_kv_heads`` counts replicated heads).
      kv_layout: the KV-cache groups (``make_kv_cache_layout``).
      kv_head_dim: the cache's head dim (``cache_head_dim``); kv_dtype: its element dtype.
      device, device_memories, peak_activation_bytes, num_shards, extra_bytes_per_token: as
        ``determine_kv_cache_spec``.

    Raises:
      ValueError: the memory left holds fewer than 2 blocks.
    """
    cache, sched = config.cache, config.scheduler
    speculative = config.speculative
    lookahead = 0 if speculative is None else speculative.num_lookahead_tokens  # Scheduler's too
    return determine_kv_cache_spec(
        num_layers=kv_layout.num_tensors,
        num_kv_heads=arch.num_kv_heads,
        head_dim=kv_head_dim,
        dtype=kv_dtype,
        block_size=cache.block_size,
        gpu_memory_utilization=cache.gpu_memory_utilization,
        num_gpu_blocks_override=cache.num_gpu_blocks_override,
        max_num_seqs=sched.max_num_seqs,
        max_model_len=sched.max_model_len,
        blocks_per_seq=blocks_per_sequence(
            kv_layout.sliding_windows,
            sched.max_model_len,
            cache.block_size,
            sched.max_num_batched_tokens + lookahead,
        ),
        device=device,
        device_memories=device_memories,
        peak_activation_bytes=peak_activation_bytes,
        num_shards=num_shards,
        extra_bytes_per_token=extra_bytes_per_token,
    )


def min_over_processes(value: int) -> int:
    """The smallest ``value`` any process passes (a collective: every process must call it).
    Several processes on one mesh (``jaxserve.distributed``) allocate the same pool: each takes
    the smallest block count any of them can hold."""
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def allocate_kv_caches(
    spec: KVCacheSpec, device: jax.Device | jax.sharding.Sharding | None = None
) -> KVCaches:
    """Zero-filled per-layer ``(k_cache, v_cache)`` arrays, each ``spec.layer_shape`` in
    ``spec.dtype``, on ``device`` (default: the first local device) or placed with a sharding
    (tensor parallel: ``model.sharding.kv_cache_sharding``, KV heads split over the mesh)."""
    device = device or jax.local_devices()[0]
    if not isinstance(device, jax.sharding.Sharding):
        device = jax.sharding.SingleDeviceSharding(device)
    make = _zeros_maker(spec.layer_shape, jnp.dtype(spec.dtype), device)
    return [(make(), make()) for _ in range(spec.num_layers)]


@functools.cache
def _zeros_maker(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding) -> Any:
    """One jitted zero-fill per pool shape and placement, so a pool re-made (sleep mode's
    wake-up) runs the executable compiled for the first one instead of compiling again."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def kv_cache_shapes(spec: KVCacheSpec, sharding: jax.sharding.Sharding | None = None) -> KVCaches:
    """``jax.ShapeDtypeStruct`` stand-ins of the pool (placed with ``sharding``, if given), for
    lowering without allocating."""
    leaf = jax.ShapeDtypeStruct(spec.layer_shape, jnp.dtype(spec.dtype), sharding=sharding)
    return [(leaf, leaf) for _ in range(spec.num_layers)]


def log_kv_cache_spec(spec: KVCacheSpec) -> None:
    """Logs blocks, tokens and bytes per token at start-up."""
    logger.info(
        "KV cache (%s): %d blocks x %d tokens (block 0 is the null block: %d usable tokens), "
        "%d bytes/token, %.3f GiB, dtype %s%s",
        spec.source,
        spec.num_blocks,
        spec.block_size,
        spec.num_tokens,
        spec.bytes_per_token,
        spec.total_bytes / 2**30,
        spec.dtype,
        f", split over {spec.num_shards} devices ({spec.bytes_per_token_per_device} bytes/token "
        f"and {spec.total_bytes / spec.num_shards / 2**30:.3f} GiB each)"
        if spec.num_shards > 1
        else "",
    )
