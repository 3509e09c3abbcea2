"""The Gemma family beyond logits parity (tests/model/test_hf_parity.py): configs in every layout
in the wild, the fixtures exercising each Gemma switch, the shared layers' Gemma variants in
bfloat16, multimodal checkpoint names, and GGUF files written the way llama.cpp writes them."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_testing import dense_logits, golden_path

from jaxserve.model.arch_config import ModelArchConfig, ModelLoadError, RopeConfig
from jaxserve.model.layers.embedding import Embedding
from jaxserve.model.layers.mlp import ACTIVATIONS
from jaxserve.model.layers.norm import RMSNorm
from jaxserve.model.loader import abstract_model, load_model
from jaxserve.model.readers.safetensors_reader import SafetensorsReader

GEMMA3_4B_IT = {  # the config.json Google published for gemma-3-4b-it, abridged
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "eos_token_id": [1, 106],
    "torch_dtype": "bfloat16",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"},
}


def test_gemma3_multimodal_config_takes_transformers_defaults():
    cfg = ModelArchConfig.from_hf_config(GEMMA3_4B_IT)
    assert cfg.architecture == "Gemma3ForConditionalGeneration"
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262208)
    assert cfg.query_pre_attn_scalar == 256 and cfg.rms_norm_eps == 1e-6
    assert cfg.layer_sliding_windows == tuple(None if i % 6 == 5 else 1024 for i in range(34))
    assert cfg.rope == RopeConfig(theta=1e6, rope_type="linear", factor=8.0)
    assert cfg.sliding_rope == RopeConfig(theta=1e4)
    assert cfg.qk_norm and cfg.rms_norm_unit_offset and cfg.tie_word_embeddings
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (None, None)
    assert cfg.torch_dtype == "bfloat16" and cfg.eos_token_ids == (1, 106)
    assert cfg.max_position_embeddings == 131072


def test_gemma_configs_of_older_transformers():
    """transformers 4: Gemma 3's local base as rope_local_base_freq and the pattern as an int;
    Gemma 2 without layer_types alternates local (even) and global (odd) layers."""
    g3 = ModelArchConfig.from_hf_config(
        dict(
            architectures=["Gemma3ForCausalLM"],
            num_hidden_layers=8,
            sliding_window=512,
            sliding_window_pattern=4,
            rope_theta=500000.0,
            rope_local_base_freq=20000.0,
            rope_scaling=None,
        )
    )
    assert g3.layer_sliding_windows == (512, 512, 512, None) * 2
    assert (g3.rope, g3.sliding_rope) == (RopeConfig(theta=5e5), RopeConfig(theta=2e4))
    g2 = ModelArchConfig.from_hf_config(
        dict(model_type="gemma2", num_hidden_layers=4, hidden_act="gelu_pytorch_tanh")
    )
    assert g2.architecture == "Gemma2ForCausalLM"
    assert g2.layer_sliding_windows == (4096, None, 4096, None) and g2.sliding_rope is None
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert g2.rope == RopeConfig(theta=10000.0) and not g2.qk_norm
    g2_no_caps = ModelArchConfig.from_hf_config(
        dict(model_type="gemma2", attn_logit_softcapping=None, final_logit_softcapping=None)
    )
    assert (g2_no_caps.attn_logit_softcapping, g2_no_caps.final_logit_softcapping) == (None, None)


def test_gemma_configs_that_are_refused():
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        ModelArchConfig.from_hf_config(
            dict(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True)
        )
    with pytest.raises(ModelLoadError, match="hidden_act 'relu'"):
        ModelArchConfig.from_hf_config(dict(model_type="gemma2", hidden_activation="relu"))
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping must be positive"):
        ModelArchConfig.from_hf_config(dict(model_type="gemma2", attn_logit_softcapping=0))


def test_activation_names_agree_with_the_config_parser():
    from jaxserve.model.arch_config import SUPPORTED_ACTIVATIONS

    assert tuple(ACTIVATIONS) == SUPPORTED_ACTIVATIONS
    x = jnp.linspace(-4, 4, 9)
    tanh_gelu = 0.5 * x * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(ACTIVATIONS["gelu_pytorch_tanh"](x), tanh_gelu, atol=1e-6)


def test_bfloat16_embedding_scale_and_unit_offset_norm_round_like_transformers():
    """HF multiplies Gemma's embedding rows by sqrt(hidden) cast to the weight dtype (3072:
    55.4256 -> 55.5 in bfloat16), and its norm scales by (1 + w) in float32 before the cast."""
    emb = Embedding(4, 3072, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), scale=3072**0.5)
    rows = emb(jnp.arange(4))
    assert rows.dtype == jnp.bfloat16
    expected = emb.weight[...] * jnp.bfloat16(55.5)
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(expected, np.float32))

    norm = RMSNorm(64, 1e-6, jnp.bfloat16, unit_offset=True)
    w = jax.random.normal(jax.random.key(1), (64,), jnp.float32).astype(jnp.bfloat16)
    norm.weight.set_value(w)
    x = jax.random.normal(jax.random.key(2), (3, 64), jnp.float32).astype(jnp.bfloat16)
    xf = np.asarray(x, np.float32)
    normed = xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + 1e-6)
    hf = (normed * (1 + np.asarray(w, np.float32))).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(norm(x), np.float32), np.asarray(hf, np.float32))
    assert RMSNorm(8, 1e-6, jnp.float32, unit_offset=True).weight[...].sum() == 0  # identity


@functools.cache
def _fixture(name):
    model, cfg, _ = load_model(golden_path(name), dtype="float32")
    golden = np.load(os.path.join(golden_path(name), "golden.npz"))
    return model, cfg, golden


@pytest.mark.parametrize(
    "name,change",
    [
        ("gemma2", dict(attn_logit_softcapping=None)),
        ("gemma2", dict(final_logit_softcapping=None)),
        ("gemma2", dict(query_pre_attn_scalar=None)),
        ("gemma3", dict(sliding_rope=None)),
        ("gemma3", dict(layer_sliding_windows=(None, None, None))),
    ],
    ids=["attn-softcap", "final-softcap", "query-scalar", "local-rope", "windows"],
)
def test_each_gemma_switch_moves_the_fixture_logits(name, change):
    """Guards the parity tests: with one switch of the fixture's config undone, the same
    weights give logits far outside the 1e-4 tolerance (so parity checks that switch)."""
    model, cfg, golden = _fixture(name)
    altered = dataclasses.replace(cfg, **change)
    graphdef, _ = nnx.split(abstract_model(altered, jnp.float32))
    other = nnx.merge(graphdef, nnx.state(model))
    logits = dense_logits(other, golden["prompt_0"].tolist())
    assert np.abs(logits - golden["logits_0"]).max() > 0.05


def test_multimodal_checkpoint_in_either_naming(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint names its language model
    ``language_model.model.*`` (Google's published checkpoints; transformers 5 saves that
    layout too, as the fixture shows) or ``model.language_model.*`` (transformers 4.52-4.x);
    both load the same weights, and the vision tower's tensors are not read."""
    from safetensors.numpy import save_file

    src = golden_path("gemma3_mm")
    with SafetensorsReader(src) as reader:
        tensors = {n: reader.read(n) for n in reader.names()}
    assert any(n.startswith("vision_tower.") for n in tensors)
    assert "language_model.model.embed_tokens.weight" in tensors
    other = {
        n.replace("language_model.model.", "model.language_model.", 1): x
        for n, x in tensors.items()
    }
    assert not any(n.startswith("language_model.model.") for n in other)
    save_file(other, str(tmp_path / "model.safetensors"))
    for f in ("config.json", "generation_config.json"):
        (tmp_path / f).write_bytes(open(os.path.join(src, f), "rb").read())
    model, _, _ = _fixture("gemma3_mm")
    again, _, _ = load_model(str(tmp_path), dtype="float32")
    want = dict(nnx.to_flat_state(nnx.state(model)))
    got = dict(nnx.to_flat_state(nnx.state(again)))
    assert want.keys() == got.keys()
    for path, var in want.items():
        np.testing.assert_array_equal(np.asarray(got[path].get_value()), var.get_value())


# --- GGUF -------------------------------------------------------------------------------------


def _write_gemma_gguf(path, name, cfg, model, *, pattern=None, block_count=None):
    """The fixture as llama.cpp's converter writes a ``gemma2`` / ``gemma3`` GGUF: its
    metadata keys, tensors in torch layout with every norm stored as 1 + weight (through the
    family's own ``weight_source``), no q/k permutation, the character vocabulary."""
    gguf = pytest.importorskip("gguf")
    arch = name[: len("gemmaN")]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(block_count or cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(next(win for win in cfg.layer_sliding_windows if win))
    w.add_rope_freq_base(cfg.rope.theta)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope.factor)
        if pattern is not None:
            w.add_sliding_window_pattern(pattern)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for p, var in nnx.to_flat_state(nnx.state(model)):
        source = model.weight_source(p, cfg, "gguf")
        x = np.asarray(source.layout.to_stored(np.asarray(var.get_value())), np.float32)
        w.add_tensor(source.name, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _same_params(a, b):
    want = dict(nnx.to_flat_state(nnx.state(a)))
    got = dict(nnx.to_flat_state(nnx.state(b)))
    assert want.keys() == got.keys()
    for path, var in want.items():
        np.testing.assert_allclose(np.asarray(got[path].get_value()), var.get_value(), atol=1e-6)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gguf_gemma_loads_the_same_model(tmp_path, name):
    model, cfg, _ = _fixture(name)
    path = tmp_path / f"{name}.gguf"
    pattern = [w is not None for w in cfg.layer_sliding_windows] if name == "gemma3" else None
    _write_gemma_gguf(path, name, cfg, model, pattern=pattern)
    gguf = pytest.importorskip("gguf")
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert "blk.0.post_ffw_norm.weight" in names and "output.weight" not in names
    loaded, gcfg, _ = load_model(str(path), dtype="float32")
    _same_params(model, loaded)
    # GGUF carries no query_pre_attn_scalar: llama.cpp's rule gives head_dim below 27B (the
    # gemma3 fixture's 24 is its head_dim; the gemma2 fixture's 24 is not: 16).
    assert gcfg.query_pre_attn_scalar == cfg.head_dim
    expected = dataclasses.replace(
        cfg,
        query_pre_attn_scalar=cfg.head_dim,
        max_position_embeddings=gcfg.max_position_embeddings,
        bos_token_id=gcfg.bos_token_id,
        eos_token_ids=gcfg.eos_token_ids,
    )
    assert gcfg == dataclasses.replace(expected, torch_dtype="float32")


def test_gguf_gemma3_defaults_and_27b_attention_scale(tmp_path):
    """Without a pattern key, llama.cpp's Gemma 3 layout (every 6th layer global); 62 blocks
    (gemma-3-27b) take the attention scale from hidden / heads."""
    from jaxserve.model.readers.gguf_reader import gguf_hf_config, open_gguf

    model, cfg, _ = _fixture("gemma3")
    path = tmp_path / "g3.gguf"
    _write_gemma_gguf(path, "gemma3", cfg, model, block_count=62)
    hf = gguf_hf_config(open_gguf(str(path)), str(path))
    parsed = ModelArchConfig.from_hf_config(hf)
    assert parsed.query_pre_attn_scalar == cfg.hidden_size // cfg.num_heads
    assert parsed.layer_sliding_windows[:6] == (4,) * 5 + (None,)
    assert parsed.sliding_rope == RopeConfig(theta=1e4)
