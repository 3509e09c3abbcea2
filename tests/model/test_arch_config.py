"""HF config.json -> ModelArchConfig: both transformers layouts, RoPE scaling, sliding windows,
per-architecture switches and the errors for what we do not support."""

from __future__ import annotations

import os

import numpy as np
import pytest
from model_testing import tiny_hf_config

from jaxserve.model import default_model_path
from jaxserve.model.arch_config import ModelArchConfig, ModelLoadError, RopeConfig
from jaxserve.model.layers.rotary import inverse_frequencies


def test_old_and_new_rope_layouts_agree():
    scaling = dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    old = ModelArchConfig.from_hf_config(
        tiny_hf_config(rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", **scaling))
    )
    new = ModelArchConfig.from_hf_config(
        tiny_hf_config(rope_parameters=dict(rope_theta=500000.0, rope_type="llama3", **scaling))
    )
    assert old == new
    assert old.rope == RopeConfig(theta=500000.0, rope_type="llama3", **scaling)
    legacy = ModelArchConfig.from_hf_config(
        tiny_hf_config(rope_scaling=dict(type="linear", factor=2.0))
    )
    assert legacy.rope == RopeConfig(theta=10000.0, rope_type="linear", factor=2.0)


def test_defaults_and_switches():
    llama = ModelArchConfig.from_hf_config(tiny_hf_config(num_key_value_heads=None, head_dim=None))
    assert (llama.num_kv_heads, llama.head_dim) == (4, 8)  # MHA, hidden / heads
    assert not (llama.qkv_bias or llama.o_bias or llama.mlp_bias or llama.qk_norm)
    assert llama.layer_sliding_windows == (None, None)
    assert llama.eos_token_ids == (2,) and llama.kv_elements_per_token == 2 * 2 * 4 * 8
    biased = ModelArchConfig.from_hf_config(
        tiny_hf_config(attention_bias=True, eos_token_id=[5, 6])
    )
    assert biased.qkv_bias and biased.o_bias and biased.eos_token_ids == (5, 6)
    qwen2 = ModelArchConfig.from_hf_config(tiny_hf_config(architectures=["Qwen2ForCausalLM"]))
    assert qwen2.qkv_bias and not qwen2.o_bias
    by_type = ModelArchConfig.from_hf_config(
        dict(tiny_hf_config(model_type="qwen3"), architectures=None)
    )
    assert by_type.architecture == "Qwen3ForCausalLM" and by_type.qk_norm


def test_sliding_windows_per_layer():
    mistral = ModelArchConfig.from_hf_config(
        tiny_hf_config(architectures=["MistralForCausalLM"], sliding_window=4096)
    )
    assert mistral.layer_sliding_windows == (4096, 4096)
    mistral_full = ModelArchConfig.from_hf_config(
        tiny_hf_config(architectures=["MistralForCausalLM"], sliding_window=None)
    )
    assert mistral_full.layer_sliding_windows == (None, None)
    # Qwen2 ignores sliding_window unless use_sliding_window; then layers >= max_window_layers.
    qwen_off = ModelArchConfig.from_hf_config(
        tiny_hf_config(
            architectures=["Qwen2ForCausalLM"], sliding_window=32, use_sliding_window=False
        )
    )
    assert qwen_off.layer_sliding_windows == (None, None)
    qwen_on = ModelArchConfig.from_hf_config(
        tiny_hf_config(
            architectures=["Qwen2ForCausalLM"],
            sliding_window=32,
            use_sliding_window=True,
            max_window_layers=1,
        )
    )
    assert qwen_on.layer_sliding_windows == (None, 32)
    typed = ModelArchConfig.from_hf_config(
        tiny_hf_config(
            architectures=["Qwen3ForCausalLM"],
            sliding_window=32,
            use_sliding_window=True,
            layer_types=["sliding_attention", "full_attention"],
        )
    )
    assert typed.layer_sliding_windows == (32, None)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(architectures=["GemmaForCausalLM"]), "unsupported architecture 'GemmaForCausalLM'"),
        (dict(hidden_act="relu"), "hidden_act 'relu'.*gelu_pytorch_tanh"),
        (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope_scaling type 'yarn'.*llama3"),
        (dict(rope_scaling=dict(rope_type="dynamic", factor=4.0)), "rope_scaling type 'dynamic'"),
        (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "lacks 'low_freq_factor'"),
        (dict(vocab_size=None), "required field 'vocab_size'"),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (
            dict(
                layer_types=["full_attention"] * 3,
                sliding_window=8,
                architectures=["MistralForCausalLM"],
            ),
            "layer_types has 3 entries",
        ),
    ],
)
def test_unsupported_configs_raise(overrides, match):
    with pytest.raises(ModelLoadError, match=match):
        ModelArchConfig.from_hf_config(tiny_hf_config(**overrides))


def test_llama3_inverse_frequencies():
    """Llama 3.1's scaling: short wavelengths kept, long ones divided by factor, smooth between."""
    rope = RopeConfig(
        theta=500000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    base = inverse_frequencies(RopeConfig(theta=500000.0), 128)
    scaled = inverse_frequencies(rope, 128)
    wavelen = 2 * np.pi / base
    short, long = wavelen < 8192 / 4, wavelen > 8192 / 1
    np.testing.assert_array_equal(scaled[short], base[short])
    np.testing.assert_allclose(scaled[long], base[long] / 8, rtol=1e-6)
    mid = ~short & ~long
    assert mid.any() and np.all((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8))
    linear = inverse_frequencies(RopeConfig(theta=500000.0, rope_type="linear", factor=4.0), 128)
    np.testing.assert_allclose(linear, base / 4, rtol=1e-6)


def test_default_model_path_points_into_the_package():
    path = default_model_path()
    assert path.endswith(os.path.join("jaxserve", "checkpoints", "tiny-llama"))
    assert os.path.isfile(os.path.join(path, "config.json"))
    assert os.path.isfile(os.path.join(path, "..", "..", "__init__.py"))
