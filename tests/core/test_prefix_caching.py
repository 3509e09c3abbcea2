"""KV-cache manager: slot allocation, prefix caching, lazy eviction order, salts, stats.

Exact block ids and free-queue order, in the manner of vLLM's tests/v1/core/test_prefix_caching.py.
Block size 16; the pool's blocks are 1..N-1 (block 0 is the null block).
"""

import pytest

from jaxserve.config import CacheConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request
from jaxserve.sampling_params import SamplingParams

B = 16


def manager(num_blocks=11, caching=True, watermark=0.0):
    return KVCacheManager(
        CacheConfig(block_size=B, enable_prefix_caching=caching, watermark=watermark), num_blocks
    )


def req(req_id, prompt, salt=None, **sp):
    return Request(
        req_id, prompt, SamplingParams(max_tokens=64, **sp), eos_token_id=None, cache_salt=salt
    )


def free_ids(kv):
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def schedule(kv, r, num_new=None):
    """Admission as the scheduler does it: look up, allocate, advance the ledger."""
    hits, num_hit = kv.get_computed_blocks(r)
    n = r.num_tokens - num_hit if num_new is None else num_new
    new = kv.allocate_slots(r, n, num_hit, hits, new_request=True)
    assert new is not None
    r.num_computed_tokens = num_hit + n
    device_hits = [b.block_id for b in hits[0] if not isinstance(b, bytes)]  # not host hits
    return device_hits, [b.block_id for b in new[0]] if new else []


def decode(kv, r, token):
    """One decode step: the last sampled ``token`` is appended, then gets its slot (computed)."""
    r.append_output_token_ids(token)
    new = kv.allocate_slots(r, r.num_tokens - r.num_computed_tokens)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    return [b.block_id for b in new[0]] if new else []


def test_allocate_grow_and_free_order():
    kv = manager()
    r = req("a", list(range(40)))  # 2 full blocks + 8 tokens
    hits, new = schedule(kv, r)
    assert hits == [] and new == [1, 2, 3]
    assert kv.get_block_ids("a") == ([1, 2, 3],)
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 10]
    assert kv.usage == pytest.approx(0.3)
    for t in range(8):  # positions 40..47 fit in block 3
        assert decode(kv, r, 1000 + t) == []
    assert decode(kv, r, 2000) == [4]  # position 48 opens block 4
    assert kv.get_block_ids("a") == ([1, 2, 3, 4],)
    kv.free(r)
    assert free_ids(kv) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]  # last block first: prefix evicted last
    assert kv.usage == 0.0 and kv.get_block_ids("a") == ([],)
    kv.free(r)  # idempotent
    assert kv.num_free_blocks == 10


def test_prefix_sharing_and_ref_counts():
    kv = manager()
    common = list(range(32))
    a = req("a", common + [100, 101, 102])
    assert schedule(kv, a) == ([], [1, 2, 3])
    b = req("b", common + [200, 201])
    hits, new = schedule(kv, b)
    assert hits == [1, 2] and new == [4]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert free_ids(kv) == [5, 6, 7, 8, 9, 10]
    kv.free(a)  # blocks 1, 2 still held by b
    assert free_ids(kv) == [5, 6, 7, 8, 9, 10, 3]
    kv.free(b)
    assert free_ids(kv) == [5, 6, 7, 8, 9, 10, 3, 4, 2, 1]


def test_hit_on_free_cached_blocks_and_lazy_eviction_order():
    kv = manager()
    a = req("a", list(range(48)) + [7])  # 3 full blocks + 1
    schedule(kv, a)
    kv.free(a)
    assert free_ids(kv) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    # A newcomer of 6 uncached blocks takes the front: 5..10; cached 3, 2, 1 survive.
    c = req("c", list(range(1000, 1096)))
    assert schedule(kv, c) == ([], [5, 6, 7, 8, 9, 10])
    assert kv.block_pool.num_evictions == 0
    # A hit on free cached blocks takes them out of the middle of the queue.
    d = req("d", list(range(32)) + [9, 9, 9])
    assert schedule(kv, d) == ([1, 2], [4])  # block 4 was never cached: no eviction
    assert free_ids(kv) == [3]
    assert kv.block_pool.num_evictions == 0
    e = req("e", [5] * 10)
    assert schedule(kv, e) == ([], [3])  # evicts a's third block
    assert kv.block_pool.num_evictions == 1
    f = req("f", list(range(48)) + [7])
    assert kv.get_computed_blocks(f)[1] == 32  # blocks 1 and 2 still hit, block 3 is gone


def test_full_prompt_hit_recomputes_last_token():
    kv = manager()
    prompt = list(range(48))  # exactly 3 blocks
    a = req("a", prompt)
    schedule(kv, a)
    kv.free(a)
    b = req("b", prompt)
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 32 and [x.block_id for x in blocks[0]] == [1, 2]  # never the whole prompt
    assert schedule(kv, b) == ([1, 2], [4])
    assert b.num_computed_tokens == 48


@pytest.mark.parametrize("k", [1, 2, 4])
def test_k_block_prompt_three_times_then_extended(k):
    kv = manager(num_blocks=2 * k + 4)
    prompt = [t % 97 for t in range(k * B)]
    hits = []
    for i in range(3):
        r = req(f"r{i}", prompt)
        hit_ids, _ = schedule(kv, r)
        hits.append(len(hit_ids) * B)
        decode(kv, r, 5)  # one generated token, then done
        kv.free(r)
    ext = req("ext", prompt + list(range(500, 500 + B)))
    hit_ids, _ = schedule(kv, ext)
    assert hits[0] == 0 and all(h >= (k - 1) * B for h in hits[1:])
    assert len(hit_ids) * B == k * B
    kv.free(ext)
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.usage == 0.0


def test_full_hit_last_block_case():
    """Shared case: a 4*B prompt three times, then plus B tokens; nothing referenced afterwards."""
    kv = manager(num_blocks=12)
    prompt = [(7 * t) % 101 for t in range(4 * B)]
    hits = []
    for i in range(3):
        r = req(f"r{i}", prompt)
        hits.append(schedule(kv, r))
        kv.free(r)
    assert hits[0] == ([], [1, 2, 3, 4])
    assert hits[1][0] == [1, 2, 3] and hits[2][0] == [1, 2, 3]  # >= 3*B, last block recomputed
    ext = req("ext", prompt + list(range(B)))
    hit_ids, new = schedule(kv, ext)
    assert hit_ids == [1, 2, 3, 4] and len(new) == 1  # 4*B: the original 4th block survived
    kv.free(ext)
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks) and kv.usage == 0.0


def test_generated_tokens_are_cached():
    kv = manager()
    a = req("a", list(range(20)))
    schedule(kv, a)
    out = list(range(300, 313))
    for t in out:
        decode(kv, a, t)
    # tokens 0..32 known; positions 0..31 computed: 2 full blocks cached, the 2nd half generated.
    assert len(a.block_hashes) >= 2
    b = req("b", list(range(20)) + out[:12] + [1, 2, 3])
    assert kv.get_computed_blocks(b)[1] == 32


def test_salted_requests_do_not_share():
    kv = manager()
    prompt = list(range(40))
    schedule(kv, req("a", prompt, salt="tenant-1"))
    assert kv.get_computed_blocks(req("b", prompt, salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(req("c", prompt))[1] == 0
    assert kv.get_computed_blocks(req("d", prompt, salt="tenant-1"))[1] == 32
    schedule(kv, req("e", prompt))
    assert kv.get_computed_blocks(req("f", prompt))[1] == 32
    assert kv.get_computed_blocks(req("g", prompt, salt="tenant-2"))[1] == 0


def test_allocation_failure_changes_nothing():
    kv = manager(num_blocks=5)  # 4 usable
    a = req("a", list(range(40)))
    schedule(kv, a)  # 3 blocks
    b = req("b", list(range(32)) + [1] * 20)  # hits 2 blocks (in use), needs 2 more: only 1 free
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 32
    before = ([x.ref_cnt for x in kv.block_pool.blocks], free_ids(kv))
    assert kv.allocate_slots(b, 20, num_hit, hits) is None
    assert ([x.ref_cnt for x in kv.block_pool.blocks], free_ids(kv)) == before
    assert kv.get_block_ids("b") == ([],)
    assert kv.allocate_slots(b, 16, num_hit, hits) is not None  # one block fits


def test_evictable_hits_are_not_counted_twice():
    kv = manager(num_blocks=5)  # 4 usable
    a = req("a", list(range(48)) + [1])
    schedule(kv, a)  # 4 blocks
    kv.free(a)
    # 3 cached free blocks hit; they leave the free queue, so only 1 block is left for new tokens.
    b = req("b", list(range(48)) + [2] * 30)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 48
    assert kv.allocate_slots(b, 30, num_hit, hits) is None
    assert kv.allocate_slots(b, 16, num_hit, hits) is not None
    assert kv.num_free_blocks == 0


def test_watermark_applies_to_new_requests_only():
    kv = manager(num_blocks=11, watermark=0.2)  # keeps 2 of 10 blocks free against admissions
    assert kv.watermark_blocks == 2
    a = req("a", list(range(128)))
    assert kv.allocate_slots(a, 128, new_request=True) is not None  # 8 blocks, 2 left
    b = req("b", [1])
    assert kv.allocate_slots(b, 1, new_request=True) is None
    a.num_computed_tokens = 128
    a.append_output_token_ids(5)
    assert kv.allocate_slots(a, 1) is not None  # a running request may dig into the watermark


def test_prefix_stats_count_first_admission_only():
    kv = manager()
    schedule(kv, req("a", list(range(40))))
    b = req("b", list(range(40)))
    schedule(kv, b)
    stats = kv.make_stats()
    assert (stats.prefix_cache.requests, stats.prefix_cache.queries, stats.prefix_cache.hits) == (
        2,
        80,
        32,
    )
    assert stats.usage == pytest.approx(0.4)
    # Preempted and resumed: the recompute is neither a query nor a hit.
    kv.free(b)
    b.num_computed_tokens = 0
    b.num_preemptions = 1
    schedule(kv, b)
    stats = kv.make_stats()
    assert (stats.prefix_cache.requests, stats.prefix_cache.queries, stats.prefix_cache.hits) == (
        0,
        0,
        0,
    )
    assert stats.num_evictions == 0


def test_caching_disabled():
    kv = manager(caching=False)
    a = req("a", list(range(40)))
    schedule(kv, a)
    kv.free(a)
    b = req("b", list(range(40)))
    assert kv.get_computed_blocks(b)[1] == 0
    assert b.block_hashes == [] and a.block_hashes == []  # nothing hashed at all
    assert not any(kv.block_pool.cached_blocks)


def test_prompt_logprobs_requests_skip_the_cache():
    kv = manager()
    schedule(kv, req("a", list(range(40))))
    assert kv.get_computed_blocks(req("b", list(range(40)), prompt_logprobs=1))[1] == 0


def test_bad_arguments():
    kv = manager()
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate_slots(req("a", [1]), 0)
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        manager(num_blocks=1)
