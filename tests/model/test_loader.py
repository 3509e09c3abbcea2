"""Weight loading: safetensors (single file and sharded with an index), dummy weights, generation
config, and the errors a user sees for a bad model directory."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_testing import dense_logits, golden_path, tiny_hf_config
from safetensors.numpy import load_file, save_file

from jaxserve.model.arch_config import ModelArchConfig, ModelLoadError
from jaxserve.model.loader import (
    abstract_model,
    eos_token_ids,
    load_model,
    read_generation_config,
    resolve_dtype,
)
from jaxserve.model.models.llama import LlamaForCausalLM
from jaxserve.model.presets import PRESET_HF_CONFIGS
from jaxserve.model.weight_mapping import COPY, FLATTEN, Layout, TensorSource

PROMPT = [1, 17, 42, 99, 3]


@pytest.fixture
def llama_dir(tmp_path):
    """A writable copy of the llama golden fixture."""
    d = tmp_path / "llama"
    shutil.copytree(golden_path("llama"), d)
    return d


def _rewrite_config(model_dir, **changes):
    path = model_dir / "config.json"
    hf = json.loads(path.read_text())
    hf.update(changes)
    path.write_text(json.dumps(hf))


def test_hf_name_mapping():
    cfg = ModelArchConfig.from_hf_config(tiny_hf_config())

    def source(*path):
        return LlamaForCausalLM.weight_source(path, cfg, "hf")

    linear_1, linear_2 = Layout("linear", 1), Layout("linear", 2)
    assert source("embed_tokens", "weight") == TensorSource(
        ("model.embed_tokens.weight", "embed_tokens.weight"), COPY
    )
    assert source("lm_head", "weight") == TensorSource(("lm_head.weight",), COPY)
    assert source("norm", "weight") == TensorSource(("model.norm.weight", "norm.weight"), COPY)
    assert source("layers", 3, "self_attn", "q_proj", "weight") == TensorSource(
        ("model.layers.3.self_attn.q_proj.weight", "layers.3.self_attn.q_proj.weight"), linear_1
    )
    assert source("layers", 0, "self_attn", "o_proj", "weight") == TensorSource(
        ("model.layers.0.self_attn.o_proj.weight", "layers.0.self_attn.o_proj.weight"), linear_2
    )
    assert source("layers", 0, "self_attn", "k_proj", "bias") == TensorSource(
        ("model.layers.0.self_attn.k_proj.bias", "layers.0.self_attn.k_proj.bias"), FLATTEN
    )
    assert source("layers", 1, "self_attn", "q_norm", "weight") == TensorSource(
        ("model.layers.1.self_attn.q_norm.weight", "layers.1.self_attn.q_norm.weight"), COPY
    )
    assert source("layers", 1, "mlp", "down_proj", "weight") == TensorSource(
        ("model.layers.1.mlp.down_proj.weight", "layers.1.mlp.down_proj.weight"), linear_1
    )
    # torch Linear [out, in] shapes of our [in..., out...] kernels
    assert linear_1.stored_shape((64, 4, 16)) == (64, 64)  # q_proj [e, h, d] <- [h*d, e]
    assert linear_2.stored_shape((4, 16, 32)) == (32, 64)  # o_proj [h, d, e] <- [e, h*d]
    assert FLATTEN.stored_shape((4, 16)) == (64,)


def test_every_parameter_maps_to_a_fixture_tensor():
    for name in ("llama", "qwen3"):
        cfg = ModelArchConfig.from_pretrained(golden_path(name))
        tensors = load_file(os.path.join(golden_path(name), "model.safetensors"))
        names = set()
        model = abstract_model(cfg, jnp.float32)
        for path, var in nnx.to_flat_state(nnx.state(model)):
            source = model.weight_source(path, cfg, "hf")
            assert tensors[source.name].shape == source.layout.stored_shape(var.shape), source.name
            names.add(source.name)
        assert names == set(tensors), set(tensors) ^ names


def test_sharded_safetensors_with_index(llama_dir, tmp_path):
    tensors = load_file(llama_dir / "model.safetensors")
    os.remove(llama_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, llama_dir / fname)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (llama_dir / "model.safetensors.index.json").write_text(json.dumps(index))

    sharded, _, _ = load_model(str(llama_dir), dtype="float32")
    single, _, _ = load_model(golden_path("llama"), dtype="float32")
    np.testing.assert_array_equal(dense_logits(sharded, PROMPT), dense_logits(single, PROMPT))

    os.remove(llama_dir / "model-00002-of-00002.safetensors")
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_model(str(llama_dir), dtype="float32")


def test_missing_directory_config_and_weights(tmp_path):
    with pytest.raises(ModelLoadError, match="model directory not found: .*nowhere"):
        load_model(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="config.json not found"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights file"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(str(tmp_path))


def test_unsupported_architecture(llama_dir):
    _rewrite_config(llama_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        ModelLoadError,
        match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM",
    ):
        load_model(str(llama_dir))


def test_shape_mismatch_names_the_tensor(llama_dir):
    _rewrite_config(llama_dir, intermediate_size=32)
    with pytest.raises(
        ModelLoadError,
        match=r"shape mismatch for tensor model\.layers\.0\.mlp\.down_proj\.weight: "
        r"expected \[64, 32\], got \[64, 64\]",
    ):
        load_model(str(llama_dir))


def test_missing_tensor_is_named(llama_dir):
    tensors = load_file(llama_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.bias"]
    save_file(tensors, llama_dir / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"tensor model\.layers\.1\.self_attn\.v_proj\.bias not found"
    ):
        load_model(str(llama_dir))


def test_resolve_dtype():
    assert (
        resolve_dtype(
            "auto", ModelArchConfig.from_hf_config(tiny_hf_config(torch_dtype="bfloat16"))
        )
        == jnp.bfloat16
    )
    assert (
        resolve_dtype("auto", ModelArchConfig.from_hf_config(tiny_hf_config(dtype="float16")))
        == jnp.bfloat16
    )
    assert resolve_dtype("auto", ModelArchConfig.from_hf_config(tiny_hf_config())) == jnp.float32
    assert (
        resolve_dtype(
            "float32", ModelArchConfig.from_hf_config(tiny_hf_config(torch_dtype="bfloat16"))
        )
        == jnp.float32
    )


def test_bad_dtype_and_load_format(llama_dir):
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(llama_dir), dtype="float16")
    with pytest.raises(ValueError, match="load_format"):
        load_model(str(llama_dir), load_format="pt")
    with pytest.raises(ModelLoadError, match="orbax params directory not found"):
        load_model(str(llama_dir), load_format="orbax")


def test_dummy_from_directory_dict_and_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    model, cfg, gen = load_model(str(tmp_path), dtype="float32", load_format="dummy")  # no weights
    assert gen == {} and cfg.vocab_size == 128
    logits = dense_logits(model, PROMPT)
    assert logits.shape == (5, 128) and np.isfinite(logits).all() and np.abs(logits).max() > 0

    m0, _, _ = load_model(tiny_hf_config(), dtype="float32", load_format="dummy", seed=0)
    m1, _, _ = load_model(tiny_hf_config(), dtype="float32", load_format="dummy", seed=1)
    assert not np.array_equal(
        np.asarray(m0.embed_tokens.weight[...]), np.asarray(m1.embed_tokens.weight[...])
    )

    with pytest.raises(ModelLoadError, match="dummy presets: llama-3.1-8b"):
        load_model("no-such-model", load_format="dummy")


def test_presets_have_the_published_parameter_counts():
    """Shapes only (``nnx.eval_shape``): nothing is allocated."""
    expected = {
        "llama-3.1-8b": 8_030_261_248,
        "llama-3.2-1b": 1_235_814_400,
        "qwen2.5-0.5b": 494_032_768,
        "qwen3-0.6b": 596_049_920,
        "gemma-2-2b": 2_614_341_888,
        "gemma-3-1b": 999_885_952,
    }
    for name, count in expected.items():
        cfg = ModelArchConfig.from_hf_config(PRESET_HF_CONFIGS[name])
        state = nnx.state(abstract_model(cfg, jnp.bfloat16))
        assert sum(x.size for x in jax.tree.leaves(state)) == count, name


def test_generation_config_and_eos_ids():
    cfg = ModelArchConfig.from_pretrained(golden_path("llama"))
    gen = read_generation_config(golden_path("llama"))
    assert gen["eos_token_id"] == [2, 3]
    assert eos_token_ids(gen, cfg) == (2, 3)
    assert eos_token_ids({"eos_token_id": 7}, cfg) == (7,)
    assert eos_token_ids({}, cfg) == (2,)  # falls back to config.json
