"""KV offloading's bookkeeping: the host block pool and the KV manager's saves / loads.

Exact host slot and device block ids, like test_block_pool.py / test_prefix_caching.py. Block
size 16; device blocks 1..N-1 (0 is the null block); host slots 0..H-1.
"""

import dataclasses

import pytest

from jaxserve.config import CacheConfig
from jaxserve.core.host_block_pool import HostBlockPool
from jaxserve.core.kv_cache_manager import KVCacheManager
from tests.core.test_prefix_caching import B, free_ids, req, schedule


def offload_manager(num_blocks=5, num_host=4):
    return KVCacheManager(
        CacheConfig(block_size=B, num_host_blocks=num_host), num_gpu_blocks=num_blocks
    )


def transfers(kv):
    t = kv.take_transfers()
    return None if t is None else dataclasses.astuple(t)


def check_host_invariants(pool: HostBlockPool):
    slots = list(pool.cached.values())
    assert len(set(slots)) == len(slots)
    assert sorted(slots + pool.free) == list(range(pool.num_blocks))


# ---------------------------------------------------------------- host pool


def test_host_pool_store_lru_pin_and_reset():
    pool = HostBlockPool(3)
    assert [pool.store(h) for h in ("a", "b", "c")] == [0, 1, 2]
    assert pool.store("a") is None  # held already: touched, nothing to copy
    assert pool.get_usage() == 1.0
    assert pool.store("d") is None  # every slot pinned this step: dropped
    pool.end_step()
    assert pool.store("d") == 1  # LRU is b (a was touched)
    assert pool.lookup("b") is None and pool.lookup("d") == 1 and pool.num_evictions == 1
    assert pool.load("c") == 2  # a hit: most recently used and pinned
    assert pool.store("e") == 0  # evicts a; c and d are pinned
    assert pool.store("f") is None
    pool.end_step()
    assert list(pool.cached) == ["d", "c", "e"]
    check_host_invariants(pool)
    with pytest.raises(KeyError):
        pool.load("a")
    pool.reset()
    assert pool.get_usage() == 0.0 and pool.store("x") == 0
    check_host_invariants(pool)
    with pytest.raises(ValueError, match="num_host_blocks"):
        HostBlockPool(0)


# ---------------------------------------------------------------- manager


def test_evicted_cached_block_is_saved_then_reloaded_as_host_hit():
    kv = offload_manager()  # device blocks 1..4
    a = req("a", list(range(33)))  # 2 full blocks + 1 token -> blocks 1, 2, 3
    assert schedule(kv, a) == ([], [1, 2, 3])
    kv.free(a)
    assert transfers(kv) is None
    b = req("b", list(range(1000, 1064)))  # 4 blocks: evicts a's cached 1 and 2 (3 is uncached)
    assert schedule(kv, b) == ([], [4, 3, 2, 1])
    assert transfers(kv) == ([2, 1], [0, 1], [], [])  # saves: last block first, as evicted
    kv.free(b)  # its 4 full blocks are cached; free queue: 1, 2, 3, 4 (its last block first)
    a2 = req("a2", list(range(33)))  # same prompt as a: 2 host hits
    hits, num_hit = kv.get_computed_blocks(a2)
    assert hits == (a2.block_hashes[:2],) and num_hit == 2 * B  # both from the host tier
    assert schedule(kv, a2) == ([], [1, 2, 3])
    # Evicting b's blocks 1, 2, 3 saves two of them into free slots 2, 3; the third is dropped
    # (slots 0 and 1 are pinned: this step loads them into the first two new blocks).
    assert transfers(kv) == ([1, 2], [2, 3], [1, 0], [1, 2])
    assert kv.block_pool.get_cached_block(a2.block_hashes[0]).block_id == 1
    stats = kv.make_stats()
    assert stats.prefix_cache.hits == stats.prefix_cache.host_hits == 2 * B
    assert stats.offload_stored_tokens == 4 * B and stats.offload_loaded_tokens == 2 * B
    assert stats.host_usage == 1.0
    kv.free(a2)
    assert kv.usage == 0.0 and len(free_ids(kv)) == 4
    check_host_invariants(kv.host_pool)


def test_device_chain_then_host_chain_and_salts_never_share():
    kv = offload_manager(num_blocks=5, num_host=8)
    prompt = list(range(49))  # 3 full blocks + 1
    a = req("a", prompt)
    schedule(kv, a)  # blocks 1, 2, 3, 4
    kv.free(a)  # free order: 4, 3, 2, 1 (prefix evicted last)
    # A 2-block request evicts 4 (uncached) and 3 (a's third block) -> 3 is saved.
    c = req("c", list(range(500, 517)))
    schedule(kv, c)
    assert transfers(kv) == ([3], [0], [], [])
    a2 = req("a2", prompt)
    hits, num_hit = kv.get_computed_blocks(a2)
    assert [b.block_id for b in hits[0][:2]] == [1, 2] and num_hit == 3 * B  # device 2 + host 1
    salted = req("s", prompt, salt="other")
    assert kv.get_computed_blocks(salted)[1] == 0  # the salt is in every hash
    kv.free(c)  # free queue: 2, 1, 3, 4 -> after a2 touches its hits: 3, 4
    assert schedule(kv, a2) == ([1, 2], [3, 4])
    # c's cached first block (4) is saved; slot 0 is loaded into 3, the first new block.
    assert transfers(kv) == ([4], [1], [0], [3])
    kv.free(a2)
    kv.free(salted)
    assert kv.usage == 0.0


def test_reset_prefix_cache_clears_the_host_tier():
    kv = offload_manager()
    a = req("a", list(range(33)))
    schedule(kv, a)
    kv.free(a)
    schedule(kv, b := req("b", list(range(1000, 1064))))
    kv.take_transfers()
    kv.free(b)
    assert kv.reset_prefix_cache()
    assert kv.host_pool.get_usage() == 0.0
    assert kv.get_computed_blocks(req("a2", list(range(33))))[1] == 0


def test_offloading_is_off_by_default_and_without_prefix_caching():
    assert KVCacheManager(CacheConfig(block_size=B), 5).host_pool is None
    kv = KVCacheManager(
        CacheConfig(block_size=B, enable_prefix_caching=False, num_host_blocks=4), 5
    )
    assert kv.host_pool is None and kv.take_transfers() is None


# ---------------------------------------------------------------- preempted requests


def preempt(kv, r):
    """What the scheduler's ``_preempt`` does to the request and its blocks."""
    r.ledger.preempted(0, 0.0, r.num_computed_tokens)
    kv.free(r, preempted=True)
    r.num_computed_tokens = 0
    r.num_preemptions += 1


def test_preempted_blocks_are_saved_at_once_and_the_resume_loads_them():
    kv = offload_manager(num_blocks=5, num_host=4)  # device blocks 1..4, host slots 0..3
    a = req("a", list(range(33)))  # blocks 1, 2 full and cached, 3 holds one token
    assert schedule(kv, a) == ([], [1, 2, 3])
    c = req("c", list(range(16)) + [999])  # shares block 1 with a
    assert schedule(kv, c) == ([1], [4])
    assert transfers(kv) is None
    preempt(kv, a)
    # Saved now: block 2 (a's alone). Block 1 stays held by c; block 3 is not full.
    assert transfers(kv) == ([2], [0], [], [])
    assert free_ids(kv) == [3, 2]
    # A newcomer evicts block 2 from the device: it is on the host already, nothing to copy.
    d = req("d", list(range(2000, 2017)))
    assert schedule(kv, d) == ([], [3, 2])
    assert transfers(kv) is None
    kv.free(d)  # free queue: 2 (one token, uncached), 3 (d's cached first block)
    # The resume: block 1 from the device, block 2's tokens from host slot 0 (a load: the
    # costs are unmeasured, 0, so loading is never dearer); d's block 3 is evicted to slot 1.
    hits, num_hit = kv.get_computed_blocks(a)
    assert [b.block_id for b in hits[0][:1]] == [1] and num_hit == 2 * B
    assert schedule(kv, a) == ([1], [2, 3])
    assert transfers(kv) == ([3], [1], [0], [2])
    assert kv.get_block_ids("a") == ([1, 2, 3],)
    assert a.ledger.preemptions[-1][7:9] == ["load", B]
    stats = kv.make_stats()
    assert stats.resumed_loaded_tokens == B and stats.resumed_recomputed_tokens == 0
    assert stats.offload_loaded_tokens == B and stats.offload_stored_tokens == 2 * B
    # Preempted again: block 2 (loaded, cached under its hash) is on the host already.
    preempt(kv, a)
    assert transfers(kv) is None
    kv.free(c)
    kv.free(a)
    assert kv.usage == 0.0 and not kv._resume_choice
    check_host_invariants(kv.host_pool)
    assert sorted(kv.host_pool.cached.values()) == [0, 1]
    assert kv.reset_prefix_cache() and kv.host_pool.get_usage() == 0.0


def test_resume_recomputes_when_the_cost_model_says_loading_is_dearer():
    kv = offload_manager(num_blocks=5, num_host=4)
    # A load costs 2 ms + 0.5 ms per block; recomputing a block's 16 tokens 1.6 ms.
    kv.load_s_per_call, kv.load_s_per_block, kv.recompute_s_per_token = 2e-3, 5e-4, 1e-4
    assert not kv.resume_loads(1) and kv.resume_loads(2)  # 2.5 > 1.6 ms; 3.0 < 3.2 ms
    a = req("a", list(range(33)))
    assert schedule(kv, a) == ([], [1, 2, 3])
    c = req("c", list(range(16)) + [999])
    assert schedule(kv, c) == ([1], [4])
    transfers(kv)
    preempt(kv, a)
    assert transfers(kv) == ([2], [0], [], [])
    d = req("d", list(range(2000, 2017)))
    assert schedule(kv, d) == ([], [3, 2])  # block 2 leaves the device; slot 0 keeps it
    kv.free(d)
    # One host block to get back: recomputing it is cheaper, so it is not a hit.
    hits, num_hit = kv.get_computed_blocks(a)
    assert [b.block_id for b in hits[0]] == [1] and num_hit == B
    assert schedule(kv, a) == ([1], [2, 3])
    assert transfers(kv) == ([3], [1], [], [])  # d's block 3 is saved; nothing is loaded
    assert a.ledger.preemptions[-1][7:9] == ["recompute", B]
    stats = kv.make_stats()
    assert stats.resumed_loaded_tokens == 0 and stats.resumed_recomputed_tokens == B
    assert stats.offload_loaded_tokens == 0
    assert kv.host_pool.lookup(a.block_hashes[1]) == 0  # still held, unpinned
    assert not kv.host_pool.pinned
    kv.free(a)
    kv.free(c)
    assert kv.usage == 0.0 and not kv._resume_choice
    check_host_invariants(kv.host_pool)


def test_free_registers_a_block_completed_by_a_token_that_was_in_flight():
    # Async scheduling: the step that fills block 2 was scheduled while its last token was
    # still being sampled, so allocate_slots could not hash the block; the token lands, the
    # request ends on the next one and is freed: the block must enter the prefix cache.
    kv = offload_manager(num_blocks=5, num_host=4)
    a = req("a", list(range(31)))
    assert schedule(kv, a) == ([], [1, 2])
    a.append_output_token_ids(31)  # synchronous: position 31 is known when it is scheduled
    assert kv.allocate_slots(a, 1) == ()
    a.num_computed_tokens = 32
    assert kv.num_cached_block["a"] == 2  # block 2 registered at once
    b = req("b", list(range(31)))
    assert schedule(kv, b) == ([1], [3])
    assert kv.allocate_slots(b, 1) == ()  # position 31 in flight (placeholder)
    b.num_computed_tokens = 32
    assert kv.num_cached_block["b"] == 1
    b.append_output_token_ids(77)  # it lands; b then finishes
    kv.free(b)
    assert kv.block_pool.get_cached_block(b.block_hashes[1]).block_id == 3
    kv.free(a)
    assert kv.usage == 0.0
