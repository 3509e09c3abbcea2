"""Gemma through the engine: greedy tokens equal the dense oracle's under chunked prefill,
prefix caching and preemption, on the Gemma 3 fixture (windows of 4 tokens on two of its three
layers, local and global RoPE, q/k norms) with prompts of up to 100 tokens over 8-token blocks;
and greedy tokens and log-probabilities equal transformers' on the fixture's prompts."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
from conftest import XLA_CACHE_DIR
from engine_testing import engine_args, make_prompts, variant_config

from jaxserve.sampling_params import SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden", "gemma3")


@pytest.fixture(scope="module")
def gemma():
    """The Gemma 3 fixture's model, a warmed-up runner (8-token blocks) shared by every engine
    here, its tokenizer and 12 prompts (every fourth sharing 40 tokens with the one before)."""
    from jaxserve.model.loader import load_model
    from jaxserve.tokenizer import get_tokenizer
    from jaxserve.worker.model_runner import ModelRunner

    model, arch, gen = load_model(FIXTURE, "float32")
    config = engine_args(
        FIXTURE,
        XLA_CACHE_DIR,
        block_size=8,
        token_buckets="16,64",
        max_num_batched_tokens=64,
        max_num_seqs=16,
    ).create_engine_config(arch.max_position_embeddings)
    runner = ModelRunner(model, arch, config, warmup_sampling=(GREEDY,))
    spec = runner.initialize_kv_cache()
    runner.warmup(progress=False)
    return types.SimpleNamespace(
        model=model,
        arch=arch,
        generation_config=gen,
        config=variant_config(config, num_gpu_blocks=spec.num_blocks),
        runner=runner,
        tokenizer=get_tokenizer(FIXTURE),
        prompts=make_prompts(arch.vocab_size, num=12, seed=7),
    )


def _engine(gemma, **knobs):
    from jaxserve.engine.llm_engine import LLMEngine

    gemma.runner.reset_requests()
    config = variant_config(gemma.config, **knobs)
    return LLMEngine(config, gemma.runner, gemma.arch, gemma.tokenizer, gemma.generation_config)


def _run(engine, requests):
    from conftest import run_to_completion

    return run_to_completion(engine, requests)


@pytest.fixture(scope="module")
def oracle(gemma):
    from jaxserve.model.dense_oracle import generate_dense

    return [generate_dense(gemma.model, p, MAX_TOKENS) for p in gemma.prompts]


@pytest.mark.slow
@pytest.mark.parametrize(
    "knobs",
    [
        dict(long_prefill_token_threshold=16, enable_prefix_caching=True),
        dict(long_prefill_token_threshold=4096, enable_prefix_caching=False, max_num_seqs=1),
        # The hybrid KV cache's three groups (global, and one per local layer): a block holds
        # one layer's K/V, and the longest request (141 + 10 tokens) may hold 39 blocks at
        # once (19 global, 10 per window for a 64-token chunk: blocks_per_sequence), so 40
        # leave it room alone and the twelve requests must preempt.
        dict(num_gpu_blocks=40, long_prefill_token_threshold=32),
    ],
    ids=["chunked-prefix-caching", "whole-prefill-one-at-a-time", "preemption"],
)
def test_gemma_greedy_equals_dense_oracle(gemma, oracle, knobs):
    assert max(map(len, gemma.prompts)) > 64  # chunked: longer than the token budget
    engine = _engine(gemma, **knobs)
    done = _run(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(gemma.prompts)])
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(len(gemma.prompts))] == oracle
    stats = engine.get_stats()
    if knobs.get("enable_prefix_caching"):
        assert stats.prefix_cache_hits_total > 0
    if "num_gpu_blocks" in knobs:
        assert stats.num_preemptions_total > 0
    assert stats.kv_cache_usage == 0.0 and stats.num_running_reqs == 0


@pytest.mark.slow
def test_gemma_engine_greedy_tokens_and_logprobs_equal_transformers(gemma):
    """The fixture prompts through the engine (one batch): transformers' greedy tokens, and
    each returned top-5 log-probability within 1e-4 of transformers' log-softmax."""
    golden = np.load(os.path.join(FIXTURE, "golden.npz"))
    n = sum(f.startswith("prompt_") for f in golden.files)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    done = _run(
        _engine(gemma), [(f"p{i}", golden[f"prompt_{i}"].tolist(), params) for i in range(n)]
    )
    for i in range(n):
        out = done[f"p{i}"].outputs[0]
        assert out.token_ids == golden[f"greedy_{i}"].tolist()
        want = golden[f"greedy_logprobs_{i}"]  # [16, vocab]
        for pos, top in enumerate(out.logprobs):
            assert len(top) >= 5 and out.token_ids[pos] in top
            for token, lp in top.items():
                assert abs(lp.logprob - want[pos, token]) < 1e-4, (i, pos, token)
