"""The CPU's default token buckets start at one token (``min_token_bucket``): a lone decode
row runs in a 1-row step, two in a 2-row step, and their greedy tokens are the
dense oracle's, as in the 16-row steps the other engine tests use."""

from __future__ import annotations

from conftest import XLA_CACHE_DIR
from engine_testing import engine_args

from jaxserve.sampling_params import SamplingParams


def test_default_cpu_buckets_start_at_one_and_match_the_oracle(model_dir, prompts, oracle, run):
    from conftest import MAX_TOKENS

    from jaxserve.engine.llm_engine import LLMEngine

    args = engine_args(
        model_dir, XLA_CACHE_DIR, token_buckets=None, max_num_batched_tokens=16, warmup=False
    )
    engine = LLMEngine.from_engine_args(args)
    runner = engine.runner
    assert runner.token_buckets == (1, 2, 4, 8, 16)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    seen: set[int] = set()
    dispatch = runner.dispatch

    def spy(sched, token_mask=None):
        pending = dispatch(sched, token_mask)
        if pending is not None:
            seen.add(pending.batch.token_bucket)
        return pending

    runner.dispatch = spy
    for group in ([0], [1, 2]):  # alone (1-row steps), then two at once (2-row decode steps)
        out = run(engine, [(f"r{i}", prompts[i], greedy) for i in group])
        for i in group:
            assert out[f"r{i}"].outputs[0].token_ids == oracle[i], i
    assert {1, 2} <= seen, seen
    assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == (
        engine.scheduler.kv_cache_manager.block_pool.num_blocks - 1
    )
