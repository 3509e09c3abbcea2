"""The scheduler's steady-decode path against the general path on random traces with what
test_scheduler_fast_paths.py leaves out: per-request stop_token_ids, stop-string finishes
(``finish_requests``) of running requests between steps, aborts of running and waiting requests
while a steady step is in flight, KV offloading (a host tier), the watermark, a small
max_model_len; synchronous and pipelined (async scheduling); outputs, stats after every step and
ledgers compared. And the snapshot is not taken only to be given up while a waiting request
could be admitted."""

import random

import pytest
from core_testing import EOS, fake_token, make_request
from test_scheduler_fast_paths import (
    as_core_outputs,
    force_general_paths,
    schedule_both,
    scheduler_pair,
)

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.engine_core_output import DecodeTokens
from jaxserve.core.request import RequestStatus
from jaxserve.core.runner_output import ModelRunnerOutput
from jaxserve.core.scheduler import Scheduler


def make(policy, num_blocks, bs, num_host, watermark, max_model_len, max_num_seqs):
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=256,
            max_num_seqs=max_num_seqs,
            long_prefill_token_threshold=32,
            policy=policy,
            max_model_len=max_model_len,
        ),
        CacheConfig(block_size=bs, num_host_blocks=num_host, watermark=watermark),
        num_gpu_blocks=num_blocks,
    )


def ledger(lg):
    """A ledger's content without times."""
    return (
        list(lg.decode_steps),
        [(c[0],) + tuple(c[2:]) for c in lg.chunks],
        [[p[0], p[2], p[3], p[5], p[6], p[7], p[8]] for p in lg.preemptions],
        lg.device_hit_tokens,
        lg.host_hit_tokens,
        lg.high_water,
        lg.finish_reason,
        lg.stop_reason,
        lg.num_output_tokens,
        lg.num_cached_tokens,
    )


def trace(seed, num_steps, max_model_len):
    rng = random.Random(seed)
    shared = [rng.randrange(900) for _ in range(40)]
    arrivals, events = [], []
    n = 0
    for step in range(num_steps):
        batch = []
        k = rng.choice([0, 0, 0, 0, 0, 1, 1, 3]) if step < num_steps * 2 // 3 else 0
        for _ in range(k):
            n += 1
            prompt = [rng.randrange(900) for _ in range(rng.randint(1, 40))]
            if rng.random() < 0.5:
                prompt = shared[: rng.randint(8, 40)] + prompt
            params = dict(
                max_tokens=rng.choice([None, 1, 2, 3, 5, 9, 17, 30, 60]),
                ignore_eos=True,
                priority=rng.randint(0, 2),
                stop_token_ids=rng.sample(range(900), rng.choice([0, 0, 5])),
                min_tokens=rng.choice([0, 0, 4]),
            )
            if params["max_tokens"] is not None:
                params["min_tokens"] = min(params["min_tokens"], params["max_tokens"])
            batch.append((f"q{n}", prompt[: max_model_len - 2], params))
        arrivals.append(batch)
        ev = []
        if n and rng.random() < 0.08:
            ev.append(("abort", f"q{rng.randint(1, n)}"))
        if n and rng.random() < 0.08:
            ev.append(("stop", f"q{rng.randint(1, n)}"))
        events.append(ev)
    return arrivals, events


def apply(s, ev):
    for kind, rid in ev:
        if kind == "abort":
            s.abort_requests(rid)
        else:
            s.finish_requests(rid, RequestStatus.FINISHED_STOPPED)


def position_tokens(out):
    """req_id -> [the token sampled at the end of its scheduled tokens]: it depends on the request
    and the position only (ids < 900, so now and then one of a request's stop ids)."""
    start = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    start.update(zip(cached.req_ids, cached.num_computed_tokens))

    def tokens_of(req_id):
        return [fake_token(req_id, start[req_id] + out.num_scheduled_tokens[req_id]) % 900]

    return tokens_of


def token_outputs(out, tokens_of):
    req_ids = list(out.num_scheduled_tokens)
    sampled = [tokens_of(r) for r in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        sampled_flat=[t[0] for t in sampled] if all(len(t) == 1 for t in sampled) else None,
    )


CASES = [
    # policy, blocks, bs, host, watermark, max_model_len, max_num_seqs
    ("fcfs", 400, 8, 0, 0.0, 96, 8),
    ("priority", 400, 8, 0, 0.0, 96, 8),
    ("fcfs", 30, 8, 64, 0.0, 96, 12),
    ("priority", 30, 8, 64, 0.0, 96, 12),
    ("fcfs", 40, 8, 0, 0.1, 64, 12),
    ("priority", 40, 16, 16, 0.05, 120, 6),
    ("fcfs", 24, 16, 32, 0.0, 200, 4),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("pipelined", [False, True])
def test_steady_vs_general_random(case, seed, pipelined):
    arrivals, events = trace(seed * 31 + CASES.index(case), 200, case[5])
    fast = make(*case)
    general = force_general_paths(make(*case))
    ledgers = {id(fast): {}, id(general): {}}
    in_flight = None
    num_steady = num_batched = 0
    for step in range(len(arrivals) + 3000):
        if step < len(arrivals):
            for rid, prompt, params in arrivals[step]:
                for s in (fast, general):
                    r = make_request(rid, prompt, eos_token_id=EOS, **params)
                    ledgers[id(s)][rid] = r.ledger
                    s.add_request(r)
        if step >= len(arrivals) and not fast.has_unfinished_requests() and in_flight is None:
            break
        out_fast, out_general = schedule_both(fast, general, step)
        num_steady += out_fast.steady_decode
        if pipelined:
            done = in_flight
            in_flight = None if out_fast.is_empty else (out_fast, out_general)
        else:
            done = (out_fast, out_general)
        if done is not None:
            prev_fast, prev_general = done
            rf = token_outputs(prev_fast, position_tokens(prev_fast))
            rg = token_outputs(prev_general, position_tokens(prev_general))
            # a sampled token for partial chunks is dropped by the scheduler; fine
            rg.logprobs = [[] for _ in rg.req_ids]
            news = fast.update_from_output(prev_fast, rf, True)
            num_batched += isinstance(news, DecodeTokens)
            assert as_core_outputs(fast, news) == general.update_from_output(prev_general, rg), step
        if step < len(events):
            apply(fast, events[step])
            apply(general, events[step])
        assert fast.make_stats() == general.make_stats(), step
    assert not fast.has_unfinished_requests() and not general.has_unfinished_requests()
    assert fast.kv_cache_manager.usage == 0.0
    for rid, lg in ledgers[id(fast)].items():
        assert ledger(lg) == ledger(ledgers[id(general)][rid]), rid
    assert num_steady >= 5, num_steady


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_waiting_request_that_cannot_be_admitted(policy):
    """A waiting request that cannot be admitted: priority, slots full and it is less urgent;
    fcfs, a free slot but too few free blocks for it. Under priority the general path runs every
    step (the waiting one might preempt) and no snapshot is taken only to be given up; under
    fcfs the steady path goes on (``_head_blocked``). Both as the general paths schedule."""
    from core_testing import FakeRunner

    fast, general = scheduler_pair(
        num_blocks=4 * 4 + 1 + 2,
        block_size=16,
        max_num_seqs=4 if policy == "priority" else 8,
        policy=policy,
    )
    runners = {id(s): FakeRunner(s) for s in (fast, general)}
    for s in (fast, general):
        for i in range(4):
            prompt = list(range(1 + i, 49 + i))
            s.add_request(make_request(f"r{i}", prompt, max_tokens=15, priority=0))
        for _ in range(3):  # prefill + two decode steps: the snapshot is taken
            out = s.schedule()
            s.update_from_output(out, runners[id(s)].execute(out), batched=True)
        s.add_request(make_request("w", list(range(500, 600)), max_tokens=4, priority=1))
    calls = []
    snapshot = fast._steady_snapshot
    fast._steady_snapshot = lambda step: calls.append(1) or snapshot(step)
    steady = 0
    for step in range(10):
        out, out_general = schedule_both(fast, general, step)
        steady += out.steady_decode
        assert "w" not in out.num_scheduled_tokens
        news = fast.update_from_output(out, runners[id(fast)].execute(out), batched=True)
        general_news = general.update_from_output(
            out_general, runners[id(general)].execute(out_general)
        )
        assert as_core_outputs(fast, news) == general_news
    if policy == "priority":
        assert steady == 0
        assert len(calls) <= 1, f"{len(calls)} snapshots taken and given up in 10 steps"
    else:
        assert steady == 10
