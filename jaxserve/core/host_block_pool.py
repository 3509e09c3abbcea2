"""The host tier of the KV cache: a pool of host-memory blocks keyed by block hash, with its own LRU.

The device pool (``block_pool.py``) evicts a cached block when it hands the block out again;
with offloading on, the KV manager first offers the evicted block's hash here, and the runner
copies the block's K/V to the host slot this pool picks (a *save*). A prefix lookup that misses
on the device continues here; a host hit is copied back into a fresh device block (a *load*).

Bookkeeping only: slot ids 0..num_blocks-1 name rows of the runner's host arrays; this module
never touches K/V. Invariants (checked by tests/core/test_host_block_pool.py):

* each hash maps to at most one slot and each slot holds at most one hash;
* ``len(free) + len(cached) == num_blocks``;
* a slot saved to or loaded from in the current step is *pinned* until ``end_step``: it is not
  evicted, so one step never writes a slot twice nor overwrites a slot it reads.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxserve.core.kv_cache_utils import BlockHash


class HostBlockPool:
    """``num_blocks`` host slots holding cached blocks, least recently used evicted first.

    Args:
      num_blocks: host slots (>= 1).

    Raises:
      ValueError: num_blocks < 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_host_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives slot 0 first
        # hash -> slot, least recently used first
        self.cached: OrderedDict[BlockHash, int] = OrderedDict()
        self.pinned: set[int] = set()
        self.num_evictions = 0  # interval counter, reset by the manager's make_stats

    def get_usage(self) -> float:
        """Slots holding a block / all slots, in [0, 1]."""
        return len(self.cached) / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding ``block_hash``, or None. Does not touch the LRU order."""
        return self.cached.get(block_hash)

    def load(self, block_hash: BlockHash) -> int:
        """Marks a hit on ``block_hash`` as loaded this step: most recently used, pinned.

        Raises:
          KeyError: the hash is not held.
        """
        slot = self.cached[block_hash]
        self.cached.move_to_end(block_hash)
        self.pinned.add(slot)
        return slot

    def store(self, block_hash: BlockHash) -> int | None:
        """A slot to save ``block_hash`` into, or None when nothing needs copying.

        None when the hash is already held (it becomes most recently used) or when every slot
        is pinned this step (the block is then simply dropped, as without a host tier).
        Otherwise takes a free slot, or evicts the least recently used unpinned hash.
        """
        cached = self.cached
        if block_hash in cached:
            cached.move_to_end(block_hash)
            return None
        if self.free:
            slot = self.free.pop()
        else:
            pinned = self.pinned
            victim = next((h for h, s in cached.items() if s not in pinned), None)
            if victim is None:
                return None
            slot = cached.pop(victim)
            self.num_evictions += 1
        cached[block_hash] = slot
        self.pinned.add(slot)
        return slot

    def end_step(self) -> None:
        """Unpins this step's slots (the runner has executed the step's copies in order)."""
        self.pinned.clear()

    def reset(self) -> None:
        """Forgets every held hash."""
        self.cached.clear()
        self.pinned.clear()
        self.free = list(range(self.num_blocks - 1, -1, -1))
