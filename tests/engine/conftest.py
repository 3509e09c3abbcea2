"""Session fixtures for the engine tests: one model, one warmed-up runner shared by every engine
(engines differ only in scheduler/cache knobs), and the dense oracle's outputs."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import types

import pytest
from engine_testing import engine_args, make_model_dir, make_prompts, variant_config

MAX_TOKENS = 12
XLA_CACHE_DIR = os.path.join(tempfile.gettempdir(), f"jaxserve-test-xla-{os.getuid()}")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    return make_model_dir(str(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="session")
def base(model_dir):
    """Model, tokenizer, resolved config and a warmed-up ModelRunner (runner max_num_seqs 256, so
    sequence bucket = token bucket; engines with fewer seqs just pad more)."""
    from jaxserve.model.loader import load_model
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.tokenizer import get_tokenizer
    from jaxserve.worker.model_runner import ModelRunner

    model, arch, gen = load_model(model_dir, "float32")
    config = engine_args(model_dir, XLA_CACHE_DIR).create_engine_config(
        arch.max_position_embeddings
    )
    runner = ModelRunner(
        model,
        arch,
        config,
        warmup_sampling=(SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)),
    )
    spec = runner.initialize_kv_cache()
    runner.warmup(progress=False)
    config = variant_config(config, num_gpu_blocks=spec.num_blocks)
    return types.SimpleNamespace(
        model=model,
        arch=arch,
        generation_config=gen,
        config=config,
        runner=runner,
        tokenizer=get_tokenizer(model_dir),
        num_blocks=spec.num_blocks,
    )


@pytest.fixture(scope="session")
def make_engine(base):
    """``make_engine(**knobs)``: a fresh LLMEngine (scheduler, empty prefix cache) on the shared
    runner. Knobs are SchedulerConfig / CacheConfig field names, plus ``num_gpu_blocks`` and
    ``speculative`` (a SpeculativeConfig; the n-gram method only: the runner is shared)."""
    from jaxserve.engine.llm_engine import LLMEngine

    def make(speculative=None, **knobs):
        base.runner.reset_requests()
        base.runner.set_speculative_config(speculative)
        config = dataclasses.replace(variant_config(base.config, **knobs), speculative=speculative)
        return LLMEngine(config, base.runner, base.arch, base.tokenizer, base.generation_config)

    return make


@pytest.fixture(scope="session")
def prompts(base) -> list[list[int]]:
    return make_prompts(base.arch.vocab_size)


@pytest.fixture(scope="session")
def oracle(base, prompts) -> list[list[int]]:
    """Greedy tokens of the dense reference generator (full recompute), one list per prompt."""
    from jaxserve.model.dense_oracle import generate_dense

    return [generate_dense(base.model, p, MAX_TOKENS, eos_token_ids=[2]) for p in prompts]


def run_to_completion(engine, requests, max_steps=5000):
    """Adds ``requests`` [(id, prompt, params)] and steps until all finish; returns
    {id: final RequestOutput}."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests(), "engine did not finish"
    return done


@pytest.fixture(scope="session")
def run():
    return run_to_completion
