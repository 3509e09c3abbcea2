"""Routing policies without Ray: choices, load fallback, health, and hit rates on a shared-prefix
workload replayed against real KV-cache managers (one per replica)."""

from __future__ import annotations

import random

import pytest

from jaxserve.config import CacheConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_cache_utils import hash_token_blocks, none_hash_from_seed
from jaxserve.core.request import Request
from jaxserve.entrypoints.router import NoReplicaError, Router
from jaxserve.sampling_params import SamplingParams

B = 16
SEED = "1234"


def router(policy, n=2, **kw):
    return Router(n, policy, B, none_hash_from_seed(SEED), **kw)


def prompt(prefix, suffix, prefix_blocks=4):
    return [prefix * 100 + i % 50 for i in range(prefix_blocks * B)] + [
        5000 + suffix * 7 + i for i in range(B // 2)
    ]


def route(r, ids, salt=None):
    index, hashes = r.choose(ids, salt)
    r.started(index, hashes)
    r.finished(index)
    return index


def test_round_robin_and_least_loaded():
    r = router("round-robin", 3)
    assert [route(r, prompt(0, k)) for k in range(4)] == [0, 1, 2, 0]
    r.update(1, up=False)
    assert [route(r, prompt(0, k)) for k in range(3)] == [2, 0, 2]
    r = router("least-loaded", 3)
    r.started(0, [])
    r.started(1, [])
    assert r.choose(prompt(0, 0))[0] == 2
    r.update(2, up=True, kv_cache_usage=0.9)
    r.started(2, [])
    r.update(0, up=True, kv_cache_usage=0.7)
    r.update(1, up=True, kv_cache_usage=0.5)
    assert r.choose(prompt(0, 0))[0] == 1  # equal in flight: lower KV usage
    with pytest.raises(ValueError, match="routing"):
        router("random")


def test_prefix_aware_follows_the_prefix_and_its_salt():
    r = router("prefix-aware")
    first = route(r, prompt(1, 0))
    assert all(route(r, prompt(1, k)) == first for k in range(1, 5))
    other = route(r, prompt(2, 0))  # a new prefix goes to the least loaded replica
    r.started(first, [])  # make the first replica busier
    assert route(r, prompt(3, 0)) == other
    # The router's hashes are the engine's: same function, same seed, salt included.
    ids = prompt(1, 0)
    assert (
        r.prefix_hashes(ids, "t")[:2]
        == hash_token_blocks(ids, B, cache_salt="t", none_hash=none_hash_from_seed(SEED))[:2]
    )
    assert r.prefix_hashes(ids, "t") != r.prefix_hashes(ids, None)


def test_prefix_aware_falls_back_when_overloaded_and_forgets_restarts():
    r = router("prefix-aware", max_imbalance=3)
    home = route(r, prompt(1, 0))
    for _ in range(3):
        r.started(home, [])
    assert r.choose(prompt(1, 1))[0] != home  # 3 more in flight than the other: overloaded
    r.finished(home)
    assert r.choose(prompt(1, 1))[0] == home
    r.update(home, up=True, restarted=True)  # its cache is gone
    assert r.replicas[home].matched_blocks(r.prefix_hashes(prompt(1, 0), None)) == 0
    r.update(0, up=False)
    r.update(1, up=False)
    with pytest.raises(NoReplicaError):
        r.choose(prompt(1, 0))
    r.update(1, up=True)
    with pytest.raises(NoReplicaError):
        r.choose(prompt(1, 0), exclude=frozenset({1}))


def test_index_is_bounded_by_the_replicas_pool():
    r = router("prefix-aware", 1)
    r.update(0, up=True, capacity_blocks=6)
    route(r, prompt(1, 0))  # 4 blocks
    route(r, prompt(2, 0))  # 4 more: the oldest 2 of prefix 1 are forgotten
    assert len(r.replicas[0].prefix_index) == 6
    assert r.replicas[0].matched_blocks(r.prefix_hashes(prompt(1, 0), None)) == 0


def _hit_rate(policy, num_blocks, num_prefixes=8, num_requests=200):
    """Replays a shared-prefix workload against one KVCacheManager per replica: each request is
    admitted and freed in turn (its blocks stay cached until evicted)."""
    r = router(policy, 2)
    managers = [KVCacheManager(CacheConfig(block_size=B), num_blocks) for _ in range(2)]
    for i, manager in enumerate(managers):
        manager.none_hash = none_hash_from_seed(SEED)  # as PYTHONHASHSEED=SEED would set it
        r.update(i, up=True, capacity_blocks=num_blocks - 1)
    rng = random.Random(0)
    hits = queries = 0
    for k in range(num_requests):
        ids = prompt(rng.randrange(num_prefixes), k, prefix_blocks=8)
        i = route(r, ids)
        req = Request(f"r{k}", ids, SamplingParams(max_tokens=1), eos_token_id=None)
        blocks, num_hit = managers[i].get_computed_blocks(req)
        assert managers[i].allocate_slots(req, len(ids) - num_hit, num_hit, blocks) is not None
        req.num_computed_tokens = len(ids)
        managers[i].free(req)
        hits, queries = hits + num_hit, queries + len(ids)
    return hits / queries


def test_prefix_aware_multiplies_the_cache_it_routes_to():
    # Each replica's pool holds about 5 of the 8 prefixes (8 blocks each).
    rates = {p: _hit_rate(p, num_blocks=42) for p in ("prefix-aware", "round-robin")}
    assert rates["prefix-aware"] > 0.85
    assert rates["prefix-aware"] >= 1.5 * rates["round-robin"], rates


def test_a_replica_that_was_only_down_keeps_its_index():
    r = router("prefix-aware")
    home = route(r, prompt(1, 0))
    r.update(home, up=False)  # missed polls: maybe busy, maybe restarting
    r.update(home, up=True)  # answered again, same process: its cache is intact
    assert r.replicas[home].matched_blocks(r.prefix_hashes(prompt(1, 0), None)) == 4
