"""The steady-decode paths change nothing but host time.

A step that repeats the previous step's decodes is scheduled from the scheduler's snapshot, built
by the runner from the previous batch, updated in one ``DecodeTokens`` and recorded by the
output processor with one append per request. Here every output must equal the general paths'
(the scheduler forced to take no snapshot), with async scheduling on and off, for greedy and
seeded sampling, ``n > 1``, min_tokens, stop token ids, logprobs, final-only and streamed
requests, and a pool small enough to preempt; and the steady paths must have run.
"""

from __future__ import annotations

import pytest

from jaxserve.core.engine_core_output import DecodeTokens
from jaxserve.core.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=11, max_tokens=36, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.8, seed=5, n=2, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=3, max_tokens=33, min_tokens=20),
    SamplingParams(temperature=1.0, seed=4, max_tokens=38, stop_token_ids=[7, 11, 13]),
    SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True),
]


def _run(make_engine, prompts, *, async_scheduling, **knobs):
    engine = make_engine(async_scheduling=async_scheduling, **knobs)
    counts = {"scheduled": 0, "built": 0, "updated": 0}
    schedule, build = engine.scheduler.schedule, engine.runner.builder.build_steady
    update = engine.scheduler.update_from_output

    def counting_schedule():
        out = schedule()
        counts["scheduled"] += out.steady_decode
        return out

    def counting_build(*args):
        batch = build(*args)
        counts["built"] += batch is not None
        return batch

    def counting_update(*args, **kwargs):
        news = update(*args, **kwargs)
        counts["updated"] += isinstance(news, DecodeTokens)
        return news

    engine.scheduler.schedule = counting_schedule
    engine.runner.builder.build_steady = counting_build
    engine.scheduler.update_from_output = counting_update
    for i in range(16):
        engine.add_request(
            f"r{i}", prompts[i % len(prompts)], PARAMS[i % len(PARAMS)], final_only=i % 3 != 0
        )
    done, streamed = {}, {}
    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            streamed.setdefault(out.request_id, []).append(
                [(c.delta_text, list(c.delta_token_ids)) for c in out.outputs]
            )
            if out.finished:
                done[out.request_id] = [
                    (list(c.token_ids), c.text, c.finish_reason, c.stop_reason, c.logprobs)
                    for c in out.outputs
                ]
    assert not engine.has_unfinished_requests()
    del engine.runner.builder.build_steady  # the shared runner's own method again
    kv = engine.scheduler.kv_cache_manager
    assert kv.usage == 0.0 and not engine.scheduler.requests
    return done, streamed, counts


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("num_gpu_blocks", [None, 40])
def test_steady_paths_equal_the_general_paths(
    make_engine, prompts, monkeypatch, async_scheduling, num_gpu_blocks
):
    knobs = {} if num_gpu_blocks is None else {"num_gpu_blocks": num_gpu_blocks}
    fast = _run(make_engine, prompts, async_scheduling=async_scheduling, **knobs)
    with monkeypatch.context() as m:
        m.setattr(Scheduler, "_steady_snapshot", lambda self, step: None)
        general = _run(make_engine, prompts, async_scheduling=async_scheduling, **knobs)
    assert fast[0] == general[0]  # final outputs
    assert fast[1] == general[1]  # every streamed delta
    assert general[2] == {"scheduled": 0, "built": 0, "updated": 0}
    counts = fast[2]
    assert counts["scheduled"] >= 10 and counts["built"] >= 10 and counts["updated"] >= 10, counts
