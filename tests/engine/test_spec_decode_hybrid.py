"""Speculative decoding over the hybrid KV cache, end to end on the Mistral golden fixture (two
layers, both sliding over a 4-token window; float32): greedy tokens with speculation on equal
those with it off (logprobs within float tolerance), through windows that free blocks behind
them, rejected drafts and a second round from the prefix cache; the pool empties out.

* n-gram, the hybrid cache on: one KV-cache group, a sliding one.
* draft model on a target with a full-attention group (the fixture's config with its second
  layer made global: groups full + window 4): the draft (the fixture itself) keeps its cache on
  the full group's tables (``ModelRunner.draft_kv_group``).
* draft model on the fixture as it is (every layer slides): refused at start-up, one line naming
  ``--speculative-config``, unless ``--disable-hybrid-kv-cache-manager``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import numpy as np
import pytest
from conftest import XLA_CACHE_DIR
from engine_testing import engine_args, step_until_done

from jaxserve.sampling_params import SamplingParams

MISTRAL = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "golden", "mistral"
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True)
K = 3


def _prompts(vocab_size: int) -> list[list[int]]:
    golden = np.load(os.path.join(MISTRAL, "golden.npz"))
    rng = np.random.default_rng(0)
    rand = [[1] + rng.integers(3, vocab_size, n).tolist() for n in (40, 70)]
    pattern = rng.integers(3, vocab_size, 5).tolist()
    return [golden["prompt_0"].tolist(), golden["prompt_1"].tolist(), *rand, [1] + pattern * 8]


def _args(model: str, spec: dict | None, **overrides):
    return engine_args(
        model,
        XLA_CACHE_DIR,
        token_buckets="32",
        max_num_batched_tokens=32,
        max_num_seqs=4,
        num_gpu_blocks_override=100,
        warmup=False,
        speculative_config=json.dumps(spec) if spec else None,
        **overrides,
    )


def _run(engine, prompts) -> list:
    """Every prompt, twice (the second round from the prefix cache); per request (tokens,
    logprobs of the chosen tokens)."""
    results = []
    for tag in ("a", "b"):
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}{i}", p, GREEDY)
        done = step_until_done(engine)
        results += [done[f"{tag}{i}"] for i in range(len(prompts))]
    kv = engine.scheduler.kv_cache_manager
    assert kv.usage == 0.0 and not kv.req_to_blocks  # no block leaked
    return results


def _on_and_off(engine, prompts):
    """The engine (speculation on) and a twin on its runner with speculation off: their
    outputs, and the on engine's stats."""
    from jaxserve.engine.llm_engine import LLMEngine

    spec = engine.config.speculative
    on = _run(engine, prompts)
    stats = engine.get_stats()
    runner = engine.runner
    runner.reset_requests()
    runner.set_speculative_config(None)
    try:
        off_engine = LLMEngine(
            dataclasses.replace(engine.config, speculative=None),
            runner,
            engine.arch,
            None,
            engine.generation_config,
        )
        off = _run(off_engine, prompts)
    finally:
        runner.set_speculative_config(spec)
    return on, off, stats


def _assert_same(on, off):
    assert [t for t, _ in on] == [t for t, _ in off]
    for (_, a), (_, b) in zip(on, off):
        assert all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def mixed_model_dir(tmp_path_factory) -> str:
    """The Mistral fixture with its second layer global: KV-cache groups full + window 4."""
    path = str(tmp_path_factory.mktemp("mistral-mixed"))
    for name in os.listdir(MISTRAL):
        shutil.copy(os.path.join(MISTRAL, name), os.path.join(path, name))
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    hf["layer_types"] = ["sliding_attention", "full_attention"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    return path


def test_draft_model_refused_when_every_layer_slides():
    from jaxserve.engine.llm_engine import LLMEngine

    spec = {"method": "draft_model", "model": MISTRAL, "num_speculative_tokens": K}
    with pytest.raises(ValueError, match="--speculative-config") as e:
        LLMEngine.from_engine_args(_args(MISTRAL, spec))
    message = str(e.value)
    assert "\n" not in message and "--disable-hybrid-kv-cache-manager" in message


@pytest.mark.slow
def test_ngram_over_sliding_windows_equals_off():
    from jaxserve.engine.llm_engine import LLMEngine

    spec = {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    engine = LLMEngine.from_engine_args(_args(MISTRAL, spec))
    assert engine.runner.kv_layout.sliding_windows == (4,)
    on, off, stats = _on_and_off(engine, _prompts(engine.arch.vocab_size))
    _assert_same(on, off)
    assert stats.spec_decode_num_drafts_total > 0 and stats.prefix_cache_hits_total > 0


@pytest.mark.slow
@pytest.mark.parametrize("target", ["mixed", "all-sliding-hybrid-off"])
def test_draft_model_over_groups_equals_off(target, mixed_model_dir):
    from jaxserve.engine.llm_engine import LLMEngine

    spec = {"method": "draft_model", "model": MISTRAL, "num_speculative_tokens": K}
    if target == "mixed":
        engine = LLMEngine.from_engine_args(_args(mixed_model_dir, spec))
        assert engine.runner.kv_layout.sliding_windows == (None, 4)
    else:
        args = _args(MISTRAL, spec, disable_hybrid_kv_cache_manager=True)
        engine = LLMEngine.from_engine_args(args)
        assert engine.runner.kv_layout.sliding_windows == (None,)
    assert engine.runner.draft.kv_group == 0
    on, off, stats = _on_and_off(engine, _prompts(engine.arch.vocab_size))
    _assert_same(on, off)
    assert stats.spec_decode_num_drafts_total > 0
    assert stats.spec_decode_num_accepted_tokens_total > 0
