"""Logits parity with Hugging Face transformers on the golden fixtures (scripts/make_golden.py):
tiny random Llama (llama3 RoPE, biases), Mistral (sliding window), Qwen2 (q/k/v bias, tied),
Qwen3 (q/k norm, head_dim != hidden/heads, tied); and the MoE families: Mixtral (top-2
renormalised), Qwen2-MoE (top-4 not renormalised, shared expert, a dense layer), Qwen3-MoE
(q/k norm, tied). No torch needed here."""

from __future__ import annotations

import numpy as np
import pytest
from model_testing import GOLDEN_ARCHS, MOE_GOLDEN_ARCHS, PagedRunner, dense_logits, golden_path

from jaxserve.model.arch_config import ModelArchConfig
from jaxserve.model.loader import load_model

ATOL = 1e-4


def _golden(name):
    g = np.load(f"{golden_path(name)}/golden.npz")
    return [(g[f"prompt_{i}"].tolist(), g[f"logits_{i}"]) for i in range(len(g.files) // 2)]


@pytest.mark.parametrize("name", GOLDEN_ARCHS + MOE_GOLDEN_ARCHS)
def test_dense_logits_match_transformers(name):
    model, cfg, _ = load_model(golden_path(name), dtype="float32")
    for prompt, expected in _golden(name):
        assert np.std(expected) > 0.5  # fixture logits are far from uniform
        np.testing.assert_allclose(dense_logits(model, prompt), expected, atol=ATOL, rtol=0)


def test_fixture_configs_exercise_each_switch():
    cfgs = {name: ModelArchConfig.from_pretrained(golden_path(name)) for name in GOLDEN_ARCHS}
    assert (
        cfgs["llama"].rope.rope_type == "llama3" and cfgs["llama"].o_bias and cfgs["llama"].mlp_bias
    )
    assert cfgs["mistral"].layer_sliding_windows == (4, 4)
    assert cfgs["qwen2"].qkv_bias and not cfgs["qwen2"].o_bias and cfgs["qwen2"].tie_word_embeddings
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim == 24
    assert not cfgs["llama"].tie_word_embeddings
    moe = {
        name: ModelArchConfig.from_pretrained(golden_path(name)).moe for name in MOE_GOLDEN_ARCHS
    }
    assert moe["mixtral"].norm_topk_prob and moe["mixtral"].top_k == 2
    assert not moe["qwen2_moe"].norm_topk_prob and moe["qwen2_moe"].top_k == 4
    assert moe["qwen2_moe"].shared_expert_intermediate_size == 48
    assert moe["qwen2_moe"].sparse_layers == (True, False)
    assert moe["qwen3_moe"].norm_topk_prob and moe["qwen3_moe"].num_experts == 8


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen2_moe"])
def test_paged_logits_match_transformers(name):
    """Chunked prefill of the long prompt (past the sliding window) and the short prompt in the
    same ragged batch, then one decode step; every position against transformers."""
    model, _, _ = load_model(golden_path(name), dtype="float32")
    (p0, e0), (p1, e1) = _golden(name)
    runner = PagedRunner(model, {"p0": p0, "p1": p1}, block_size=4)
    got = {"p0": [], "p1": []}
    for schedule in ({"p0": 6, "p1": 2}, {"p0": 4, "p1": 1}, {"p0": 1}):
        for seq, logits in runner.step(schedule).items():
            got[seq].append(logits)
    np.testing.assert_allclose(np.concatenate(got["p0"]), e0, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.concatenate(got["p1"]), e1, atol=ATOL, rtol=0)


def test_bfloat16_load_tracks_transformers():
    """``dtype="auto"`` takes the fixtures' bfloat16; logits stay close to the float32 golden."""
    model, _, _ = load_model(golden_path("llama"))
    assert model.embed_tokens.weight[...].dtype == np.dtype("bfloat16")
    prompt, expected = _golden("llama")[0]
    err = np.abs(dense_logits(model, prompt) - expected).max()
    assert err < 0.1 * np.abs(expected).max(), err
