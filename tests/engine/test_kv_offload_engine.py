"""KV offloading end to end on the shared runner: greedy float32 tokens equal the dense oracle
with the host tier on, under eviction and preemption storms, with cache_salt and n > 1; a prefix
evicted from the device comes back as a host hit; both tiers empty out (no leaks)."""

from __future__ import annotations

import pytest
from conftest import MAX_TOKENS

from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.kv_offload import HostKVCache

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
GREEDY_N2 = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=2)


@pytest.fixture
def offload_engine(base, make_engine):
    """make_offload(num_host_blocks, **knobs): an engine whose runner has a host tier."""
    made = []

    def make(num_host_blocks, **knobs):
        base.runner.host_kv = HostKVCache(num_host_blocks, base.runner.kv_caches)
        engine = make_engine(num_host_blocks=num_host_blocks, **knobs)
        made.append(engine)
        return engine

    yield make
    base.runner.host_kv = None


def _run_wave(engine, prompts, tag, salted=()):
    """All prompts at once (every third with n = 2; ids in ``salted`` with a cache_salt)."""
    for i, p in enumerate(prompts):
        params = GREEDY_N2 if i % 3 == 0 else GREEDY
        salt = "tenant-b" if i in salted else None
        engine.add_request(f"{tag}{i}", p, params, cache_salt=salt)
    done = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return [[o.token_ids for o in done[f"{tag}{i}"].outputs] for i in range(len(prompts))]


def _expected(oracle, n):
    return [[oracle[i]] * (2 if i % 3 == 0 else 1) for i in range(n)]


@pytest.mark.slow
def test_offload_equals_oracle_under_eviction_and_preemption_storms(
    offload_engine, prompts, oracle
):
    # 40 device blocks (624 tokens) for ~2,300 tokens per wave: the first wave preempts and
    # evicts; the second wave's prefixes come back from the host tier (256 blocks).
    engine = offload_engine(256, num_gpu_blocks=40, long_prefill_token_threshold=64)
    kv = engine.scheduler.kv_cache_manager
    first = _run_wave(engine, prompts, "a")
    assert first == _expected(oracle, len(prompts))
    stats = engine.get_stats()
    assert stats.num_preemptions_total > 0
    second = _run_wave(engine, prompts, "b", salted={1, 4, 7})
    assert second == _expected(oracle, len(prompts))
    stats = engine.get_stats()
    assert stats.host_cache_hits_total > 0
    assert stats.kv_offload_loaded_tokens_total > 0
    assert stats.kv_offload_stored_tokens_total > 0
    timing = engine.runner.host_kv.timing
    assert timing.loaded_blocks * 16 == stats.kv_offload_loaded_tokens_total
    assert kv.usage == 0.0 and stats.num_running_reqs == 0
    assert kv.host_pool.get_usage() > 0.0 and not kv._host_hits and not kv.host_pool.pinned


def test_host_hit_cached_tokens_and_salt_isolation(offload_engine, prompts, oracle):
    # A 2-block-at-a-time pool: each long prompt evicts the previous one's prefix entirely.
    engine = offload_engine(64, num_gpu_blocks=12)
    long = [i for i, p in enumerate(prompts) if 100 <= len(p) <= 160][:2]
    p, q = prompts[long[0]], prompts[long[1]]
    assert _run_wave(engine, [p], "p") == [[oracle[long[0]]] * 2]
    assert _run_wave(engine, [q, q], "q") == [[oracle[long[1]]] * 2, [oracle[long[1]]]]
    kv = engine.scheduler.kv_cache_manager
    engine.get_stats()
    hits_before = engine.get_stats().host_cache_hits_total
    # p again: its prefix is only on the host now; a salted p must not see it.
    engine.add_request("salted", p, GREEDY, cache_salt="other")
    engine.add_request("again", p, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["salted"].outputs[0].token_ids == done["again"].outputs[0].token_ids
    assert done["again"].outputs[0].token_ids == oracle[long[0]]
    full_blocks = (len(p) - 1) // 16
    assert done["again"].num_cached_tokens == full_blocks * 16
    assert done["salted"].num_cached_tokens == 0
    assert engine.get_stats().host_cache_hits_total - hits_before == full_blocks * 16
    assert engine.ledger_history.get("again")["prefix_cache_hit_tokens"] == {
        "device": 0,
        "host": full_blocks * 16,
    }
    assert engine.ledger_history.get("salted")["prefix_cache_hit_tokens"]["host"] == 0
    assert kv.usage == 0.0
