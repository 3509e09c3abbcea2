"""Sleep mode on the real engine: the weights' and the KV pool's device buffers are freed
(level 1: weights kept in host memory; level 2: reloaded from the checkpoint), nothing
recompiles at wake-up, and greedy outputs after it equal those before.

One engine of its own (sleep deletes the runner's buffers, so the session's shared runner is
not used); its steps load from the session's compilation cache.
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import XLA_CACHE_DIR
from engine_testing import engine_args

from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.sleep_mode import live_device_bytes

PROMPTS = [[1, 306, 496, 304, 263], [1, 450, 499, 1735, 1701, 2991] * 5, [1, 1504]]


@pytest.fixture(scope="module")
def engine(model_dir):
    from jaxserve.engine.llm_engine import LLMEngine

    # The session's engine args: its steps come from the compilation cache the other engine
    # tests filled.
    return LLMEngine.from_engine_args(engine_args(model_dir, XLA_CACHE_DIR, enable_sleep_mode=True))


def _greedy(engine, tag: str) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of every prompt, and each request's cached prompt tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{tag}-{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    outs = [done[f"{tag}-{i}"] for i in range(len(PROMPTS))]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_device_memory_and_wakes_to_the_same_outputs(engine, level):
    runner = engine.runner
    before, _ = _greedy(engine, f"before{level}")
    compiles = runner.compile_counts()
    weights = sum(p.nbytes for p in runner.params)
    kv = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    live = live_device_bytes()
    engine.sleep(level)
    assert engine.is_sleeping and engine._in_flight is None
    assert live - live_device_bytes() >= weights + kv  # every weight and KV buffer went
    assert engine.wake_up() is True and not engine.is_sleeping
    assert live_device_bytes() == live
    after, cached = _greedy(engine, f"after{level}")
    assert after == before
    assert cached[0] == 0  # the prefix cache was cleared with the KV contents
    assert runner.compile_counts() == compiles  # nothing recompiled


def test_wake_up_by_tags(engine):
    engine.sleep(1)
    assert engine.wake_up(["weights"]) is False and engine.is_sleeping
    assert engine.runner.params is not None and engine.runner.kv_caches is None
    with pytest.raises(ValueError, match="tags"):
        engine.wake_up(["gpu"])
    assert engine.wake_up(["kv_cache"]) is True and not engine.is_sleeping


def test_sleep_refuses_unfinished_requests_and_bad_levels(engine):
    engine.add_request("busy", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()
    with pytest.raises(ValueError, match="unfinished"):
        engine.sleep(1)
    engine.abort_request("busy")
    with pytest.raises(ValueError, match="level"):
        engine.sleep(3)
    engine.sleep(1)
    with pytest.raises(ValueError, match="already asleep"):
        engine.sleep(1)
    assert engine.wake_up() is True


def test_sleep_needs_the_flag(engine):
    config = engine.config
    engine.config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, enable_sleep_mode=False)
    )
    try:
        with pytest.raises(ValueError, match="--enable-sleep-mode"):
            engine.sleep(1)
    finally:
        engine.config = config
