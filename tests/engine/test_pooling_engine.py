"""The pooling runner end to end (``LLM.embed``) against transformers' float32 hidden states of
the tiny random Qwen3 embedding fixture (scripts/make_pooling_fixture.py): LAST (the fixture's
sentence-transformers config, normalised), MEAN and CLS summed across prefill chunks, prefix
caching, Matryoshka ``dimensions``, and the refusals."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "pooling", "qwen3-embed")
EXPECTED = np.load(os.path.join(FIXTURE, "expected.npz"))
PROMPTS = [EXPECTED[f"prompt_{i}"].tolist() for i in range(3)]
ATOL = 1e-4


def _llm(**overrides) -> LLM:
    # a 16-token chunk limit: the 42-token prompt is prefilled in three steps, batched with
    # the others
    args = dict(
        dtype="float32",
        attention_backend="xla",
        max_model_len=128,
        num_gpu_blocks_override=32,
        block_size=16,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=16,
        token_buckets="64",
        max_num_seqs=4,
        warmup=False,
    )
    return LLM(FIXTURE, **{**args, **overrides})


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x)


@pytest.fixture(scope="module")
def last_llm():
    return _llm(runner="pooling", warmup=True)  # pool_step compiled with the forward


def test_last_pooling_matches_transformers(last_llm):
    config = last_llm.llm_engine.config
    assert (config.model.pooling_type, config.model.pooling_normalize) == ("LAST", True)
    manager = last_llm.llm_engine.scheduler.kv_cache_manager
    free_before = manager.num_free_blocks
    runner = last_llm.llm_engine.runner
    compiled = runner.compile_counts()
    assert compiled["pool"] == 1  # the one token bucket, at warm-up
    outs = last_llm.embed(PROMPTS, use_tqdm=False)
    for i, out in enumerate(outs):
        got = np.asarray(out.outputs.embedding)
        np.testing.assert_allclose(got, _unit(EXPECTED[f"last_{i}"]), atol=ATOL)
        assert out.prompt_token_ids == PROMPTS[i]
    raw = last_llm.embed(PROMPTS, normalize=False, use_tqdm=False)  # prefix-cache hits now
    for i, out in enumerate(raw):
        np.testing.assert_allclose(out.outputs.embedding, EXPECTED[f"last_{i}"], atol=ATOL)
    assert manager.num_free_blocks == free_before  # every block back (cached ones evictable)
    assert runner.compile_counts() == compiled  # serving compiled nothing more
    ledger = last_llm.llm_engine.get_ledger(raw[2].request_id)  # 42 tokens: 2 blocks cached
    assert ledger["prefix_cache_hit_tokens"]["device"] == 32, ledger


def test_matryoshka_dimensions(last_llm):
    (out,) = last_llm.embed([PROMPTS[0]], dimensions=8, use_tqdm=False)
    np.testing.assert_allclose(out.outputs.embedding, _unit(EXPECTED["last_0"][:8]), atol=ATOL)
    with pytest.raises(ValueError, match="^dimensions"):
        last_llm.embed([PROMPTS[0]], dimensions=65, use_tqdm=False)


def test_pooling_engine_generates_nothing(last_llm):
    with pytest.raises(ValueError, match="--runner pooling"):
        last_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert last_llm.llm_engine.get_num_unfinished_requests() == 0


def _pooled(kind: str) -> LLM:
    # priority scheduling and 7 usable KV blocks: room for the three prompts at once (5
    # blocks), and for a preemption (test_preempted_mean_request_is_recomputed)
    return _llm(
        runner="pooling",
        pooler_config=f'{{"pooling_type": "{kind}", "normalize": false}}',
        scheduling_policy="priority",
        num_gpu_blocks_override=8,
    )


@pytest.fixture(scope="module")
def mean_llm():
    return _pooled("MEAN")


def _check_all(llm: LLM, kind: str) -> None:
    assert not llm.llm_engine.config.cache.enable_prefix_caching
    for i, out in enumerate(llm.embed(PROMPTS, use_tqdm=False)):
        want = EXPECTED[f"{kind.lower()}_{i}"]
        np.testing.assert_allclose(out.outputs.embedding, want, atol=ATOL)


def test_mean_pooling_across_chunks(mean_llm):
    _check_all(mean_llm, "MEAN")


def test_cls_pooling_across_chunks():
    _check_all(_pooled("CLS"), "CLS")


def test_preempted_mean_request_is_recomputed(mean_llm):
    """A less urgent MEAN request preempted mid-prefill (a more urgent one needs 6 of the 7
    blocks): its partial sum is dropped and its recomputation pools the whole prompt once."""
    engine = mean_llm.llm_engine
    params = SamplingParams(max_tokens=0)
    engine.add_request("low", PROMPTS[2], params, priority=1, final_only=True)
    done = {}
    engine.step()  # the first two 16-token chunks of "low" (2 of its 3 blocks held)
    engine.step()
    engine.add_request("high", PROMPTS[2] + [5] * 40, params, priority=0, final_only=True)
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    np.testing.assert_allclose(done["low"].pooled, EXPECTED["mean_2"], atol=ATOL)
    assert engine.get_ledger("low")["num_preemptions"] >= 1
    assert engine.scheduler.kv_cache_manager.num_free_blocks == 7


def test_generate_engine_refuses_embed():
    llm = _llm()  # the fixture says Qwen3ForCausalLM: --runner auto picks generate
    assert llm.llm_engine.config.model.runner == "generate"
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed([PROMPTS[0]], use_tqdm=False)
