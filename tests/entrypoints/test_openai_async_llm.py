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


def test_lagging_consumer_gets_outputs_merged(llm):
    # The consumer blocks its loop for a while after each output, so several engine steps land
    # in its stream before it reads again: it gets fewer outputs than tokens, and their deltas
    # still join into exactly the final cumulative text, token ids and logprobs of every sample.
    params = SamplingParams(max_tokens=40, n=2, logprobs=2, ignore_eos=True)

    async def main():
        outs = []
        async for out in llm.generate("Hello", params, "slow"):
            outs.append(out)
            time.sleep(0.02)
        return outs

    outs = asyncio.run(main())
    final = outs[-1]
    assert final.finished and len(outs) < 40
    for k in range(2):
        sample = final.outputs[k]
        assert len(sample.token_ids) == 40
        assert "".join(o.outputs[k].delta_text for o in outs) == sample.text
        assert [t for o in outs for t in o.outputs[k].delta_token_ids] == sample.token_ids
        joined = [lp for o in outs for lp in (o.outputs[k].delta_logprobs or [])]
        assert joined == sample.logprobs


def test_one_wakeup_of_the_loop_per_step(llm, monkeypatch):
    # A step's outputs for many requests reach the event loop in one call_soon_threadsafe.
    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a: calls.append(a[0]) or real(*a))
        params = SamplingParams(max_tokens=8, ignore_eos=True)

        async def collect(i):
            return [o async for o in llm.generate("Hello", params, f"r{i}")]

        return await asyncio.gather(*(collect(i) for i in range(6)))

    results = asyncio.run(main())
    assert all(len(r[-1].outputs[0].token_ids) == 8 for r in results)
    steps = llm.engine.num_steps
    assert 0 < len(calls) <= 2 * steps + 6  # per step: outputs (+ accepts); never per request
