"""Short soak runs through the AsyncLLM (the server's engine driver) on the real tiny model.

Preemption storm: every prompt at once plus clients that disconnect mid-stream, on a KV pool
far too small for the work; the greedy outputs equal a roomy run's, and afterwards no request
runs or waits and every KV block is free.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import MAX_TOKENS

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
LEAVER = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True, seed=7)


@pytest.mark.slow
def test_preemption_storm_with_disconnects(make_engine, run, prompts):
    roomy = run(make_engine(), [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
    expected = [roomy[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]

    engine = make_engine(num_gpu_blocks=40, long_prefill_token_threshold=64)
    llm = AsyncLLM(engine, step_timeout_s=120)

    async def finish(i: int) -> list[int]:
        final = None
        async for out in llm.generate(prompts[i], GREEDY, f"s{i}"):
            final = out
        return final.outputs[0].token_ids

    async def leave(i: int) -> int:
        got = 0
        agen = llm.generate(prompts[i % len(prompts)], LEAVER, f"leaver{i}")
        async for _ in agen:
            got += 1
            if got == 1 + i % 3:
                break
        await agen.aclose()  # the client went away: the request is aborted
        return got

    async def storm():
        done = asyncio.gather(*(finish(i) for i in range(len(prompts))))
        left = asyncio.gather(*(leave(i) for i in range(16)))
        return await done, await left

    try:
        outputs, _ = asyncio.run(storm())
        assert outputs == expected
        deadline = 200
        while llm.num_pending_requests and deadline:
            deadline -= 1
            asyncio.run(asyncio.sleep(0.05))
    finally:
        llm.shutdown()
    stats = engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.kv_cache_usage == 0.0
