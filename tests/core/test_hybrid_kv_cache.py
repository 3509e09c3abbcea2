"""The hybrid KV cache: layer grouping, sliding-window groups that free what their window left,
exact prefix hits across groups, and the scheduler on top of it (pure Python, no jax).

Exact block ids and free-queue order, as test_prefix_caching.py. Block size 8; the manager's
groups are (full attention, sliding window of 16 tokens) unless a test says otherwise: a hit in
the sliding group needs ceil(15 / 8) = 2 blocks before the hit point, and a decoding request
holds at most 3 of its blocks (window + partial block). Group 0 takes its new blocks from the
free queue before group 1 in each call.
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.config import CacheConfig
from jaxserve.core.kv_cache_groups import (
    KVCacheGroupSpec,
    KVCacheLayout,
    blocks_per_sequence,
    make_kv_cache_layout,
)
from jaxserve.core.kv_cache_manager import UNBOUNDED, KVCacheManager
from jaxserve.core.kv_cache_utils import BlockRemoved, BlockStored
from jaxserve.core.request import Request
from jaxserve.kv_events import event_to_wire
from jaxserve.sampling_params import SamplingParams
from tests.core.core_testing import (
    FakeRunner,
    expected_tokens,
    make_request,
    make_scheduler,
    run_random_workload,
    run_until_done,
)

B = 8
W = 16  # the sliding group's window, tokens
L5G1 = [1024] * 5 + [None]  # Gemma-3-style: five local layers, then one global


# ---------------------------------------------------------------- grouping


def test_layers_are_grouped_by_kind_and_share_the_pool_arrays():
    six = make_kv_cache_layout(L5G1)
    assert six.num_tensors == 1
    assert [(g.layers, g.sliding_window) for g in six.groups] == [
        ((5,), None),
        ((0,), 1024),
        ((1,), 1024),
        ((2,), 1024),
        ((3,), 1024),
        ((4,), 1024),
    ]
    assert six.layer_kv == ((1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (0, 0))
    twelve = make_kv_cache_layout(L5G1 * 2)
    assert twelve.num_tensors == 2
    assert [g.layers for g in twelve.groups] == [(5, 11), (0, 6), (1, 7), (2, 8), (3, 9), (4, 10)]
    assert twelve.layer_kv[6] == (1, 1) and twelve.layer_kv[11] == (0, 1)
    # Gemma 3 1B: 26 layers, every sixth global: 4 global, 22 local -> 4 arrays, 6 local groups
    # (the last two with 3 layers each: their fourth array rows go unused).
    gemma = make_kv_cache_layout([None if (i + 1) % 6 == 0 else 512 for i in range(26)])
    assert gemma.num_tensors == 4 and len(gemma.groups) == 7
    assert [len(g.layers) for g in gemma.groups] == [4, 4, 4, 4, 4, 3, 3]
    # One kind: one group of every layer (a Mistral-style window keeps its own kind).
    mistral = make_kv_cache_layout([4096] * 4)
    assert mistral.groups == (KVCacheGroupSpec((0, 1, 2, 3), 4096),) and mistral.num_tensors == 4
    assert make_kv_cache_layout([None] * 3).sliding_windows == (None,)
    # Close counts pad to the larger one (vLLM's 1.5 rule): 3 full + 4 local -> 2 groups of 4.
    close = make_kv_cache_layout([None, 64, None, 64, None, 64, 64])
    assert close.num_tensors == 4 and [g.layers for g in close.groups] == [(0, 2, 4), (1, 3, 5, 6)]


def test_hybrid_off_and_long_windows_make_one_full_group():
    off = make_kv_cache_layout(L5G1, hybrid=False)
    assert off.groups == (KVCacheGroupSpec(tuple(range(6)), None),) and off.num_tensors == 6
    assert make_kv_cache_layout([4096] * 4, hybrid=False).sliding_windows == (None,)
    # A window no shorter than the longest sequence never leaves a block behind.
    assert make_kv_cache_layout(L5G1, max_model_len=1024).sliding_windows == (None,)
    assert make_kv_cache_layout(L5G1, max_model_len=1025).sliding_windows[1] == 1024
    with pytest.raises(ValueError, match="sliding windows"):
        make_kv_cache_layout([0, None])
    with pytest.raises(ValueError, match="each of the 2 layers"):
        KVCacheLayout((KVCacheGroupSpec((0,)),), 1, 2)
    with pytest.raises(ValueError, match="kv_cache_groups"):
        CacheConfig(kv_cache_groups=(None, 0))


def test_blocks_per_sequence_counts_a_window_once():
    # 32k tokens, block 16, window 1,024, chunks of at most 2,048 tokens: the global group
    # holds 2,048 blocks, each local group ceil((1023 + 2048) / 16) + 1 = 193.
    windows = make_kv_cache_layout(L5G1).sliding_windows
    assert blocks_per_sequence(windows, 32768, 16, 2048) == 2048 + 5 * 193
    assert blocks_per_sequence(windows, 32768, 16, None) == 6 * 2048  # no chunk bound
    assert blocks_per_sequence(windows, 100, 16, 2048) == 6 * 7  # short: every block
    assert blocks_per_sequence((None,), 33, 16, 8) == 3


# ---------------------------------------------------------------- the manager


def manager(num_blocks=20, groups=(None, W), caching=True, max_chunk=None):
    return KVCacheManager(
        CacheConfig(block_size=B, enable_prefix_caching=caching, kv_cache_groups=groups),
        num_blocks,
        max_chunk,
    )


def req(req_id, prompt):
    return Request(req_id, prompt, SamplingParams(max_tokens=64), eos_token_id=None)


def free_ids(kv):
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def admit(kv, r):
    """Admission as the scheduler does it; returns the per-group hit tables' ids."""
    hit, num_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - num_hit, num_hit, hit, new_request=True)
    r.num_computed_tokens = r.num_tokens
    return tuple([b.block_id for b in entries] for entries in hit), num_hit


def decode_to(kv, r, end):
    """Decodes one token at a time until ``end`` tokens are computed."""
    while r.num_computed_tokens < end:
        r.append_output_token_ids(1000 + r.num_computed_tokens)
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1


def test_window_crossing_a_block_boundary_frees_the_block_it_left():
    kv = manager()
    a = req("a", list(range(20)))  # 3 blocks per group
    assert admit(kv, a) == (([], []), 0)
    assert kv.get_block_ids("a") == ([1, 2, 3], [4, 5, 6])
    decode_to(kv, a, 24)  # positions 20..23 fit in the third block: nothing changes
    assert kv.get_block_ids("a") == ([1, 2, 3], [4, 5, 6])
    # Position 24 opens a fourth block; the query at 24 reads keys 9..24, so the sliding
    # group's first block (keys 0..7) is freed first and goes to the free queue's tail.
    decode_to(kv, a, 25)
    assert kv.get_block_ids("a") == ([1, 2, 3, 7], [0, 5, 6, 8])
    assert free_ids(kv)[-1] == 4 and kv.group_blocks_held("a") == [4, 3]
    decode_to(kv, a, 33)  # position 32: keys 17..32; block 5 (keys 8..15) goes
    assert kv.get_block_ids("a") == ([1, 2, 3, 7, 9], [0, 0, 6, 8, 10])
    assert free_ids(kv) == [11, 12, 13, 14, 15, 16, 17, 18, 19, 4, 5]
    decode_to(kv, a, 80)  # the sliding group never holds more than window + partial block
    assert kv.group_blocks_held("a") == [10, 3] and kv.num_blocks_held("a") == 13
    kv.free(a)
    assert kv.usage == 0.0 and kv.num_free_blocks == 19 and kv.req_to_blocks == {}


def test_prefix_hits_need_the_full_chain_and_the_window_before_the_hit():
    kv = manager()
    a = req("a", list(range(20)))
    admit(kv, a)
    decode_to(kv, a, 33)  # tables ([1, 2, 3, 7, 9], [0, 0, 6, 8, 10]) as above
    tokens = list(a.all_token_ids[:32])
    kv.free(a)
    # Last block first, position by position, group 0 before group 1: 9, 10, 7, 8, 3, 6, 2, 1.
    assert free_ids(kv) == [11, 12, 13, 14, 15, 16, 17, 18, 19, 4, 5, 9, 10, 7, 8, 3, 6, 2, 1]
    # Same 32 tokens and more: the full group hits blocks 1, 2, 3, 7; the sliding group needs
    # only the 2 blocks before position 32 (6, 8), its first two are nulls (4 and 5 were freed
    # by the window and are still cached, but a hit at 32 does not need them).
    b = req("b", tokens + [7] * 6)
    assert admit(kv, b) == (([1, 2, 3, 7], [0, 0, 6, 8]), 32)
    assert kv.get_block_ids("b") == ([1, 2, 3, 7, 11], [0, 0, 6, 8, 12])
    kv.free(b)
    assert free_ids(kv) == [13, 14, 15, 16, 17, 18, 19, 4, 5, 9, 10, 11, 12, 7, 8, 3, 6, 2, 1]
    # A newcomer takes 12 blocks from the front (group 0: 13..18; group 1: 19, 4, 5, 9, 10,
    # 11): of the cached ones, the sliding group's 4 and 5 leave the cache.
    c = req("c", list(range(500, 548)))
    admit(kv, c)
    assert kv.get_block_ids("c") == ([13, 14, 15, 16, 17, 18], [19, 4, 5, 9, 10, 11])
    assert kv.block_pool.get_cached_block(a.block_hashes[0], 1) is None
    assert kv.block_pool.get_cached_block(a.block_hashes[0], 0).block_id == 1
    # The first 16 tokens again: the full group still holds blocks 1 and 2, but the sliding
    # group's window before position 16 was blocks 4 and 5: the hit is cut to 0.
    d = req("d", tokens[:16] + [9] * 10)
    assert kv.get_computed_blocks(d)[1] == 0
    # 32 tokens again: the window before 32 (blocks 6, 8) survived: the hit stays whole.
    e = req("e", tokens + [5])
    hit, num_hit = kv.get_computed_blocks(e)
    assert num_hit == 32 and [b.block_id for b in hit[1]] == [0, 0, 6, 8]
    kv.free(c)
    assert kv.usage == 0.0


def test_fixed_point_cuts_the_hit_to_where_every_group_can_serve_it():
    kv = manager(num_blocks=16)
    tokens = list(range(100, 148))
    p = req("p", tokens[:18])  # ([1, 2, 3], [4, 5, 6]); blocks 0 and 1 of each group cached
    admit(kv, p)
    kv.free(p)
    assert free_ids(kv) == [7, 8, 9, 10, 11, 12, 13, 14, 15, 3, 6, 2, 5, 1, 4]
    q = req("q", tokens[:32] + [999])  # hits p's two blocks in both groups
    assert admit(kv, q) == (([1, 2], [4, 5]), 16)
    assert kv.get_block_ids("q") == ([1, 2, 7, 8, 9], [4, 5, 10, 11, 12])
    # Position 40 opens a block: the window frees q's sliding blocks 0..2, the later first
    # (10, 5, 4 join the free queue in that order), then each group takes one new block.
    decode_to(kv, q, 41)
    assert kv.get_block_ids("q") == ([1, 2, 7, 8, 9, 13], [0, 0, 0, 11, 12, 14])
    assert free_ids(kv) == [15, 3, 6, 10, 5, 4]
    c = req("c", list(range(600, 610)))  # 2 blocks each: 15, 3 and 6, 10: evicts block 10
    admit(kv, c)
    assert kv.block_pool.get_cached_block(q.block_hashes[2], 1) is None
    # 32 tokens of q's again: the full group holds blocks 0..3 (1, 2, 7, 8), but the sliding
    # group lacks block 2 for a hit at 4 blocks (it needs 2 and 3) or 3 blocks (1 and 2); at
    # 2 blocks it has 0 and 1 (4, 5, still cached): the full group agrees, the hit is 16 tokens.
    b = req("b", tokens[:32] + [1])
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 16
    assert [[x.block_id for x in entries] for entries in hit] == [[1, 2], [4, 5]]
    kv.free(q)
    kv.free(c)
    assert kv.usage == 0.0


def test_a_sliding_groups_freed_block_is_reused_by_another_request():
    kv = manager(num_blocks=12)
    a = req("a", list(range(20)))
    admit(kv, a)  # ([1, 2, 3], [4, 5, 6]); free 7..11
    decode_to(kv, a, 25)  # position 24: block 4 leaves the window, then 7 and 8 are taken
    assert kv.get_block_ids("a") == ([1, 2, 3, 7], [0, 5, 6, 8])
    assert free_ids(kv) == [9, 10, 11, 4]
    s = req("s", list(range(100, 110)))  # 2 blocks per group: group 1 gets a's old block 4
    admit(kv, s)
    assert kv.get_block_ids("s") == ([9, 10], [11, 4]) and free_ids(kv) == []
    assert kv.block_pool.get_cached_block(a.block_hashes[0], 1) is None  # evicted to be reused
    decode_to(kv, a, 32)
    # Position 32 opens a block: block 5 leaves the window, but two blocks are needed (one per
    # group) and only it is free: None; the null stays, nothing else changes.
    a.append_output_token_ids(77)
    assert kv.allocate_slots(a, 1) is None
    assert kv.get_block_ids("a") == ([1, 2, 3, 7], [0, 0, 6, 8]) and free_ids(kv) == [5]
    kv.free(s)  # position 1, then 0; group 0 before group 1
    assert free_ids(kv) == [5, 10, 4, 9, 11]
    new = kv.allocate_slots(a, 1)
    assert [[b.block_id for b in g] for g in new] == [[5], [10]]
    assert kv.get_block_ids("a") == ([1, 2, 3, 7, 5], [0, 0, 6, 8, 10])
    kv.free(a)
    assert kv.usage == 0.0 and all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_admission_need_and_capacity_count_a_window_once():
    kv = manager(num_blocks=30, max_chunk=16)
    # A sliding group holds at most ceil((15 + 16) / 8) + 1 = 5 blocks of a sequence.
    assert kv.blocks_per_sequence(200) == 25 + 5
    assert kv.max_num_tokens == 192  # ceil(192 / 8) + 5 = 29 usable blocks; 193 needs 30
    assert manager(num_blocks=30, groups=()).max_num_tokens == 29 * B
    assert manager(num_blocks=30, groups=(W,), max_chunk=16).max_num_tokens == UNBOUNDED
    assert manager(num_blocks=4, groups=(W, W), max_chunk=16).max_num_tokens == 8  # 1 + 1 block
    r = req("r", list(range(200)))
    need, evictable = kv.admission_blocks(r.num_tokens, kv.get_computed_blocks(r)[0])
    assert (need, evictable) == (30, 0)
    assert kv.blocks_to_grow(80, 200) == (25 - 10) + (5 - 5)


def test_offload_saves_and_loads_every_groups_blocks():
    kv = KVCacheManager(CacheConfig(block_size=B, kv_cache_groups=(None, W), num_host_blocks=16), 9)
    a = req("a", list(range(18)))  # ([1, 2, 3], [4, 5, 6]); blocks 0, 1 cached in both groups
    admit(kv, a)
    a.ledger.preempted(0, 0.0, a.num_computed_tokens, kv.group_blocks_held("a"))
    kv.free(a, preempted=True)  # the scheduler's _preempt
    a.num_computed_tokens, a.num_preemptions = 0, 1
    # Saved at once, last position first, group 0 before group 1 (3 and 6 are not full).
    assert dataclasses.astuple(kv.take_transfers()) == ([2, 5, 1, 4], [0, 1, 2, 3], [], [])
    d = req("d", list(range(700, 726)))  # 4 blocks each: every free block, a's evicted
    admit(kv, d)
    assert kv.get_block_ids("d") == ([7, 8, 3, 6], [2, 5, 1, 4])
    assert kv.take_transfers() is None  # evicted blocks the host tier holds already
    kv.free(d)
    # The resume: nothing on the device, both groups' two blocks in the host tier (keyed per
    # group): a hit of 16 tokens that loads 4 blocks into fresh ones (evicting d's cached
    # blocks 3, 1, 8, 5, saved into slots 4..7 first).
    hit, num_hit = kv.get_computed_blocks(a)
    assert num_hit == 16 and hit == (a.block_hashes[:2], a.block_hashes[:2])
    assert kv.allocate_slots(a, a.num_tokens - num_hit, num_hit, hit, new_request=True)
    assert kv.get_block_ids("a") == ([6, 4, 3], [1, 8, 5])
    assert dataclasses.astuple(kv.take_transfers()) == (
        [3, 1, 8, 5],
        [4, 5, 6, 7],
        [2, 0, 3, 1],
        [6, 4, 1, 8],
    )
    assert a.ledger.preemptions[-1][7:] == ["load", 16, [3, 3]]
    stats = kv.make_stats()
    assert stats.resumed_loaded_tokens == 16
    assert stats.offload_loaded_tokens == 4 * B and stats.offload_stored_tokens == 8 * B
    assert kv.block_pool.get_cached_block(a.block_hashes[1], 1).block_id == 8
    kv.free(a)
    assert kv.usage == 0.0 and not kv.host_pool.pinned


def test_kv_events_name_their_group():
    kv = manager()
    pool = kv.record_kv_events()
    a = req("a", list(range(18)))  # ([1, 2, 3], [4, 5, 6]); blocks 0 and 1 full
    admit(kv, a)
    stored = pool.take_kv_events()
    assert stored == [
        BlockStored(a.block_hashes[:2], None, list(range(16)), 0),
        BlockStored(a.block_hashes[:2], None, list(range(16)), 1),
    ]
    kv.free(a)  # free queue: 7..19, 3, 6, 2, 5, 1, 4
    c = req("c", list(range(300, 372)))  # 9 blocks each: group 1 takes 16..19, 3, 6, 2, 5, 1
    admit(kv, c)
    h0, h1 = a.block_hashes[:2]
    assert [e for e in pool.take_kv_events() if isinstance(e, BlockRemoved)] == [
        BlockRemoved([h1, h0], 0),  # blocks 2 and 1
        BlockRemoved([h1], 1),  # block 5 (block 4 survives)
    ]
    wire = event_to_wire(stored[1], B, (None, W))
    assert wire["group_idx"] == 1 and wire["kv_cache_spec_kind"] == "sliding_window"
    assert wire["kv_cache_spec_sliding_window"] == W
    assert "group_idx" not in event_to_wire(BlockStored([b"x" * 32], None, []), B)
    kv.free(c)
    assert kv.usage == 0.0


# ---------------------------------------------------------------- the scheduler on top


@pytest.mark.parametrize(
    "groups,seed", [((None, 24), 0), ((20,), 1), ((None, 16, 40), 2), ((None, 24), 3)]
)
def test_random_workloads_read_every_key_of_every_window(groups, seed):
    """Random arrivals, chunked prefill, shared prefixes, preemptions and aborts over a small
    pool; the fake runner checks, each step, that every key each query reads (its window in a
    sliding group, every earlier token in a full one) holds the right token, and each request's
    tokens are what the deterministic fake model makes."""
    import random

    rng = random.Random(seed)
    s = make_scheduler(
        num_blocks=rng.choice([56, 80]),
        block_size=8,
        budget=rng.choice([32, 64]),
        max_num_seqs=rng.choice([3, 6]),
        threshold=rng.choice([0, 24]),
        policy=rng.choice(["fcfs", "priority"]),
        max_model_len=200,
        kv_cache_groups=groups,
    )
    assert FakeRunner(s).check_reads
    run_random_workload(s, rng, num_requests=30, max_prompt=120, max_len=200, abort_rate=0.02)


def test_preemption_and_resume_keep_tokens_and_free_every_group():
    # 3 requests of 40 + 40 tokens; 20 blocks of 8 tokens: each needs 10 full-group blocks and
    # at most 4 sliding ones (ceil((15 + 16) / 8) + 1 = 5 with 16-token chunks): preemptions.
    s = make_scheduler(
        num_blocks=21, block_size=8, budget=16, max_num_seqs=3, kv_cache_groups=(None, 16)
    )
    runner = FakeRunner(s)
    for i in range(3):
        s.add_request(make_request(f"r{i}", list(range(100 * i, 100 * i + 40)), max_tokens=40))
    preempted = {}
    outs = run_until_done(
        s,
        runner,
        on_step=lambda out: preempted.update(dict.fromkeys(out.preempted_req_ids, True)),
    )
    assert preempted, "the pool was meant to force preemptions"
    assert outs == {f"r{i}": expected_tokens(f"r{i}", 40, 40) for i in range(3)}
    assert s.kv_cache_manager.usage == 0.0
