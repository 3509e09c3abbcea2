"""The block pool's KV-event hook: stored runs with their parents, evictions, resets; and the
router's hashing (``hash_token_blocks``) equal to the manager's own chain, salt included."""

from jaxserve.config import CacheConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_cache_utils import (
    NONE_HASH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    hash_token_blocks,
    none_hash_from_seed,
    update_block_hashes,
)
from jaxserve.core.request import Request
from jaxserve.sampling_params import SamplingParams

B = 16


def recording_manager(num_blocks=7):
    kv = KVCacheManager(CacheConfig(block_size=B), num_blocks)
    kv.block_pool.kv_events = []
    return kv


def admit(kv, req_id, prompt, salt=None):
    r = Request(req_id, prompt, SamplingParams(max_tokens=8), eos_token_id=None, cache_salt=salt)
    hits, num_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - num_hit, num_hit, hits, new_request=True) is not None
    r.num_computed_tokens = r.num_tokens
    return r


def test_hash_token_blocks_matches_the_managers_chain():
    prompt = list(range(100, 100 + 5 * B + 3))
    for salt in (None, "tenant-a"):
        r = Request("x", prompt, SamplingParams(max_tokens=1), eos_token_id=None, cache_salt=salt)
        assert hash_token_blocks(prompt, B, cache_salt=salt) == update_block_hashes(r, B)
    assert hash_token_blocks(prompt, B, max_blocks=2) == hash_token_blocks(prompt, B)[:2]
    assert hash_token_blocks(prompt, B, cache_salt="a") != hash_token_blocks(prompt, B)
    # A shared seed gives every process the same chain; no seed gives random starts.
    assert none_hash_from_seed("7") == none_hash_from_seed("7") != none_hash_from_seed("8")
    assert none_hash_from_seed(None) != none_hash_from_seed(None)
    assert len(NONE_HASH) == 32


def test_stored_runs_name_their_parents_and_tokens():
    kv = recording_manager()
    prompt = list(range(3 * B + 5))  # 3 full blocks
    a = admit(kv, "a", prompt)
    events = kv.block_pool.take_kv_events()
    hashes = hash_token_blocks(prompt, B)
    assert events == [BlockStored(hashes, None, prompt[: 3 * B])]
    assert kv.block_pool.take_kv_events() == []  # taken once
    # Same first 2 blocks, then different: only the new third block is stored, child of block 2.
    other = prompt[: 2 * B] + [7] * (B + 1)
    admit(kv, "b", other)
    (event,) = kv.block_pool.take_kv_events()
    assert event.block_hashes == hash_token_blocks(other, B)[2:]
    assert event.parent_block_hash == hashes[1]
    assert event.token_ids == other[2 * B : 3 * B]
    kv.free(a)


def test_eviction_and_reset_are_reported():
    kv = recording_manager(num_blocks=5)  # 4 usable blocks
    a = admit(kv, "a", list(range(2 * B + 1)))  # 3 blocks, 2 cached
    stored = kv.block_pool.take_kv_events()[0].block_hashes
    kv.free(a)
    # A new 4-block prompt takes every free block: the cached ones are evicted.
    b = admit(kv, "b", list(range(1000, 1000 + 3 * B + 1)))
    events = kv.block_pool.take_kv_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(stored)
    assert isinstance(events[-1], BlockStored)  # b's own blocks, after the evictions
    kv.free(b)
    assert kv.reset_prefix_cache()
    assert kv.block_pool.take_kv_events() == [AllBlocksCleared()]


def test_not_recording_by_default():
    kv = KVCacheManager(CacheConfig(block_size=B), 7)
    admit(kv, "a", list(range(3 * B)))
    assert kv.block_pool.kv_events is None and kv.block_pool.take_kv_events() == []


def test_salted_requests_publish_hashes_without_token_ids():
    prompt = list(range(2 * B + 1))
    for include in (False, True):
        kv = KVCacheManager(CacheConfig(block_size=B), 7)
        kv.record_kv_events(include_salted_token_ids=include)
        admit(kv, "plain", prompt)
        admit(kv, "salted", prompt, salt="tenantA")
        plain, salted = kv.block_pool.take_kv_events()
        assert plain.token_ids == prompt[: 2 * B]  # unsalted: as vLLM publishes them
        assert salted.block_hashes == hash_token_blocks(prompt, B, cache_salt="tenantA")
        assert salted.token_ids == (prompt[: 2 * B] if include else [])
