"""The scheduler's fast paths change nothing but speed.

Two schedulers run the same random trace (arrivals with shared prefixes, EOS stops, min_tokens,
aborts, a pool small enough to preempt), step by step:

* "fast": as shipped, with the decode fast paths of ``schedule()`` (the manager's no-op ends),
  ``allocate_slots`` and ``update_from_output``;
* "general": the same code forced down the general paths: its KV-cache manager clears the
  request's no-op end after every allocation (so neither ``schedule()`` nor ``allocate_slots`` can
  take a shortcut), and its runner output carries (empty) logprobs, which sends
  ``update_from_output`` through the per-request general update.

Every SchedulerOutput, every EngineCoreOutput and the final state must be equal, and the no-op
ends must equal what the manager's state implies after every step.
"""

import random

import pytest
from core_testing import EOS, FakeRunner, check_scheduler_invariants, make_request, make_scheduler

from jaxserve.core.request import RequestStatus


def force_general_paths(s):
    kv = s.kv_cache_manager
    allocate = kv.allocate_slots

    def allocate_without_shortcuts(request, *args, **kwargs):
        new_blocks = allocate(request, *args, **kwargs)
        if new_blocks is not None:
            kv._noop_end[request.request_id] = 0
        return new_blocks

    kv.allocate_slots = allocate_without_shortcuts
    return s


def check_noop_end(s):
    """no-op end = table capacity, capped (with prefix caching) just before the first
    unregistered block's end; absent for requests holding no blocks."""
    kv = s.kv_cache_manager
    noop_ends = kv.get_noop_ends()
    bs = s.block_size
    for r in s.running:
        blocks = kv.req_to_blocks[r.request_id]
        expected = len(blocks) * bs
        if kv.enable_caching:
            expected = min(expected, (kv.num_cached_block[r.request_id] + 1) * bs - 1)
        assert noop_ends[r.request_id] == expected, r
        assert r.num_computed_tokens <= expected or r.num_computed_tokens % bs == 0, r
    for r in s.waiting:
        assert r.request_id not in noop_ends, r


def random_trace(seed, num_steps):
    """Per step: the requests that arrive (req_id, prompt, params) and the ids aborted after it."""
    rng = random.Random(seed)
    shared = [rng.randrange(900) for _ in range(40)]
    arrivals, aborts, eos_at = [], [], {}
    n = 0
    for step in range(num_steps):
        batch = []
        for _ in range(rng.choice([0, 0, 1, 1, 2, 4]) if step < num_steps * 2 // 3 else 0):
            n += 1
            req_id = f"q{n}"
            prompt = [rng.randrange(900) for _ in range(rng.randint(1, 70))]
            if rng.random() < 0.4:
                prompt = shared[: rng.randint(16, 40)] + prompt
            max_tokens = rng.choice([0, 1] + list(range(2, 41)))
            params = dict(
                max_tokens=max_tokens,
                ignore_eos=rng.random() < 0.5,
                min_tokens=min(rng.choice([0, 0, 3]), max_tokens),
                priority=rng.randint(0, 2),
            )
            if rng.random() < 0.3:
                eos_at[req_id] = len(prompt) + rng.randint(0, 12)
            batch.append((req_id, prompt, params))
        arrivals.append(batch)
        aborts.append([f"q{rng.randint(1, n)}"] if n and rng.random() < 0.1 else [])
    return arrivals, aborts, eos_at


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_blocks,budget,threshold", [(400, 512, 0), (24, 96, 32)])
def test_fast_paths_match_general_paths(policy, prefix_caching, num_blocks, budget, threshold):
    arrivals, aborts, eos_at = random_trace(seed=num_blocks + budget, num_steps=150)
    kwargs = dict(
        num_blocks=num_blocks,
        block_size=8,
        budget=budget,
        max_num_seqs=12,
        threshold=threshold,
        policy=policy,
        prefix_caching=prefix_caching,
        max_model_len=160,
    )
    fast = make_scheduler(**kwargs)
    general = force_general_paths(make_scheduler(**kwargs))
    runners = {
        id(fast): FakeRunner(fast, eos_at=dict(eos_at)),
        id(general): FakeRunner(general, eos_at=dict(eos_at)),
    }
    num_preempted = 0
    for step in range(len(arrivals) + 3000):
        if step < len(arrivals):
            for req_id, prompt, params in arrivals[step]:
                for s in (fast, general):
                    s.add_request(make_request(req_id, prompt, eos_token_id=EOS, **params))
        if not fast.has_unfinished_requests() and step >= len(arrivals):
            break
        out_fast, out_general = fast.schedule(), general.schedule()
        assert out_fast == out_general, step
        check_scheduler_invariants(fast, out_fast)
        check_noop_end(fast)
        num_preempted += len(out_fast.preempted_req_ids)
        result_fast = runners[id(fast)].execute(out_fast)
        result_general = runners[id(general)].execute(out_general)
        result_general.logprobs = [[] for _ in result_general.req_ids]
        assert fast.update_from_output(out_fast, result_fast) == general.update_from_output(
            out_general, result_general
        )
        check_noop_end(fast)
        if step < len(aborts):
            fast.abort_requests(aborts[step])
            general.abort_requests(aborts[step])
    assert not fast.has_unfinished_requests() and not general.has_unfinished_requests()
    assert fast.make_stats() == general.make_stats()
    if num_blocks < 100:
        assert num_preempted > 0  # the small pool exercised preemption


def test_decode_fast_path_is_taken():
    """With 16-token blocks, 14 of every 16 decode steps need nothing from the KV-cache manager:
    allocate_slots is called only when a block fills up and when the next one is opened."""
    s = make_scheduler(num_blocks=64, block_size=16)
    r = make_request("a", list(range(20)), max_tokens=40)
    s.add_request(r)
    runner = FakeRunner(s)
    calls = []
    allocate = s.kv_cache_manager.allocate_slots

    def counting_allocate(request, *args, **kwargs):
        calls.append(request.num_computed_tokens)
        return allocate(request, *args, **kwargs)

    s.kv_cache_manager.allocate_slots = counting_allocate
    for _ in range(30):
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 49
    # Admission at 0, then only at block boundaries: 31 fills block 1, 32 opens block 2, ...
    assert calls == [0, 31, 32, 47, 48]
