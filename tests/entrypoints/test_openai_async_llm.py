"""AsyncLLM over the scripted FakeEngine: delivery, abort, refusal, idleness, engine death."""

from __future__ import annotations

import asyncio
import time

import pytest
from fake_engine import FakeEngine
from server_harness import MODEL_DIR

from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError
from jaxserve.sampling_params import SamplingParams


@pytest.fixture
def llm():
    llm = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.001))
    yield llm
    llm.shutdown()


def test_generate_streams_until_finished(llm):
    async def main():
        outs = [o async for o in llm.generate("Hello", SamplingParams(max_tokens=6, n=2), "r1")]
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    for k in range(2):
        joined = "".join(o.outputs[k].delta_text for o in outs)
        assert joined == outs[-1].outputs[k].text
        assert len(outs[-1].outputs[k].token_ids) == 6
    assert llm.engine.has_unfinished_requests() is False


def test_closing_the_generator_aborts(llm):
    async def main():
        agen = llm.generate("Hello", SamplingParams(max_tokens=10_000, ignore_eos=True, n=2), "r1")
        async for _ in agen:
            break
        await agen.aclose()
        deadline = time.monotonic() + 2
        while llm.num_running_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert llm.num_running_requests == 0
    assert not llm.engine._reqs


def test_cancelled_consumer_aborts(llm):
    async def consume():
        async for _ in llm.generate("Hello", SamplingParams(max_tokens=10_000), "r1"):
            pass

    async def main():
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 2
        while llm.engine._reqs and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert not llm.engine._reqs


def test_refused_request_raises_value_error_and_others_continue(llm):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            await llm.add_request("bad", [], SamplingParams())
        outs = [o async for o in llm.generate([1, 2, 3], SamplingParams(max_tokens=2), "good")]
        return outs[-1]

    assert len(asyncio.run(main()).outputs[0].token_ids) == 2


def test_duplicate_request_id(llm):
    async def main():
        stream = await llm.add_request("same", "Hello", SamplingParams(max_tokens=10_000))
        with pytest.raises(ValueError, match="already in use"):
            await llm.add_request("same", "Hello", SamplingParams())
        stream.abort()

    asyncio.run(main())


def test_idle_engine_does_not_step(llm):
    async def main():
        async for _ in llm.generate("Hello", SamplingParams(max_tokens=3), "r1"):
            pass

    asyncio.run(main())
    steps = llm.engine.num_steps
    time.sleep(0.2)
    assert llm.engine.num_steps == steps
    assert llm._thread.is_alive()


def test_engine_death_fails_pending_and_new_requests():
    llm = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.001, fail_at_step=5))
    seen = []
    llm.add_dead_callback(seen.append)

    async def main():
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate("Hello", SamplingParams(max_tokens=100), "r1"):
                pass
        with pytest.raises(EngineDeadError):
            await llm.add_request("r2", "Hello", SamplingParams())

    asyncio.run(main())
    assert llm.errored and isinstance(seen[0], RuntimeError)
    late = []
    llm.add_dead_callback(late.append)
    assert late == seen
    with pytest.raises(EngineDeadError):
        llm.check_health()
