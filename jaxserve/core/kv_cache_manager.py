"""The paged KV-cache manager: block tables per request, prefix-cache lookups, slot allocation.

Follows vLLM V1's ``v1/core/kv_cache_manager.py``. The scheduler sees block ids only; the pool,
its free queue and the hash map stay inside. Block tables are append-only while a request
runs: the manager never rewrites a block the runner already holds.

Typical use by the scheduler::

    blocks, num_hit = kv.get_computed_blocks(req)           # admission of a waiting request
    new = kv.allocate_slots(req, n, num_hit, blocks)        # None: the pool is short
    ...
    new = kv.allocate_slots(req, 1)                         # a decode step (usually [])
    kv.free(req)                                            # finish / abort / preempt

After each allocation the manager records the request's *no-op end*: the ledger end up to which
its table needs nothing from the manager. ``get_noop_ends()`` shows them read-only, so the
scheduler skips ``allocate_slots`` for most decode steps.

KV offloading (``cache_config.num_host_blocks > 0``, prefix caching on): a host tier
(:class:`~jaxserve.core.host_block_pool.HostBlockPool`) sits behind the device pool. A cached
device block evicted to be reused is offered to it (a *save*: device block -> host slot); the
prefix lookup continues on the host after the device chain ends, and each host hit gets a fresh
device block at admission (a *load*: host slot -> device block), registered in the device cache
at once. A preempted request's freed full blocks are offered to the host tier at once
(``free(request, preempted=True)``), not only when the device evicts them; on resume it takes
what is still cached on the device, then either loads what the host tier still holds or
recomputes it, whichever the start-up cost probe says is cheaper for that many blocks
(``CacheConfig.offload_load_s_per_call`` / ``offload_load_s_per_block`` against
``offload_recompute_s_per_token``; the choice goes to the ledger and to the
``resumed_*_tokens`` counters).
``take_transfers`` hands the step's copies to the scheduler output; the runner executes all
saves, then all loads, before the step's forward (a block evicted and reloaded in one step
is saved before it is overwritten; a load never reads a slot the same step evicts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from jaxserve.core.block_pool import BlockPool
from jaxserve.core.host_block_pool import HostBlockPool
from jaxserve.core.kv_cache_utils import (
    NONE_HASH,
    BlockHash,
    KVCacheBlock,
    KVCacheStats,
    KVTransfers,
    PrefixCacheStats,
    load_beats_recompute,
    update_block_hashes,
)

if TYPE_CHECKING:
    from jaxserve.config import CacheConfig
    from jaxserve.core.request import Request


class KVCacheManager:
    """Owns the block pool and every request's block table.

    Args:
      cache_config: block_size, enable_prefix_caching, watermark (and num_gpu_blocks, used
        when the ``num_gpu_blocks`` argument is not given).
      num_gpu_blocks: total blocks on the device, null block included (>= 2); usually from
        :func:`jaxserve.core.kv_cache_utils.compute_num_gpu_blocks`.

    Raises:
      ValueError: fewer than 2 blocks.
    """

    def __init__(self, cache_config: CacheConfig, num_gpu_blocks: int | None = None) -> None:
        num_blocks = num_gpu_blocks if num_gpu_blocks is not None else cache_config.num_gpu_blocks
        self.block_size: int = cache_config.block_size
        self.enable_caching: bool = cache_config.enable_prefix_caching
        self.num_gpu_blocks: int = num_blocks
        self.block_pool = BlockPool(num_blocks, self.enable_caching)
        # Blocks kept free against newly admitted requests (vLLM V0's watermark): a new request
        # is admitted only if this many blocks stay free afterwards, so running requests can
        # keep growing without preempting each other right away.
        self.watermark_blocks = int(cache_config.watermark * (num_blocks - 1))
        self.none_hash = NONE_HASH
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> blocks of its table already registered in the prefix cache (or skipped).
        self.num_cached_block: dict[str, int] = {}
        # req_id -> its no-op end (see get_noop_ends); only requests holding blocks.
        self._noop_end: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # The host tier (KV offloading); None when off.
        num_host = getattr(cache_config, "num_host_blocks", 0)
        self.host_pool: HostBlockPool | None = None
        if num_host and self.enable_caching:
            self.host_pool = HostBlockPool(num_host)
            self.block_pool.on_evict = self._offload
        self._transfers = KVTransfers()
        # req_id -> host hashes found by its latest get_computed_blocks (consumed at admission)
        self._host_hits: dict[str, list[BlockHash]] = {}
        self._num_stored = self._num_loaded = 0  # blocks, interval counters (make_stats)
        # The resume cost model (seconds; 0 everywhere = unmeasured: a resume always loads).
        self.load_s_per_call: float = getattr(cache_config, "offload_load_s_per_call", 0.0)
        self.load_s_per_block: float = getattr(cache_config, "offload_load_s_per_block", 0.0)
        self.recompute_s_per_token: float = getattr(
            cache_config, "offload_recompute_s_per_token", 0.0
        )
        # req_id -> (loads?, host-hit tokens) of a resumed request's latest lookup
        self._resume_choice: dict[str, tuple[bool, int]] = {}
        self._resumed_loaded = self._resumed_recomputed = 0  # tokens, interval counters
        # KV events: whether a salted request's BlockStored carries its token ids (record_kv_events)
        self._salted_event_token_ids = False

    def record_kv_events(self, include_salted_token_ids: bool = False) -> BlockPool:
        """Makes the block pool record KV events (its ``take_kv_events`` hands them out).

        Args:
          include_salted_token_ids: a request with a ``cache_salt`` publishes its blocks'
            token ids too; by default its ``BlockStored`` events carry hashes and no token ids
            (the token ids are the prompt; jaxserve/kv_events.py, "Privacy").

        Returns:
          The block pool.
        """
        self.block_pool.kv_events = []
        self._salted_event_token_ids = include_salted_token_ids
        return self.block_pool

    @property
    def max_num_tokens(self) -> int:
        """Tokens the whole pool holds: ``(num_gpu_blocks - 1) * block_size``."""
        return (self.num_gpu_blocks - 1) * self.block_size

    @property
    def usage(self) -> float:
        """Used blocks / (total - 1), in [0, 1]; evictable cached blocks count as free."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue, evictable prefix-cached blocks included (null block excluded)."""
        return self.block_pool.get_num_free_blocks()

    def get_noop_ends(self) -> Mapping[str, int]:
        """Live map (read-only for callers): request id -> the largest ledger end
        (``num_computed_tokens`` + new tokens) its block table serves with no work for the
        manager (no new block, no block filling up), so ``allocate_slots`` up to it returns
        ``[]`` and changes nothing. Only requests holding blocks are in it. The map itself, not
        a view: the scheduler reads it once per running request per step."""
        return self._noop_end

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks in the request's table (0 when it holds none)."""
        return len(self.req_to_blocks.get(request_id, ()))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's tokens, in whole blocks.

        Never the whole sequence: at most ``(num_tokens - 1) // block_size`` blocks, so the last
        token is always recomputed (its logits are needed to sample). Requests asking for
        ``prompt_logprobs`` skip the cache (every prompt position must be computed). Does not
        take references; pass the result to :meth:`allocate_slots`.

        Returns:
          (hit blocks in order, hit tokens = len(blocks) * block_size).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = update_block_hashes(request, self.block_size, self.none_hash)
        max_blocks = (request.num_tokens - 1) // self.block_size
        lookup = self.block_pool.cached_block_hash_to_block.get
        hits: list[KVCacheBlock] = []
        num = min(max_blocks, len(hashes))
        for i in range(num):
            block = lookup(hashes[i])
            if block is None:
                break
            hits.append(block)
        num_hit = len(hits)
        host = self.host_pool
        if host is not None:
            # The device chain ended: the host tier may continue it (tests: host hits).
            host_hits = []
            for i in range(num_hit, num):
                if host.lookup(hashes[i]) is None:
                    break
                host_hits.append(hashes[i])
            # Each lookup decides anew (an earlier one's choice must not outlive it).
            self._resume_choice.pop(request.request_id, None)
            if host_hits and request.num_preemptions > 0:
                # A resumed request: load its host blocks only if that is the cheaper way back.
                loads = self.resume_loads(len(host_hits))
                self._resume_choice[request.request_id] = (
                    loads,
                    len(host_hits) * self.block_size,
                )
                if not loads:
                    host_hits = []
            if host_hits:
                self._host_hits[request.request_id] = host_hits
                num_hit += len(host_hits)
            else:
                self._host_hits.pop(request.request_id, None)
        return hits, num_hit * self.block_size

    def resume_loads(self, num_blocks: int) -> bool:
        """True when loading ``num_blocks`` host blocks costs no more than recomputing their
        tokens, by the start-up probe's figures (:func:`load_beats_recompute`)."""
        return load_beats_recompute(
            num_blocks,
            self.block_size,
            self.load_s_per_call,
            self.load_s_per_block,
            self.recompute_s_per_token,
        )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        new_request: bool = False,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Grows the request's block table to hold ``num_new_tokens`` more tokens.

        Layout of the request's tokens after the call::

            | computed (num_computed_tokens) | new computed (prefix hit) | new (to compute) |

        Blocks whose tokens become full are registered in the prefix cache right away (their
        K/V is written by the step that is being scheduled, before any later step reads it).

        The caller advances ``request.num_computed_tokens`` by ``num_new_computed_tokens +
        num_new_tokens`` once the call succeeds (the scheduler does so as it schedules).

        Args:
          request: the request (``num_computed_tokens`` is its current ledger).
          num_new_tokens: tokens to compute this step (> 0).
          num_new_computed_tokens: tokens of a prefix-cache hit (on admission), block-aligned.
          new_computed_blocks: the hit blocks from :meth:`get_computed_blocks`.
          new_request: apply the watermark (admission of a waiting request).
          num_lookahead_tokens: slots to hold beyond those tokens (speculative decoding: the
            draft model's own K/V writes after the step's last token); they are never
            registered in the prefix cache (vLLM's ``num_lookahead_tokens``).

        Returns:
          The newly allocated blocks (not the hit blocks), possibly empty; None if the pool
          cannot supply them (nothing is changed then). Free cached blocks count as free.

        Raises:
          ValueError: num_new_tokens <= 0.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        req_id = request.request_id
        # Fast path (decode): the table has room and no block fills up (get_noop_ends).
        if not new_computed_blocks and end + num_lookahead_tokens <= self._noop_end.get(req_id, 0):
            return []
        block_size = self.block_size
        blocks = self.req_to_blocks.get(req_id)
        if blocks is not None and not new_computed_blocks:
            # A running request grows (a decode step crossing a block boundary, a prompt chunk).
            num_new_blocks = -(-(end + num_lookahead_tokens) // block_size) - len(blocks)
            if num_new_blocks > 0:
                pool = self.block_pool
                available = pool.free_block_queue.num_free_blocks
                if new_request:
                    available -= self.watermark_blocks
                if num_new_blocks > available:
                    return None
                new_blocks = pool.get_new_blocks(num_new_blocks)
                blocks.extend(new_blocks)
            else:
                new_blocks = []  # room in the table, but a block fills up
        else:
            new_blocks = self._allocate_admission(
                request,
                blocks,
                end + num_lookahead_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                new_request,
            )
            if new_blocks is None:
                return None
            blocks = self.req_to_blocks[req_id]
        capacity = len(blocks) * block_size
        if self.enable_caching:
            num_cached = self.num_cached_block[req_id]
            if end // block_size > num_cached:
                num_cached = self._cache_blocks(request, blocks, end, num_cached)
            # Filling the first unregistered block is work for the manager: stop just before it.
            first_unregistered_end = (num_cached + 1) * block_size
            self._noop_end[req_id] = (
                capacity if capacity < first_unregistered_end else first_unregistered_end - 1
            )
        else:
            self._noop_end[req_id] = capacity
        return new_blocks

    def _allocate_admission(
        self,
        request: Request,
        blocks: list[KVCacheBlock] | None,
        end: int,
        num_new_computed_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None,
        new_request: bool,
    ) -> list[KVCacheBlock] | None:
        """allocate_slots for a request that holds no blocks yet (admission) or brings prefix-cache
        hits; ``end``: the ledger end its table must hold, lookahead slots included."""
        req_id = request.request_id
        first_allocation = blocks is None
        if first_allocation:
            blocks = []
        new_computed_blocks = new_computed_blocks or []
        # Hit tokens beyond the device hits are host hits (from get_computed_blocks).
        num_host = num_new_computed_tokens // self.block_size - len(new_computed_blocks)
        host_hits = self._host_hits.pop(req_id, []) if num_host > 0 else []
        if len(host_hits) < num_host:
            raise ValueError(
                f"request {req_id!r}: {num_host} host-hit blocks claimed, "
                f"{len(host_hits)} found by get_computed_blocks"
            )
        host_hits = host_hits[:num_host]
        num_new_blocks = -(-end // self.block_size) - len(blocks) - len(new_computed_blocks)
        # Touching free cached hits takes them out of the free queue.
        available = self.block_pool.free_block_queue.num_free_blocks - sum(
            1 for b in new_computed_blocks if b.ref_cnt == 0
        )
        if new_request:
            available -= self.watermark_blocks
        if num_new_blocks > available:
            return None

        if first_allocation:
            self.req_to_blocks[req_id] = blocks
            self.num_cached_block[req_id] = 0
            choice = self._resume_choice.pop(req_id, None)
            if choice is not None:
                loads, num_tokens = choice
                if loads:
                    self._resumed_loaded += num_tokens
                else:
                    self._resumed_recomputed += num_tokens
                request.ledger.resumed_from_host(loads, num_tokens)
            if (
                self.enable_caching
                and request.num_preemptions == 0
                and request.sampling_params.prompt_logprobs is None
            ):
                stats = self.prefix_cache_stats
                stats.requests += 1
                stats.queries += request.num_tokens
                stats.hits += num_new_computed_tokens
                stats.host_hits += len(host_hits) * self.block_size
        # Pin the host hits first: the device evictions below may save into the host tier.
        slots = [self.host_pool.load(h) for h in host_hits] if host_hits else []
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_block[req_id] = len(blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        if slots:
            cache = self.block_pool.cached_block_hash_to_block
            transfers = self._transfers
            for slot, block, block_hash in zip(slots, new_blocks, host_hits):
                transfers.load_src.append(slot)
                transfers.load_dst.append(block.block_id)
                if block_hash not in cache:  # its K/V is loaded before any step reads it
                    cache[block_hash] = block
                    block.block_hash = block_hash
            self._num_loaded += len(slots)
            self.num_cached_block[req_id] = len(blocks) + len(slots)
        blocks.extend(new_blocks)
        return new_blocks

    def _offload(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """The device pool's eviction hook: offers the evicted cached block to the host tier."""
        slot = self.host_pool.store(block_hash)
        if slot is not None:
            self._transfers.save_src.append(block.block_id)
            self._transfers.save_dst.append(slot)
            self._num_stored += 1

    def take_transfers(self) -> KVTransfers | None:
        """The copies the step being scheduled needs (saves, then loads), or None; resets them
        and unpins the host tier's slots. The scheduler calls it once per ``schedule``."""
        if self.host_pool is None:
            return None
        self.host_pool.end_step()
        transfers = self._transfers
        if not transfers.save_src and not transfers.load_src:
            return None
        self._transfers = KVTransfers()
        return transfers

    def _cache_blocks(
        self, request: Request, blocks: list[KVCacheBlock], end: int, num_cached: int
    ) -> int:
        """Registers the blocks that ``end`` fills (of the request's known tokens) in the prefix
        cache; returns the request's new count of registered blocks."""
        block_size = self.block_size
        num_tokens = len(request.all_token_ids)
        num_full = (end if end < num_tokens else num_tokens) // block_size
        if num_full <= num_cached:
            return num_cached
        hashes = update_block_hashes(request, block_size, self.none_hash)
        token_ids = request.all_token_ids  # read only while recording KV events
        if request.cache_salt and not self._salted_event_token_ids:
            token_ids = None  # a salted request's BlockStored: hashes, no token ids
        self.block_pool.cache_full_blocks(
            blocks, hashes, num_cached, num_full, token_ids, block_size
        )
        self.num_cached_block[request.request_id] = num_full
        return num_full

    def free(self, request: Request, preempted: bool = False) -> None:
        """Releases the request's blocks, last block first (so its prefix is evicted last).

        Cached blocks keep their hash in the free queue and can still be hit. First, blocks
        that ``num_computed_tokens`` fills but that were not registered yet are registered:
        under async scheduling a block completed by a token still in flight when it was
        scheduled cannot be hashed then, and a request that ends on the next token would
        otherwise take that block (and the chain after it) out of the prefix cache. With
        ``preempted`` and offloading on, each cached block this frees (no other request holds
        it) is also saved to the host tier now, last block first (so its prefix is the host
        tier's most recently used). Idempotent.
        """
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks and self.enable_caching:
            num_cached = self.num_cached_block[req_id]
            if request.num_computed_tokens // self.block_size > num_cached:
                self._cache_blocks(request, blocks, request.num_computed_tokens, num_cached)
        self.req_to_blocks.pop(req_id, None)
        self.num_cached_block.pop(req_id, None)
        self._host_hits.pop(req_id, None)
        self._noop_end.pop(req_id, None)
        self._resume_choice.pop(req_id, None)
        if blocks:
            if preempted and self.host_pool is not None:
                cache = self.block_pool.cached_block_hash_to_block
                for block in reversed(blocks):
                    block_hash = block.block_hash
                    if (
                        block.ref_cnt == 1
                        and block_hash is not None
                        and cache.get(block_hash) is block
                    ):
                        self._offload(block, block_hash)
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (empty when it holds none)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached prefixes (both tiers); False (no-op) while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.host_pool is not None:
            self.host_pool.reset()
            self._host_hits.clear()
        return True

    def make_stats(self) -> KVCacheStats:
        """Usage now plus prefix-cache and eviction counters since the previous call (resets them)."""
        stats = KVCacheStats(
            usage=self.usage,
            prefix_cache=self.prefix_cache_stats,
            num_evictions=self.block_pool.num_evictions,
            host_usage=self.host_pool.get_usage() if self.host_pool is not None else 0.0,
            offload_stored_tokens=self._num_stored * self.block_size,
            offload_loaded_tokens=self._num_loaded * self.block_size,
            resumed_loaded_tokens=self._resumed_loaded,
            resumed_recomputed_tokens=self._resumed_recomputed,
        )
        self._num_stored = self._num_loaded = 0
        self._resumed_loaded = self._resumed_recomputed = 0
        self.prefix_cache_stats = PrefixCacheStats()
        self.block_pool.num_evictions = 0
        return stats
