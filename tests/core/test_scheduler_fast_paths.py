"""The scheduler's fast paths change nothing but speed.

Two schedulers run the same random trace (arrivals with shared prefixes, EOS stops, min_tokens,
aborts, a pool small enough to preempt), step by step:

* "fast": as shipped, with the decode fast paths of ``schedule()`` (the manager's no-op ends),
  ``allocate_slots`` and ``update_from_output``, and the steady-decode path of both (a step
  that repeats the previous one's decodes; its update is taken with ``batched=True``);
* "general": the same code forced down the general paths: its KV-cache manager clears the
  request's no-op end after every allocation (so neither ``schedule()`` nor ``allocate_slots`` can
  take a shortcut), it takes no steady-decode snapshot, and its runner output carries (empty)
  logprobs, which sends ``update_from_output`` through the per-request general update.

Every SchedulerOutput (a steady one sends no token ids: the rest must be equal), every
EngineCoreOutput (a DecodeTokens read as one per request) and the final state must be equal, and
the no-op ends must equal what the manager's state implies after every step.
"""

import dataclasses
import random

import pytest
from core_testing import (
    EOS,
    FakeRunner,
    check_scheduler_invariants,
    fake_token,
    make_request,
    make_scheduler,
)

from jaxserve.core.engine_core_output import DecodeTokens, EngineCoreOutput
from jaxserve.core.request import RequestStatus
from jaxserve.core.runner_output import ModelRunnerOutput


def force_general_paths(s):
    kv = s.kv_cache_manager
    allocate = kv.allocate_slots

    def allocate_without_shortcuts(request, *args, **kwargs):
        new_blocks = allocate(request, *args, **kwargs)
        if new_blocks is not None:
            kv._noop_end[request.request_id] = 0
        return new_blocks

    kv.allocate_slots = allocate_without_shortcuts
    s._steady_snapshot = lambda step: None
    return s


def scheduler_pair(**kwargs):
    """A scheduler as shipped and one forced down the general paths, alike otherwise."""
    return make_scheduler(**kwargs), force_general_paths(make_scheduler(**kwargs))


def trace_schedulers(policy, prefix_caching, num_blocks, budget, threshold):
    """scheduler_pair sized for random_trace's requests (8-token blocks, 12 seqs, 160 tokens)."""
    return scheduler_pair(
        num_blocks=num_blocks,
        block_size=8,
        budget=budget,
        max_num_seqs=12,
        threshold=threshold,
        policy=policy,
        prefix_caching=prefix_caching,
        max_model_len=160,
    )


def schedule_both(fast, general, step):
    """Both schedulers' next outputs, checked equal (a steady one sends no token ids)."""
    out_fast, out_general = fast.schedule(), general.schedule()
    if out_fast.steady_decode:
        assert without_token_ids(out_fast) == without_token_ids(out_general), step
    else:
        assert out_fast == out_general, step
    return out_fast, out_general


def without_token_ids(out):
    """A SchedulerOutput as a steady-decode one is compared: no token ids, no flag."""
    cached = dataclasses.replace(out.scheduled_cached_reqs, new_token_ids=[])
    return dataclasses.replace(out, scheduled_cached_reqs=cached, steady_decode=False)


def ledger_shape(ledger):
    """A request's ledger without its times (the two schedulers run at different moments)."""
    d = ledger.to_dict()
    untimed = lambda e: {k: v for k, v in e.items() if not k.endswith("t_s")}  # noqa: E731
    d["steps"] = [untimed(e) for e in d["steps"]]
    d["preemptions"] = [untimed(e) for e in d["preemptions"]]
    return {k: v for k, v in d.items() if not k.endswith("_s") and k != "arrival_time"}


def add_to_both(fast, general, added, req_id, prompt, params):
    for s in (fast, general):
        request = make_request(req_id, prompt, eos_token_id=EOS, **params)
        s.add_request(request)
        added.setdefault(req_id, []).append(request)


def abort_both(fast, general, added, req_ids):
    """Aborts ``req_ids`` in both schedulers; the aborted requests' ledgers must agree."""
    fast.abort_requests(req_ids)
    general.abort_requests(req_ids)
    assert_same_ledgers(added, [r for r in req_ids if r in added])


def assert_same_ledgers(added, req_ids=None):
    """The requests' ledgers agree (``req_ids``: these, e.g. just finished: a ledger must be
    whole when its request ends, as the server may read it at once)."""
    for req_id in added if req_ids is None else req_ids:
        fast_request, general_request = added[req_id]
        assert ledger_shape(fast_request.ledger) == ledger_shape(general_request.ledger), req_id


def as_core_outputs(s, news):
    """update_from_output's result, a DecodeTokens read as one EngineCoreOutput per request."""
    if isinstance(news, DecodeTokens):
        return [
            EngineCoreOutput(r, [t], num_cached_tokens=s.requests[r].num_cached_tokens)
            for r, t in zip(news.req_ids, news.token_ids)
        ]
    return news


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
    fast, general = trace_schedulers(policy, prefix_caching, num_blocks, budget, threshold)
    runners = {
        id(fast): FakeRunner(fast, eos_at=dict(eos_at)),
        id(general): FakeRunner(general, eos_at=dict(eos_at)),
    }
    num_preempted = num_steady = num_batched = 0
    added = {}
    for step in range(len(arrivals) + 3000):
        if step < len(arrivals):
            for req_id, prompt, params in arrivals[step]:
                add_to_both(fast, general, added, req_id, prompt, params)
        if not fast.has_unfinished_requests() and step >= len(arrivals):
            break
        out_fast, out_general = schedule_both(fast, general, step)
        num_steady += out_fast.steady_decode
        check_scheduler_invariants(fast, out_fast)
        check_noop_end(fast)
        num_preempted += len(out_fast.preempted_req_ids)
        result_fast = runners[id(fast)].execute(out_fast)
        result_general = runners[id(general)].execute(out_general)
        result_general.logprobs = [[] for _ in result_general.req_ids]
        news = fast.update_from_output(out_fast, result_fast, batched=True)
        num_batched += isinstance(news, DecodeTokens)
        general_news = general.update_from_output(out_general, result_general)
        assert as_core_outputs(fast, news) == general_news
        assert_same_ledgers(added, [o.req_id for o in general_news if o.finish_reason])
        check_noop_end(fast)
        if step < len(aborts):
            abort_both(fast, general, added, aborts[step])
    assert not fast.has_unfinished_requests() and not general.has_unfinished_requests()
    assert fast.make_stats() == general.make_stats()
    if num_blocks < 100:
        assert num_preempted > 0  # the small pool exercised preemption
    assert num_steady >= 10 and num_batched >= 10, (num_steady, num_batched)  # both ran
    assert_same_ledgers(added)


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


def pipelined_tokens(out, eos_at):
    """A runner under async scheduling, for the scheduler alone: one token per scheduled request,
    ``fake_token(req_id, end)`` (EOS where ``eos_at`` says), computed without the tokens still in
    flight; the scheduler keeps only those of requests that reached their length."""
    req_ids = list(out.num_scheduled_tokens)
    start = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    start.update(zip(cached.req_ids, cached.num_computed_tokens))
    sampled = []
    for r in req_ids:
        end = start[r] + out.num_scheduled_tokens[r]
        sampled.append([EOS if eos_at.get(r) == end else fake_token(r, end)])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        sampled_flat=[t[0] for t in sampled],
    )


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("num_blocks,budget,threshold", [(400, 512, 0), (24, 96, 32)])
def test_fast_paths_match_general_paths_under_async_scheduling(
    policy, num_blocks, budget, threshold
):
    """As above, with the next step scheduled before the previous one's tokens land (placeholders
    in flight: a block whose last token is in flight is registered a step late)."""
    arrivals, aborts, eos_at = random_trace(seed=num_blocks + budget + 1, num_steps=150)
    fast, general = trace_schedulers(policy, True, num_blocks, budget, threshold)
    in_flight = None
    num_steady = num_batched = 0
    added = {}
    for step in range(len(arrivals) + 3000):
        if step < len(arrivals):
            for req_id, prompt, params in arrivals[step]:
                add_to_both(fast, general, added, req_id, prompt, params)
        if step >= len(arrivals) and not fast.has_unfinished_requests() and in_flight is None:
            break
        out_fast, out_general = schedule_both(fast, general, step)
        num_steady += out_fast.steady_decode
        check_scheduler_invariants(fast, out_fast)
        if in_flight is not None:  # the previous step's tokens land after this one is planned
            prev_fast, prev_general = in_flight
            news = fast.update_from_output(prev_fast, pipelined_tokens(prev_fast, eos_at), True)
            num_batched += isinstance(news, DecodeTokens)
            result_general = pipelined_tokens(prev_general, eos_at)
            result_general.logprobs = [[] for _ in result_general.req_ids]
            general_news = general.update_from_output(prev_general, result_general)
            assert as_core_outputs(fast, news) == general_news, step
            assert_same_ledgers(added, [o.req_id for o in general_news if o.finish_reason])
        in_flight = None if out_fast.is_empty else (out_fast, out_general)
        if step < len(aborts):
            abort_both(fast, general, added, aborts[step])
    assert not fast.has_unfinished_requests() and not general.has_unfinished_requests()
    assert fast.make_stats() == general.make_stats()
    assert num_steady >= 10 and num_batched >= 10, (num_steady, num_batched)
    assert_same_ledgers(added)
