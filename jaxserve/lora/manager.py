"""Which adapters exist, which are in host memory, which occupy a device slot (jax-free).

Three tiers, as vLLM's: the adapters *registered* (name -> directory; ``--lora-modules`` and
``/v1/load_lora_adapter``), a host tier of at most ``max_cpu_loras`` read and checked adapters
(LRU: one evicted from it is read from disk again when next used), and the device pool of
``max_loras`` slots (LRU among the adapters not used by the step being built; writing a slot is
the runner's ``write_slot`` callback, so this module never touches an array).

Registering reads and checks the adapter at once, so a bad one is refused before anything
changes (``LoRAAdapterError``, one line). A step may use at most ``max_loras`` distinct
adapters: the scheduler admits no request whose adapter would make more.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable

from jaxserve.lora.peft import LoRAAdapter, LoRAAdapterError, load_peft_adapter

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoRAStats:
    """Counters for the benchmark and metrics: adapter reads from disk, slot writes, and the
    seconds each took."""

    disk_loads: int = 0
    disk_seconds: float = 0.0
    slot_writes: int = 0
    slot_seconds: float = 0.0


class LoRAManager:
    """The registry, host tier and device slot table of LoRA adapters.

    Args:
      max_loras: device slots (``--max-loras``).
      max_cpu_loras: adapters kept in host memory (``--max-cpu-loras``; >= max_loras).
      max_rank: ``--max-lora-rank``.
      targets: the model's adaptable projections, module path -> ``(in, out)`` sizes.
      write_slot: ``write_slot(slot, adapter)`` puts ``adapter`` into device slot ``slot``
        (None: clears the slot). Set by the runner; None for a host-only manager (tests).
    """

    def __init__(
        self,
        max_loras: int,
        max_cpu_loras: int,
        max_rank: int,
        targets: dict[str, tuple[int, int]],
        write_slot: Callable[[int, LoRAAdapter | None], None] | None = None,
    ):
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        self.targets = targets
        self.write_slot = write_slot
        self.paths: dict[str, str] = {}  # registered adapters, in registration order
        self.host: collections.OrderedDict[str, LoRAAdapter] = collections.OrderedDict()
        self.slots: list[str | None] = [None] * max_loras
        self._slot_lru: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.stats = LoRAStats()

    def _read(self, name: str, path: str) -> LoRAAdapter:
        t0 = time.perf_counter()
        adapter = load_peft_adapter(name, path, max_rank=self.max_rank, targets=self.targets)
        self.stats.disk_loads += 1
        self.stats.disk_seconds += time.perf_counter() - t0
        return adapter

    def register(self, name: str, path: str) -> LoRAAdapter:
        """Reads, checks and registers adapter ``name`` from ``path`` (into the host tier).

        Raises:
          LoRAAdapterError: a bad adapter, or ``name`` already registered. Nothing changes.
        """
        if not isinstance(name, str) or not name:
            raise LoRAAdapterError("lora_name must be a non-empty string")
        if name in self.paths:
            raise LoRAAdapterError(f"LoRA adapter {name!r} is already loaded")
        adapter = self._read(name, path)
        self.paths[name] = path
        self._keep_on_host(adapter)
        logger.info(
            "LoRA adapter %r: rank %d, %d modules, from %s",
            name,
            adapter.rank,
            len(adapter.weights),
            path,
        )
        return adapter

    def unregister(self, name: str) -> None:
        """Forgets adapter ``name`` (host tier and device slot too).

        Raises:
          LoRAAdapterError: ``name`` is not registered.
        """
        if name not in self.paths:
            raise LoRAAdapterError(f"LoRA adapter {name!r} is not loaded")
        del self.paths[name]
        self.host.pop(name, None)
        slot = self._slot_lru.pop(name, None)
        if slot is not None:
            self.slots[slot] = None
            if self.write_slot is not None:
                self.write_slot(slot, None)

    def _keep_on_host(self, adapter: LoRAAdapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)

    def host_adapter(self, name: str) -> LoRAAdapter:
        """Adapter ``name`` from the host tier, read from disk again if it was evicted."""
        adapter = self.host.get(name)
        if adapter is None:
            adapter = self._read(name, self.paths[name])
        self._keep_on_host(adapter)
        return adapter

    def slot_of(self, name: str) -> int | None:
        """The device slot ``name`` occupies, or None."""
        return self._slot_lru.get(name)

    def activate(self, names: set[str]) -> dict[str, int]:
        """Puts every adapter of ``names`` (one step's) into a device slot, evicting the least
        recently used adapters not in ``names``; returns name -> slot.

        Raises:
          ValueError: more than ``max_loras`` names (the scheduler prevents it), or a name not
            registered.
        """
        if len(names) > self.max_loras:
            raise ValueError(f"a step uses {len(names)} adapters, over max_loras {self.max_loras}")
        for name in names:
            if name not in self.paths:
                raise ValueError(f"LoRA adapter {name!r} is not loaded")
        out = {}
        for name in sorted(names):
            slot = self._slot_lru.get(name)
            if slot is None:
                slot = self._free_slot(names)
                t0 = time.perf_counter()
                if self.write_slot is not None:
                    self.write_slot(slot, self.host_adapter(name))
                self.stats.slot_writes += 1
                self.stats.slot_seconds += time.perf_counter() - t0
                self.slots[slot] = name
                self._slot_lru[name] = slot
            self._slot_lru.move_to_end(name)
            out[name] = slot
        return out

    def forget_slots(self) -> None:
        """Marks every device slot empty (after the pools were reloaded: sleep mode level 2),
        so the next steps write their adapters again."""
        self.slots = [None] * self.max_loras
        self._slot_lru.clear()

    def _free_slot(self, keep: set[str]) -> int:
        if None in self.slots:
            return self.slots.index(None)
        victim = next(n for n in self._slot_lru if n not in keep)
        return self._slot_lru.pop(victim)


__all__ = ["LoRAAdapterError", "LoRAManager", "LoRAStats"]
