"""Speculative decoding with the draft model (the bundled model's 1-layer draft) end to end:
greedy outputs equal to the dense oracle's while speculation turns off and on by batch size
(``disable_by_batch_size``: the draft's cache catches up when it comes back), with the async
and the synchronous loop, drafts accepted, and no KV block leaked."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from engine_testing import BUNDLED

from jaxserve.sampling_params import SamplingParams

DRAFT = os.fspath(BUNDLED) + "-draft"
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def draft_engine():
    if not os.path.isfile(os.path.join(DRAFT, "config.json")):
        pytest.skip("the bundled draft model is missing")
    from jaxserve.config import EngineArgs
    from jaxserve.engine.llm_engine import LLMEngine

    spec = {
        "method": "draft_model",
        "model": DRAFT,
        "num_speculative_tokens": 3,
        "disable_by_batch_size": 2,
    }
    args = EngineArgs(
        model=os.fspath(BUNDLED),
        dtype="float32",
        attention_backend="xla",
        token_buckets="16,64",
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=256,
        num_gpu_blocks_override=64,
        warmup=False,
        compilation_cache_dir="",
        speculative_config=json.dumps(spec),
    )
    return LLMEngine.from_engine_args(args)


TEXTS = ("Once upon a time", "The king said unto them", "And God said", "My father")


@pytest.fixture(scope="module")
def oracle(draft_engine):
    """The dense reference generator's greedy tokens for each text (and its max_tokens)."""
    from jaxserve.model.dense_oracle import generate_dense
    from jaxserve.model.loader import load_model

    target, _, _ = load_model(os.fspath(BUNDLED), "float32")
    tok = draft_engine.tokenizer
    lengths = [MAX_TOKENS + 8 * i for i in range(len(TEXTS))]
    return [(n, generate_dense(target, tok.encode(t), n)) for t, n in zip(TEXTS, lengths)]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_draft_model_outputs_equal_the_oracle(draft_engine, oracle, async_scheduling):
    from jaxserve.engine.llm_engine import LLMEngine

    base = draft_engine
    config = dataclasses.replace(
        base.config,
        scheduler=dataclasses.replace(base.config.scheduler, async_scheduling=async_scheduling),
    )
    base.runner.reset_requests()
    engine = LLMEngine(config, base.runner, base.arch, base.tokenizer, base.generation_config)
    # Four requests of different lengths: more than disable_by_batch_size (2) at first, so
    # speculation starts off and comes on as they finish (their draft caches caught up).
    for i, (text, (n, _)) in enumerate(zip(TEXTS, oracle)):
        engine.add_request(
            str(i), text, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        )
    done, ledgers = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
                ledgers[out.request_id] = out.ledgers[0]
    assert [done[str(i)] for i in range(len(TEXTS))] == [want for _, want in oracle]
    # 0 and 1 finish while more than 2 requests remain: no drafts; 2 and 3 speculate after,
    # from draft caches that had fallen behind
    assert [ledgers[str(i)].num_drafts > 0 for i in range(len(TEXTS))] == [False, False, True, True]
    stats = engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens_total > 0
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_gpu_blocks - 1 and not kv.req_to_blocks
