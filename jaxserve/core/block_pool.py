"""The pool of KV blocks: ref counts, the LRU free queue, and the prefix-cache map.

Follows vLLM V1's ``v1/core/block_pool.py``. Invariants (checked by tests):

* block 0 is the null block, never in the free queue and never handed out;
* a block is in the free queue iff its ref count is 0, so ``free + used = num_blocks - 1``;
* a cached block keeps its hash while it sits in the free queue (lazy eviction); the hash is
  dropped only when the block is handed out again, and a hit on a free cached block takes it
  out of the queue (``touch``);
* each hash maps to at most one block per KV-cache group (one prefix-cache map per group:
  the groups hold different layers' K/V for the same tokens, ``kv_cache_groups.py``). When two
  requests compute the same block at the same time, the first one to fill it caches it; the
  other's copy stays uncached and is freed like any uncached block;
* the null block is never touched, freed or cached: a sliding-window group's table holds it in
  place of the blocks that fell out of the window.

KV events (the one hook): while ``kv_events`` is a list, the pool appends a ``BlockStored`` for
each run of blocks it registers, a ``BlockRemoved`` for the hashes it evicts and an
``AllBlocksCleared`` on a reset; the owner takes them (``take_kv_events``) after each step and
publishes them (jaxserve/kv_events.py); with several groups each event names its group. None
(the default) records nothing and costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from jaxserve.core.kv_cache_utils import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    KVEvent,
)


class BlockPool:
    """Fixed set of ``num_blocks`` KV blocks.

    Args:
      num_blocks: total blocks on the device, the null block included (>= 2).
      enable_caching: keep a hash -> block map for prefix caching.
      num_groups: KV-cache groups sharing the pool (one hash -> block map each).

    Raises:
      ValueError: num_blocks < 2.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, num_groups: int = 1) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2 (null block + 1), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # Per KV-cache group: hash -> the block caching it (a block's ``group`` names its map).
        self.cached_blocks: list[dict[BlockHash, KVCacheBlock]] = [{} for _ in range(num_groups)]
        # Whether events name their group (several groups: vLLM's ``group_idx``).
        self._event_groups = num_groups > 1
        self.num_evictions = 0  # interval counter, reset by the manager's make_stats
        self.kv_events: list[KVEvent] | None = None  # set to [] to record (module docstring)
        # Called as on_evict(block, hash) for each cached block evicted by get_new_blocks, before
        # it is handed out (the KV manager's offload to the host tier); None: nothing is called.
        self.on_evict: Callable[[KVCacheBlock, BlockHash], None] | None = None

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (evictable cached blocks included)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Used blocks / usable blocks (``num_blocks - 1``), in [0, 1]."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        """The block of KV-cache group ``group`` cached under ``block_hash``, whether in use or
        free; None on a miss."""
        return self.cached_blocks[group].get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes ``num_blocks`` blocks from the front of the free queue, ref count 1 each.

        A block that still carries a hash is evicted from the prefix cache here.

        Raises:
          ValueError: fewer than ``num_blocks`` blocks are free.
        """
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, {queue.num_free_blocks} free")
        blocks = [queue.popleft()] if num_blocks == 1 else queue.popleft_n(num_blocks)
        caches = self.cached_blocks
        removed: list | None = [] if self.kv_events is not None else None
        for block in blocks:
            if block.block_hash is not None:
                cache = caches[block.group]
                if cache.get(block.block_hash) is block:
                    del cache[block.block_hash]
                    if removed is not None:
                        removed.append((block.group, block.block_hash))
                    if self.on_evict is not None:
                        self.on_evict(block, block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
        if removed:
            self._record_removed(removed)
        return blocks

    def _record_removed(self, removed: list[tuple[int, BlockHash]]) -> None:
        """One ``BlockRemoved`` per group among the evicted ``(group, hash)`` pairs."""
        if not self._event_groups:
            self.kv_events.append(BlockRemoved([h for _, h in removed]))
            return
        by_group: dict[int, list[BlockHash]] = {}
        for group, block_hash in removed:
            by_group.setdefault(group, []).append(block_hash)
        for group, hashes in by_group.items():
            self.kv_events.append(BlockRemoved(hashes, group))

    def take_kv_events(self) -> list[KVEvent]:
        """The events recorded since the previous call (empty when not recording)."""
        events = self.kv_events
        if not events:
            return []
        self.kv_events = []
        return events

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds a reference to each block (prefix-cache hits), taking free ones out of the queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block (the null block is skipped); blocks reaching 0
        join the free queue's tail in the given order (so pass them in eviction order: a
        request's last block first).
        """
        freed = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
            else:
                assert block.ref_cnt > 0, block
        self.free_block_queue.append_n(freed)

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: list[int] | None = None,
        block_size: int = 0,
        group: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """Registers ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes in the
        prefix cache of KV-cache group ``group`` (null blocks, which a sliding window left
        behind, are skipped).

        Args:
          blocks: the request's block table (of that group).
          block_hashes: the request's block hashes (at least ``num_full_blocks`` of them).
          num_cached_blocks: blocks of the table already handled by an earlier call.
          num_full_blocks: blocks of the table that are now full.
          token_ids, block_size: the request's tokens and the block size, read only while
            recording KV events (for ``BlockStored.token_ids``).
          group: the KV-cache group of the table.
          lora_name: the request's LoRA adapter (``BlockStored.lora_name``), None for none.
        """
        cache = self.cached_blocks[group]
        stored = [] if self.kv_events is not None else None
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:  # a hit (cached already) or gone
                continue
            block_hash = block_hashes[i]
            if block_hash not in cache:
                cache[block_hash] = block
                block.block_hash = block_hash
                block.group = group
                if stored is not None:
                    stored.append(i)
        if stored:
            # One event per run of consecutive blocks, so each names its true parent.
            start = prev = stored[0]
            for i in [*stored[1:], -1]:
                if i != prev + 1:
                    self.kv_events.append(
                        BlockStored(
                            block_hashes[start : prev + 1],
                            block_hashes[start - 1] if start else None,
                            list(token_ids[start * block_size : (prev + 1) * block_size])
                            if token_ids is not None
                            else [],
                            group if self._event_groups else None,
                            lora_name,
                        )
                    )
                    start = i
                prev = i

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash. Only allowed when no block is in use.

        Returns:
          False (and does nothing) if some block is still referenced.
        """
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        for cache in self.cached_blocks:
            cache.clear()
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return True
