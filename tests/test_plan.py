"""``jaxserve plan``: sizing from the config alone agrees with the engine it predicts.

On CPU the engine sizes its KV pool by its CPU default; ``plan --device cpu`` must give the
blocks the engine actually allocates (within 2%) for the tiny fixtures: the bundled model, Gemma 3
with its sliding-window KV-cache groups, an FP8 KV cache. On accelerators it answers for the real
configs (Llama-3.1-8B/70B presets) with the same functions; those figures are checked for their
parts (weights, KV bytes per token) and the verdict's logic."""

from __future__ import annotations

import json
import os

import pytest

from jaxserve.model import default_model_path
from jaxserve.plan import DEVICES, format_plan, plan

HERE = os.path.dirname(os.path.abspath(__file__))
GEMMA3 = os.path.join(HERE, "fixtures", "golden", "gemma3")

ENGINE_CASES = {
    "bundled": (None, dict(max_model_len=1024, max_num_seqs=8)),
    "bundled-fp8-kv": (None, dict(max_model_len=512, max_num_seqs=4, kv_cache_dtype="fp8")),
    "gemma3-hybrid": (GEMMA3, dict(max_model_len=256, max_num_seqs=4)),
}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_plan_agrees_with_the_blocks_the_engine_allocates(case):
    from jaxserve.config import EngineArgs
    from jaxserve.engine.llm_engine import LLMEngine

    path, knobs = ENGINE_CASES[case]
    model = path or os.fspath(default_model_path())
    common = dict(dtype="float32", max_num_batched_tokens=64, **knobs)
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            attention_backend="xla",
            token_buckets="64",
            warmup=False,
            compilation_cache_dir="",
            **common,
        )
    )
    allocated = engine.runner.kv_spec.num_blocks
    predicted = plan(model, device="cpu", suggest=False, **common)
    assert abs(predicted.kv_blocks - allocated) <= 0.02 * allocated
    assert predicted.kv_bytes_per_token == engine.runner.kv_spec.bytes_per_token_per_device
    assert predicted.fits and predicted.max_concurrent_sequences >= knobs["max_num_seqs"]


def test_llama_8b_on_one_h200():
    p = plan("llama-3.1-8b", device="h200", max_model_len=8192)
    assert p.weight_bytes == 16_060_522_496  # 8.03e9 bfloat16 parameters
    assert p.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads
    assert p.fits and 0 < p.max_concurrent_sequences < p.max_num_seqs
    # the blocks are the engine's rule: the budget left over, in blocks
    budget = int(0.9 * DEVICES["h200"].bytes_limit()) - p.weight_bytes - p.activation_bytes
    assert p.kv_blocks == budget // (p.kv_bytes_per_token * p.block_size)
    assert any("fp8" in s for s in p.suggestions)
    assert "fits" in format_plan(p)


def test_llama_70b_needs_more_than_one_device_and_says_how_many():
    one = plan("llama-3.1-70b", device="h200", max_model_len=32768)
    assert not one.fits and one.kv_blocks == 0
    assert any(s.startswith("--tensor-parallel-size") for s in one.suggestions)
    four = plan("llama-3.1-70b", device="h200", tensor_parallel_size=4, max_model_len=32768)
    assert four.fits
    assert four.weight_bytes < one.weight_bytes / 3.9  # split, but norms are replicated
    assert four.kv_bytes_per_token == one.kv_bytes_per_token // 4


def test_plan_json_and_refusals(capsys):
    from jaxserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "llama-3.1-8b", "--device", "v6e", "--max-model-len", "4096", "--json"])
    assert e.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["device"] == "v6e" and out["kv_blocks"] > 2
    with pytest.raises(SystemExit) as e:
        main(["plan", "llama-3.1-8b", "--tensor-parallel-size", "3"])
    assert e.value.code == 2
    assert "tensor_parallel_size (3)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["plan", "no-such-model"])
    assert e.value.code == 2


def test_parallelism_doc_table_is_what_plan_says():
    """docs/PARALLELISM.md's table is ``python -m jaxserve.plan``'s output (regenerate it when
    sizing changes)."""
    from jaxserve.plan import docs_table

    doc = open(os.path.join(HERE, "..", "docs", "PARALLELISM.md")).read()
    assert docs_table() in doc
