"""The runner's half of KV offloading: the host copy of offloaded blocks and the copies themselves.

The KV manager decides (``jaxserve/core/kv_cache_manager.py``); each step's ``KVTransfers``
names device blocks to save into host slots and host slots to load into device blocks. Here:

* the host tier is one numpy array ``[num_host_blocks, num_layers, 2 (K, V), block_size,
  num_kv_heads, head_dim]`` of the cache dtype (``--kv-offloading-backend native``). On an
  accelerator whose device offers the ``pinned_host`` memory kind (GPU, TPU), copies are
  staged through pinned host buffers (JAX memory kinds): a save lands in a pinned buffer by
  DMA and is copied into the array when finished; a load's rows go into a pinned buffer,
  then to the device by DMA. On CPU the copies go straight between numpy and the device
  (``memory_kind=None``; the pinned path runs on CPU too, in tests). Nothing here was
  measured on a GPU;
* a save is one jitted gather of the named blocks of every layer (device -> a new device
  array), dispatched before the step's forward, whose host copy is written into the host
  array once it has landed (checked at the next ``collect`` / ``start``), so it overlaps the
  step and, under async scheduling, the step in flight; it is waited for only when a load
  reads a slot it writes (or two steps' saves are pending);
* a load is one jitted scatter of the host rows into the named blocks of every layer, with
  the KV caches donated (updated in place), dispatched after the saves and before the
  forward, so the forward reads the loaded blocks.

Block counts are padded to a power of two (padding reads and writes the null block 0, whose
contents no attention reads), so few shapes are compiled.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.bucketing import next_power_of_2

if TYPE_CHECKING:
    from jaxserve.core.kv_cache_utils import KVTransfers


def num_host_blocks(size_gib: float, block_bytes: int) -> int:
    """Host blocks that ``size_gib`` GiB hold, ``block_bytes`` bytes each (K and V of every
    layer for ``block_size`` tokens); 0 when size_gib is 0."""
    return int(size_gib * 2**30) // block_bytes


def staging_memory_kind(device) -> str | None:
    """ "pinned_host" when ``device`` is an accelerator offering that memory kind (the host
    tier's copies are then staged through pinned buffers), else None (CPU: plain numpy)."""
    if device.platform == "cpu":
        return None
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # a backend without memory kinds
        return None
    return "pinned_host" if "pinned_host" in kinds else None


@functools.partial(jax.jit)
def _gather(kv_caches, ids):
    """[n, L, 2, block_size, kv_heads, head_dim]: the blocks ``ids`` of every layer."""
    return jnp.stack([jnp.stack([k[ids], v[ids]], axis=1) for k, v in kv_caches], axis=1)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(kv_caches, ids, data):
    """kv_caches with blocks ``ids`` of every layer set from ``data`` (as _gather returns)."""
    return [
        (k.at[ids].set(data[:, i, 0]), v.at[ids].set(data[:, i, 1]))
        for i, (k, v) in enumerate(kv_caches)
    ]


def _padded(ids: list[int]) -> np.ndarray:
    """``ids`` as int32, zero-padded (the null block) to the next power of two."""
    out = np.zeros(next_power_of_2(len(ids)), np.int32)
    out[: len(ids)] = ids
    return out


@dataclasses.dataclass
class OffloadTiming:
    """Cumulative KV-offload copies (for the benchmark's copy bandwidth).

    Attributes:
      saved_blocks, loaded_blocks: blocks copied device -> host and host -> device.
      save_s, load_s: host seconds spent waiting on the save copies and building / dispatching
        the loads (the device-side load overlaps nothing here: the forward needs it).
    """

    saved_blocks: int = 0
    loaded_blocks: int = 0
    save_s: float = 0.0
    load_s: float = 0.0


class HostKVCache:
    """The host tier's storage and the per-step copies.

    Args:
      num_blocks: host slots (from :func:`num_host_blocks`).
      kv_caches: the device caches (their shapes and dtype are copied).
      memory_kind: "pinned_host" to stage the copies through pinned host buffers, or None
        (numpy straight to / from the device; :func:`staging_memory_kind` picks).
    """

    def __init__(self, num_blocks: int, kv_caches: list, memory_kind: str | None = None) -> None:
        k0 = kv_caches[0][0]
        _, block_size, heads, dim = k0.shape
        self.data = np.zeros(
            (num_blocks, len(kv_caches), 2, block_size, heads, dim), dtype=np.dtype(k0.dtype)
        )
        self.block_bytes = self.data[0].nbytes
        self.timing = OffloadTiming()
        # (host slots, device array) per step of unfinished saves, oldest first (at most 2)
        self._pending: collections.deque[tuple[np.ndarray, jax.Array]] = collections.deque()
        self.memory_kind = memory_kind
        self._sharding = None  # the gathered rows' device sharding (set by the first gather)

    def _stage_in(self, rows: np.ndarray):
        """Host rows for the scatter: numpy as is, or through a pinned buffer to the device."""
        if self.memory_kind is None:
            return rows
        pinned = jax.device_put(rows, self._sharding.with_memory_kind(self.memory_kind))
        return jax.device_put(pinned, self._sharding)

    def warmup(self, kv_caches: list, max_blocks: int) -> list:
        """Compiles the gather and scatter for every padded count up to ``max_blocks`` (copying
        the null block onto itself); returns the caches to use afterwards."""
        n = 1
        while True:
            ids = np.zeros(n, np.int32)
            gathered = _gather(kv_caches, ids)
            self._sharding = gathered.sharding
            kv_caches = _scatter(kv_caches, ids, self._stage_in(np.asarray(gathered)))
            if n >= max_blocks:
                break
            n *= 2
        jax.block_until_ready(kv_caches)
        return kv_caches

    def probe_load(self, kv_caches: list, num_blocks: int) -> tuple[list, float, float]:
        """Times the load path (host rows gathered with numpy, then the scatter) for 1 and
        ``num_blocks`` blocks, written into the null block 0 (no attention reads it); medians
        of 3 after one untimed call each. Needs the scatter compiled (``warmup``).

        Returns:
          (the caches to use afterwards, seconds per call, seconds per block): the line
          through the two timings, each at least 0.
        """
        times = []
        for n in (1, num_blocks):
            ids = np.zeros(n, np.int32)
            slots = np.arange(n) % len(self.data)
            runs = []
            if self._sharding is None:
                self._sharding = _gather(kv_caches, ids).sharding
            for _ in range(4):
                t0 = time.perf_counter()
                kv_caches = _scatter(kv_caches, ids, self._stage_in(self.data[slots]))
                jax.block_until_ready(kv_caches)
                runs.append(time.perf_counter() - t0)
            times.append(sorted(runs[1:])[1])
        per_block = max(0.0, (times[1] - times[0]) / max(num_blocks - 1, 1))
        return kv_caches, max(0.0, times[0] - per_block), per_block

    def start(self, kv_caches: list, transfers: KVTransfers) -> list:
        """Dispatches the step's saves and loads; returns the caches the forward must use.

        Earlier steps' saves are written into the host array when they have landed; they are
        waited for only when this step loads a slot one of them writes, or when two steps'
        saves are still pending (under async scheduling the previous step's saves are queued behind the
        step in flight: waiting for them would wait for that step).
        """
        self.finish(wait=False)
        if len(self._pending) > 1:
            self.finish()
        t0 = time.perf_counter()
        timing = self.timing
        if transfers.save_src:
            gathered = _gather(kv_caches, _padded(transfers.save_src))
            self._sharding = gathered.sharding
            if self.memory_kind is None:
                gathered.copy_to_host_async()  # starts the device -> host copy at once
            else:  # DMA into a pinned host buffer
                gathered = jax.device_put(
                    gathered, gathered.sharding.with_memory_kind(self.memory_kind)
                )
            self._pending.append((np.asarray(transfers.save_dst), gathered))
            timing.saved_blocks += len(transfers.save_src)
        if transfers.load_src:
            if self._pending:
                reads = set(transfers.load_src)
                if any(not reads.isdisjoint(slots.tolist()) for slots, _ in self._pending):
                    self.finish()  # a load reads a slot a pending save writes
            n = len(transfers.load_src)
            dst = _padded(transfers.load_dst)
            rows = np.zeros((len(dst), *self.data.shape[1:]), self.data.dtype)
            rows[:n] = self.data[transfers.load_src]
            if self.memory_kind is not None and self._sharding is None:
                self._sharding = _gather(kv_caches, dst[:1]).sharding
            kv_caches = _scatter(kv_caches, dst, self._stage_in(rows))
            timing.loaded_blocks += n
        timing.load_s += time.perf_counter() - t0
        return kv_caches

    def finish(self, wait: bool = True) -> None:
        """Writes the pending saves into the host array, oldest first, waiting for them; with
        ``wait`` False only those that have landed already (stopping at the first that has
        not, so a slot saved twice ends with the newer block)."""
        pending = self._pending
        t0 = time.perf_counter()
        while pending:
            slots, gathered = pending[0]
            if not wait and not gathered.is_ready():
                break
            pending.popleft()
            self.data[slots] = np.asarray(gathered)[: len(slots)]
        self.timing.save_s += time.perf_counter() - t0
