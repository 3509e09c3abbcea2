"""The paged KV-cache manager: block tables per request, prefix-cache lookups, slot allocation.

Follows vLLM V1's ``v1/core/kv_cache_manager.py`` and, for models with sliding-window layers,
its hybrid KV-cache manager (``kv_cache_coordinator.py``, ``single_type_kv_cache_manager.py``).
The scheduler sees block ids only; the pool, its free queue and the hash maps stay inside.

KV-cache groups (``jaxserve/core/kv_cache_groups.py``; ``CacheConfig.kv_cache_groups`` gives
each group's sliding window, None for full attention): a request holds one block table per
group, all drawn from one pool and all covering the same token positions. A full-attention
group keeps every block until the request ends. A sliding-window group (window W) keeps only
the blocks a future token can still read: whenever a request's tables grow, the blocks wholly
before position ``num_computed_tokens - W + 1`` are first replaced with the null block and
freed (vLLM's ``remove_skipped_blocks``, which runs at every ``allocate_slots``; here only when
the tables grow, so a step frees the same blocks whether or not the scheduler's no-op fast path
skipped the calls in between, and the peak is the same: it comes right after a new block). A
decoding request so holds at most ``ceil((W - 1) / block_size) + 1`` blocks of that group (the
window and the partial block). Tables are otherwise append-only while a request runs; the
runner's copy keeps the freed ids, which no attention reads unmasked (they lie outside every
query's window) while another request may rewrite them.

Typical use by the scheduler::

    blocks, num_hit = kv.get_computed_blocks(req)           # admission of a waiting request
    new = kv.allocate_slots(req, n, num_hit, blocks)        # None: the pool is short
    ...
    new = kv.allocate_slots(req, 1)                         # a decode step (usually ())
    kv.free(req)                                            # finish / abort / preempt

After each allocation the manager records the request's *no-op end*: the ledger end up to which
its table needs nothing from the manager. ``get_noop_ends()`` shows them read-only, so the
scheduler skips ``allocate_slots`` for most decode steps.

Prefix caching stays exact with groups. A hit of ``h`` tokens (whole blocks) is usable only if
every group can serve the first recomputed token, at position ``h``: a full-attention group
needs its blocks for all of ``[0, h)``, a sliding group only the ``ceil((W - 1) / block_size)``
blocks before ``h`` (the rest of its hit table is null blocks). Each group's map is separate
(the groups hold different layers' K/V for the same tokens). The lookup is vLLM's fixed point
(``HybridKVCacheCoordinator.find_longest_cache_hit``): start from the longest candidate; a
full-attention group cuts it to its cached chain; a sliding group to the nearest point at or
below it with its window's blocks all cached (scanning right to left); repeat until no group
cuts. vLLM's hybrid lookup handles full attention plus one other kind; this one any number of
sliding windows (the fixed point converges for any mix: the candidate only shrinks).

KV offloading (``cache_config.num_host_blocks > 0``, prefix caching on): a host tier
(:class:`~jaxserve.core.host_block_pool.HostBlockPool`, keyed per group:
``group_block_key``) sits behind the device pool. A cached device block evicted to be reused is
offered to it (a *save*: device block -> host slot); the prefix lookup of a full-attention
group continues on the host after its device chain ends, a sliding group takes each window
block from the device or else the host, and each host hit gets a fresh device block at
admission (a *load*: host slot -> device block), registered in its group's device cache at once.
A preempted request's freed full blocks (every group's) are offered to the host tier at once
(``free(request, preempted=True)``), not only when the device evicts them; on resume it takes
what is still cached on the device, then either loads what the host tier still holds or
recomputes it, whichever the start-up cost probe says is cheaper: loading the host blocks of
every group against recomputing the tokens they add to the device-only hit
(``CacheConfig.offload_load_s_per_call`` / ``offload_load_s_per_block`` against
``offload_recompute_s_per_token``; the choice goes to the ledger and to the
``resumed_*_tokens`` counters). ``take_transfers`` hands the step's copies to the scheduler
output; the runner executes all saves, then all loads, before the step's forward (a block
evicted and reloaded in one step is saved before it is overwritten; a load never reads a slot
the same step evicts).

Counters with several groups: ``offload_stored_tokens`` / ``offload_loaded_tokens`` count
``block_size`` per block copied, whatever its group (a group's block is the K/V of its layers
only); prefix-cache hits and the host-hit tokens count token positions once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from jaxserve.core.block_pool import BlockPool
from jaxserve.core.host_block_pool import HostBlockPool
from jaxserve.core.kv_cache_groups import blocks_per_sequence, group_blocks_per_sequence
from jaxserve.core.kv_cache_utils import (
    NONE_HASH,
    BlockHash,
    KVCacheBlock,
    KVCacheStats,
    KVTransfers,
    PrefixCacheStats,
    group_block_key,
    load_beats_recompute,
    update_block_hashes,
)

if TYPE_CHECKING:
    from jaxserve.config import CacheConfig
    from jaxserve.core.request import Request

UNBOUNDED = 1 << 62
"""``max_num_tokens`` of a pool whose groups are all sliding windows that fit: no length limit."""

KVCacheBlocks = tuple[list[KVCacheBlock], ...]
"""Blocks per KV-cache group (one list per group, in group order)."""

PrefixHit = tuple[Sequence["KVCacheBlock | BlockHash"], ...]
"""Per group, the hit table ``get_computed_blocks`` found, one entry per hit block: a device
block (the null block for one a sliding window skips) or, with offloading, the block hash of a
host-tier hit that admission loads into a fresh block."""


def block_ids(blocks: KVCacheBlocks) -> tuple[list[int], ...]:
    """Block ids of ``allocate_slots``' new blocks, one list per group (what
    ``CachedRequestData.new_block_ids`` carries)."""
    if len(blocks) == 1:
        return ([b.block_id for b in blocks[0]],)
    return tuple([b.block_id for b in group] for group in blocks)


class KVCacheManager:
    """Owns the block pool and every request's block tables (one per KV-cache group).

    Args:
      cache_config: block_size, enable_prefix_caching, watermark, kv_cache_groups (each
        group's sliding window; empty: one full-attention group) and num_gpu_blocks (used when
        the ``num_gpu_blocks`` argument is not given).
      num_gpu_blocks: total blocks on the device, null block included (>= 2); usually from
        :func:`jaxserve.core.kv_cache_utils.compute_num_gpu_blocks`.
      max_num_batched_tokens: most positions one request's tables reach past its computed
        tokens in one step (the scheduler's budget, plus speculative decoding's lookahead
        slots): bounds what a sliding group holds at once (its admission need and the
        capacity check); None: no bound (a sliding group is counted for the whole sequence).

    Raises:
      ValueError: fewer than 2 blocks.
    """

    def __init__(
        self,
        cache_config: CacheConfig,
        num_gpu_blocks: int | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        num_blocks = num_gpu_blocks if num_gpu_blocks is not None else cache_config.num_gpu_blocks
        self.block_size: int = cache_config.block_size
        self.enable_caching: bool = cache_config.enable_prefix_caching
        self.num_gpu_blocks: int = num_blocks
        windows = tuple(getattr(cache_config, "kv_cache_groups", ()) or (None,))
        self.sliding_windows: tuple[int | None, ...] = windows  # per group; None: full
        self.num_groups = len(windows)
        self._sliding = tuple((g, w) for g, w in enumerate(windows) if w is not None)
        self.max_chunk_tokens = max_num_batched_tokens
        self.block_pool = BlockPool(num_blocks, self.enable_caching, self.num_groups)
        self._null = self.block_pool.null_block
        self._no_hit: PrefixHit = ((),) * self.num_groups
        # Blocks kept free against newly admitted requests (vLLM V0's watermark): a new request
        # is admitted only if this many blocks stay free afterwards, so running requests can
        # keep growing without preempting each other right away.
        self.watermark_blocks = int(cache_config.watermark * (num_blocks - 1))
        self.none_hash = NONE_HASH
        # req_id -> its block table per group (all of one length: nulls fill skipped blocks)
        self.req_to_blocks: dict[str, KVCacheBlocks] = {}
        # req_id -> blocks of its tables already registered in the prefix cache (or skipped).
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
        self._max_num_tokens = self._longest_sequence()

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

    def blocks_per_sequence(self, num_tokens: int) -> int:
        """Most pool blocks a sequence of ``num_tokens`` tokens holds at once, all groups
        together (:func:`jaxserve.core.kv_cache_groups.blocks_per_sequence`)."""
        return blocks_per_sequence(
            self.sliding_windows, num_tokens, self.block_size, self.max_chunk_tokens
        )

    def _longest_sequence(self) -> int:
        """The most tokens one sequence can have with the whole pool to itself (``UNBOUNDED``
        when every group is a window whose blocks fit)."""
        usable, bs = self.num_gpu_blocks - 1, self.block_size
        if not self._sliding:
            return usable // self.num_groups * bs
        if self.blocks_per_sequence(UNBOUNDED) <= usable:
            return UNBOUNDED  # only windows, and they fit: any length does
        # Past usable * bs tokens some group (full, or a window not yet at its bound) alone
        # would need more than the pool: the answer lies below.
        lo, hi = 0, usable * bs
        while lo < hi:  # blocks_per_sequence grows with the length
            mid = (lo + hi + 1) // 2
            if self.blocks_per_sequence(mid) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @property
    def max_num_tokens(self) -> int:
        """The longest sequence the whole pool holds, tokens: ``(num_gpu_blocks - 1) *
        block_size`` with one full-attention group; more when sliding groups recycle blocks
        (``UNBOUNDED`` when there are only sliding groups and their windows fit)."""
        return self._max_num_tokens

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
        (``num_computed_tokens`` + new tokens) its block tables serve with no work for the
        manager (no new block, no block filling up), so ``allocate_slots`` up to it returns
        ``()`` and changes nothing. Only requests holding blocks are in it. The map itself, not
        a view: the scheduler reads it once per running request per step."""
        return self._noop_end

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks the request holds, all groups together (null blocks not counted)."""
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return 0
        if not self._sliding:
            return len(tables[0]) * self.num_groups
        return sum(1 for table in tables for b in table if not b.is_null)

    def group_blocks_held(self, request_id: str) -> list[int]:
        """Blocks the request holds in each group (null blocks not counted; zeros when none)."""
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return [0] * self.num_groups
        return [sum(1 for b in table if not b.is_null) for table in tables]

    def admission_blocks(self, num_tokens: int, hit: PrefixHit) -> tuple[int, int]:
        """What admitting a waiting request of ``num_tokens`` tokens with prefix hit ``hit``
        (from :meth:`get_computed_blocks`) asks of the pool for its whole sequence.

        Returns:
          ``(need, evictable)``: blocks beyond its device hits the sequence holds at its peak
          (:meth:`blocks_per_sequence` per group, host hits included), and hit blocks that sit
          in the free queue (touching them takes them out of it).
        """
        need = evictable = 0
        bs, chunk = self.block_size, self.max_chunk_tokens
        for window, entries in zip(self.sliding_windows, hit):
            live = 0
            for e in entries:
                if e.__class__ is KVCacheBlock and not e.is_null:
                    live += 1
                    if e.ref_cnt == 0:
                        evictable += 1
            peak = group_blocks_per_sequence(window, num_tokens, bs, chunk)
            need += peak - live if peak > live else 0
        return need, evictable

    def blocks_to_grow(self, end: int, num_tokens: int) -> int:
        """Blocks a running request whose ledger stands at ``end`` still takes before it holds
        ``num_tokens`` tokens (its peak; the scheduler keeps them back from admissions)."""
        if not self._sliding:
            bs = self.block_size
            return (-(-num_tokens // bs) - -(-end // bs)) * self.num_groups
        return self.blocks_per_sequence(num_tokens) - self.blocks_per_sequence(end)

    def device_hit_tokens(self, hit: PrefixHit, num_hit: int) -> int:
        """Of a hit of ``num_hit`` tokens, the leading tokens no group loads from the host tier
        (every group's blocks for them were on the device)."""
        bs = self.block_size
        out = num_hit
        for entries in hit:
            for i, e in enumerate(entries):
                if e.__class__ is not KVCacheBlock:
                    out = min(out, i * bs)
                    break
        return out

    def get_computed_blocks(self, request: Request) -> tuple[PrefixHit, int]:
        """The longest usable cached prefix of the request's tokens, in whole blocks (module
        docstring, "Prefix caching").

        Never the whole sequence: at most ``(num_tokens - 1) // block_size`` blocks, so the last
        token is always recomputed (its logits are needed to sample). Requests asking for
        ``prompt_logprobs`` skip the cache (every prompt position must be computed). Does not
        take references; pass the result to :meth:`allocate_slots`.

        Returns:
          (per group, the hit table (``PrefixHit``), each ``num_hit // block_size`` long; hit
          tokens).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self._no_hit, 0
        bs = self.block_size
        hashes = update_block_hashes(request, bs, self.none_hash)
        num = min((request.num_tokens - 1) // bs, len(hashes))
        hit = self._longest_hit(hashes, num, False)
        if self.host_pool is None:
            return hit, len(hit[0]) * bs
        # Each lookup decides anew (an earlier one's choice must not outlive it).
        self._resume_choice.pop(request.request_id, None)
        with_host = self._longest_hit(hashes, num, True)
        extra = (len(with_host[0]) - len(hit[0])) * bs  # tokens the host tier adds
        if extra <= 0:
            return hit, len(hit[0]) * bs
        if request.num_preemptions > 0:
            # A resumed request: load its host blocks only if that is the cheaper way back.
            num_loads = sum(1 for entries in with_host for e in entries if e.__class__ is bytes)
            loads = self.resume_loads(num_loads, extra)
            self._resume_choice[request.request_id] = (loads, extra)
            if not loads:
                return hit, len(hit[0]) * bs
        return with_host, len(with_host[0]) * bs

    def _longest_hit(self, hashes: list[BlockHash], num: int, with_host: bool) -> PrefixHit:
        """The fixed point of the groups' lookups (module docstring), at most ``num`` blocks."""
        limit = num
        tables: list = [()] * self.num_groups
        while True:
            for g, window in enumerate(self.sliding_windows):
                if window is None:
                    found = self._find_full(g, hashes, limit, with_host)
                else:
                    found = self._find_sliding(g, window, hashes, limit, with_host)
                tables[g] = found
                limit = len(found)
            # A group whose hit is the candidate would find it again: done when every one is.
            if all(len(table) == limit for table in tables):
                return tuple(tables)

    def _find_full(self, g: int, hashes: list[BlockHash], limit: int, with_host: bool) -> list:
        """A full-attention group's hit: its device chain, then (``with_host``) the host
        tier's continuation of it; at most ``limit`` blocks."""
        lookup = self.block_pool.cached_blocks[g].get
        found: list = []
        for i in range(limit):
            block = lookup(hashes[i])
            if block is None:
                break
            found.append(block)
        if with_host:
            host = self.host_pool
            for i in range(len(found), limit):
                if host.lookup(group_block_key(hashes[i], g)) is None:
                    break
                found.append(hashes[i])
        return found

    def _find_sliding(
        self, g: int, window: int, hashes: list[BlockHash], limit: int, with_host: bool
    ) -> list:
        """A sliding group's hit at most ``limit`` blocks long: the nearest point whose
        ``ceil((W - 1) / block_size)`` preceding blocks are all cached (on the device, or with
        ``with_host`` in the host tier), nulls before them; a run from block 0 shorter than that
        is a hit too (nothing precedes it)."""
        need = -(-(window - 1) // self.block_size)
        if need == 0:
            return [self._null] * limit
        lookup = self.block_pool.cached_blocks[g].get
        host = self.host_pool if with_host else None
        run: list = []  # the cached blocks found, right to left
        for i in range(limit - 1, -1, -1):
            entry = lookup(hashes[i])
            if entry is None and host is not None:
                if host.lookup(group_block_key(hashes[i], g)) is not None:
                    entry = hashes[i]
            if entry is None:
                run = []
                continue
            run.append(entry)
            if len(run) == need:
                return [self._null] * i + run[::-1]
        return run[::-1]

    def resume_loads(self, num_blocks: int, num_tokens: int | None = None) -> bool:
        """True when loading ``num_blocks`` host blocks costs no more than recomputing the
        ``num_tokens`` tokens they spare (default ``num_blocks * block_size``), by the start-up
        probe's figures (:func:`load_beats_recompute`)."""
        return load_beats_recompute(
            num_blocks,
            self.block_size,
            self.load_s_per_call,
            self.load_s_per_block,
            self.recompute_s_per_token,
            num_tokens,
        )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: PrefixHit | None = None,
        new_request: bool = False,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Grows the request's block tables to hold ``num_new_tokens`` more tokens.

        Layout of the request's tokens after the call::

            | computed (num_computed_tokens) | new computed (prefix hit) | new (to compute) |

        When the tables grow, each sliding-window group first frees the blocks its window left
        behind (module docstring; done even when the call then returns None: they are not
        needed either way).
        Blocks whose tokens become full are registered in the prefix cache right away (their
        K/V is written by the step that is being scheduled, before any later step reads it).

        The caller advances ``request.num_computed_tokens`` by ``num_new_computed_tokens +
        num_new_tokens`` once the call succeeds (the scheduler does so as it schedules).

        Args:
          request: the request (``num_computed_tokens`` is its current ledger).
          num_new_tokens: tokens to compute this step (> 0).
          num_new_computed_tokens: tokens of a prefix-cache hit (on admission), block-aligned.
          new_computed_blocks: the hit from :meth:`get_computed_blocks`.
          new_request: apply the watermark (admission of a waiting request).
          num_lookahead_tokens: slots to hold beyond those tokens (speculative decoding: the
            draft model's own K/V writes after the step's last token); they are never
            registered in the prefix cache (vLLM's ``num_lookahead_tokens``).

        Returns:
          The newly allocated blocks per group (not the hit blocks; host hits' load targets
          included), or ``()`` when no group got one; None if the pool cannot supply them
          (nothing else is changed then). Free cached blocks count as free.

        Raises:
          ValueError: num_new_tokens <= 0; a hit whose tables are not ``num_new_computed_tokens
          // block_size`` long.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        req_id = request.request_id
        # Fast path (decode): the tables have room and no block fills up (get_noop_ends).
        if not num_new_computed_tokens and end + num_lookahead_tokens <= self._noop_end.get(
            req_id, 0
        ):
            return ()
        block_size = self.block_size
        tables = self.req_to_blocks.get(req_id)
        if tables is not None and not num_new_computed_tokens:
            # A running request grows (a decode step crossing a block boundary, a prompt chunk).
            # Lookahead slots in every group: all tables cover the same positions.
            first = tables[0]
            num_new_blocks = -(-(end + num_lookahead_tokens) // block_size) - len(first)
            if num_new_blocks > 0:
                if self._sliding:
                    self._remove_skipped(tables, request.num_computed_tokens)
                pool = self.block_pool
                available = pool.free_block_queue.num_free_blocks
                if new_request:
                    available -= self.watermark_blocks
                if num_new_blocks * self.num_groups > available:
                    return None
                blocks = pool.get_new_blocks(num_new_blocks)
                first.extend(blocks)
                if len(tables) == 1:
                    new_blocks = (blocks,)
                else:
                    new_blocks = (
                        blocks,
                        *(pool.get_new_blocks(num_new_blocks) for _ in tables[1:]),
                    )
                    for table, group_blocks in zip(tables[1:], new_blocks[1:]):
                        table.extend(group_blocks)
            else:
                new_blocks = ()  # room in the tables, but a block fills up
        else:
            new_blocks = self._allocate_admission(
                request,
                tables,
                end + num_lookahead_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                new_request,
            )
            if new_blocks is None:
                return None
            tables = self.req_to_blocks[req_id]
        capacity = len(tables[0]) * block_size  # every group's table has this length
        if self.enable_caching:
            num_cached = self.num_cached_block[req_id]
            if end // block_size > num_cached:
                num_cached = self._cache_blocks(request, tables, end, num_cached)
            # Filling the first unregistered block is work for the manager: stop just before it.
            first_unregistered_end = (num_cached + 1) * block_size
            self._noop_end[req_id] = (
                capacity if capacity < first_unregistered_end else first_unregistered_end - 1
            )
        else:
            self._noop_end[req_id] = capacity
        return new_blocks

    def _remove_skipped(self, tables: KVCacheBlocks, num_computed: int) -> None:
        """Frees each sliding group's blocks wholly before ``num_computed - W + 1`` (the first
        key the next query reads), putting the null block in their place (vLLM's
        ``SlidingWindowManager.remove_skipped_blocks``)."""
        null, bs = self._null, self.block_size
        for g, window in self._sliding:
            skip = (num_computed - window + 1) // bs
            if skip <= 0:
                continue
            table = tables[g]
            i = min(skip, len(table)) - 1
            removed = []
            while i >= 0 and table[i] is not null:  # earlier ones were freed by earlier calls
                removed.append(table[i])
                table[i] = null
                i -= 1
            if removed:
                self.block_pool.free_blocks(removed)

    def _allocate_admission(
        self,
        request: Request,
        tables: KVCacheBlocks | None,
        end: int,
        num_new_computed_tokens: int,
        hit: PrefixHit | None,
        new_request: bool,
    ) -> KVCacheBlocks | None:
        """allocate_slots for a request that holds no blocks yet (admission) or brings
        prefix-cache hits; ``end``: the ledger end its tables must hold, lookahead slots
        included."""
        req_id = request.request_id
        bs = self.block_size
        first_allocation = tables is None
        held = 0 if first_allocation else len(tables[0])
        num_hit = num_new_computed_tokens // bs
        if not num_hit:
            hit = self._no_hit
        elif hit is None or any(len(entries) != num_hit for entries in hit):
            raise ValueError(
                f"request {req_id!r}: {num_hit} hit blocks claimed, the hit tables have "
                f"{[len(e) for e in hit or ()]} (pass get_computed_blocks' result)"
            )
        num_tail = max(-(-end // bs) - held - num_hit, 0)
        # Per group, the hit positions that are host-tier hits (each loads into a fresh block).
        loads: list[list[int]] = []
        evictable = 0
        for entries in hit:
            host_at = []
            for i, e in enumerate(entries):
                if e.__class__ is not KVCacheBlock:
                    host_at.append(i)
                elif e.ref_cnt == 0 and not e.is_null:
                    evictable += 1  # touching it takes it out of the free queue
            loads.append(host_at)
        num_loads = sum(map(len, loads))
        available = self.block_pool.free_block_queue.num_free_blocks - evictable
        if new_request:
            available -= self.watermark_blocks
        if num_loads + num_tail * self.num_groups > available:
            return None

        if first_allocation:
            tables = tuple([] for _ in range(self.num_groups))
            self.req_to_blocks[req_id] = tables
            self.num_cached_block[req_id] = 0
            choice = self._resume_choice.pop(req_id, None)
            if choice is not None:
                loads_chosen, num_tokens = choice
                if loads_chosen:
                    self._resumed_loaded += num_tokens
                else:
                    self._resumed_recomputed += num_tokens
                request.ledger.resumed_from_host(loads_chosen, num_tokens)
            if (
                self.enable_caching
                and request.num_preemptions == 0
                and request.sampling_params.prompt_logprobs is None
            ):
                stats = self.prefix_cache_stats
                stats.requests += 1
                stats.queries += request.num_tokens
                stats.hits += num_new_computed_tokens
                if num_loads:
                    stats.host_hits += num_new_computed_tokens - self.device_hit_tokens(
                        hit, num_new_computed_tokens
                    )
        # Pin the host hits first: the device evictions below may save into the host tier.
        host = self.host_pool
        slots = [
            [host.load(group_block_key(hit[g][i], g)) for i in at] for g, at in enumerate(loads)
        ]
        pool = self.block_pool
        new_blocks = []
        for entries in hit:
            if entries:
                pool.touch([e for e in entries if e.__class__ is KVCacheBlock])
        for g, entries in enumerate(hit):
            fresh = pool.get_new_blocks(len(loads[g]) + num_tail) if loads[g] or num_tail else []
            table = tables[g]
            if loads[g]:
                row = list(entries)
                cache = pool.cached_blocks[g]
                transfers = self._transfers
                for i, slot, block in zip(loads[g], slots[g], fresh):
                    block_hash = row[i]
                    row[i] = block
                    transfers.load_src.append(slot)
                    transfers.load_dst.append(block.block_id)
                    if block_hash not in cache:  # its K/V is loaded before any step reads it
                        cache[block_hash] = block
                        block.block_hash = block_hash
                        block.group = g
                table.extend(row)
                table.extend(fresh[len(loads[g]) :])
            else:
                table.extend(entries)
                table.extend(fresh)
            new_blocks.append(fresh)
        self._num_loaded += num_loads
        if num_hit:
            self.num_cached_block[req_id] = held + num_hit
        return tuple(new_blocks) if any(new_blocks) else ()

    def _offload(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """The device pool's eviction hook: offers the evicted cached block to the host tier."""
        slot = self.host_pool.store(group_block_key(block_hash, block.group))
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
        self, request: Request, tables: KVCacheBlocks, end: int, num_cached: int
    ) -> int:
        """Registers the blocks that ``end`` fills (of the request's known tokens) in each
        group's prefix cache; returns the request's new count of registered blocks."""
        block_size = self.block_size
        num_tokens = len(request.all_token_ids)
        num_full = (end if end < num_tokens else num_tokens) // block_size
        if num_full <= num_cached:
            return num_cached
        hashes = update_block_hashes(request, block_size, self.none_hash)
        token_ids = request.all_token_ids  # read only while recording KV events
        if request.cache_salt and not self._salted_event_token_ids:
            token_ids = None  # a salted request's BlockStored: hashes, no token ids
        cache_full_blocks = self.block_pool.cache_full_blocks
        lora = request.lora_name
        if len(tables) == 1:
            cache_full_blocks(
                tables[0], hashes, num_cached, num_full, token_ids, block_size, lora_name=lora
            )
        else:
            for g, table in enumerate(tables):
                cache_full_blocks(
                    table, hashes, num_cached, num_full, token_ids, block_size, g, lora
                )
        self.num_cached_block[request.request_id] = num_full
        return num_full

    def free(self, request: Request, preempted: bool = False) -> None:
        """Releases the request's blocks, last block first (so its prefix is evicted last; with
        several groups, block position by position, the groups in order).

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
        tables = self.req_to_blocks.get(req_id)
        if tables and self.enable_caching:
            num_cached = self.num_cached_block[req_id]
            if request.num_computed_tokens // self.block_size > num_cached:
                self._cache_blocks(request, tables, request.num_computed_tokens, num_cached)
        self.req_to_blocks.pop(req_id, None)
        self.num_cached_block.pop(req_id, None)
        self._noop_end.pop(req_id, None)
        self._resume_choice.pop(req_id, None)
        if not tables:
            return
        if len(tables) == 1:
            ordered = tables[0][::-1]
        else:
            ordered = [t[i] for i in range(len(tables[0]) - 1, -1, -1) for t in tables]
        if preempted and self.host_pool is not None:
            caches = self.block_pool.cached_blocks
            for block in ordered:
                block_hash = block.block_hash
                if (
                    block.ref_cnt == 1
                    and block_hash is not None
                    and caches[block.group].get(block_hash) is block
                ):
                    self._offload(block, block_hash)
        self.block_pool.free_blocks(ordered)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block tables as block ids, one list per group (0 for a block a
        sliding window freed; empty lists when it holds none)."""
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return tuple([] for _ in range(self.num_groups))
        return tuple([b.block_id for b in table] for table in tables)

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached prefixes (both tiers); False (no-op) while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.host_pool is not None:
            self.host_pool.reset()
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
