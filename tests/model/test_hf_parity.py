"""Logits parity with Hugging Face transformers on the golden fixtures (scripts/make_golden.py):
tiny random Llama (llama3 RoPE, biases), Mistral (sliding window), Qwen2 (q/k/v bias, tied),
Qwen3 (q/k norm, head_dim != hidden/heads, tied), Gemma 2 (soft caps, alternating windows),
Gemma 3 (q/k norm, local/global RoPE, 2 local : 1 global), the language model of a Gemma 3
multimodal checkpoint; and the MoE families: Mixtral (top-2 renormalised), Qwen2-MoE (top-4
not renormalised, shared expert, a dense layer), Qwen3-MoE (q/k norm, tied). No torch needed
here."""

from __future__ import annotations

import numpy as np
import pytest
from model_testing import GOLDEN_ARCHS, MOE_GOLDEN_ARCHS, PagedRunner, dense_logits, golden_path

from jaxserve.model.arch_config import ModelArchConfig
from jaxserve.model.loader import load_model

ATOL = 1e-4


def _golden(name):
    g = np.load(f"{golden_path(name)}/golden.npz")
    n = sum(f.startswith("prompt_") for f in g.files)
    return [(g[f"prompt_{i}"].tolist(), g[f"logits_{i}"]) for i in range(n)]


@pytest.mark.parametrize(
    "name", [n for n in GOLDEN_ARCHS if not n.startswith("gemma")] + list(MOE_GOLDEN_ARCHS)
)
def test_dense_logits_match_transformers(name):
    """(The Gemma fixtures' prompt logits are checked by the greedy test below, in the same
    forward as their continuations.)"""
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
    g2, g3, mm = cfgs["gemma2"], cfgs["gemma3"], cfgs["gemma3_mm"]
    assert g2.layer_sliding_windows == (4, None, 4) and g2.sliding_rope is None
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (1.5, 8.0)
    assert g2.hidden_act == "gelu_pytorch_tanh" and g2.rms_norm_unit_offset
    for g in (g3, mm):
        assert g.layer_sliding_windows == (4, 4, None) and g.qk_norm and g.head_dim == 24
        assert (g.rope.theta, g.rope.rope_type, g.sliding_rope.theta) == (1e6, "linear", 1e4)
        assert g.query_pre_attn_scalar == 24 and g.tie_word_embeddings
    # transformers' Gemma3ForConditionalGeneration ignores its text config's final soft cap
    assert mm.final_logit_softcapping is None and g3.final_logit_softcapping is None
    moe = {
        name: ModelArchConfig.from_pretrained(golden_path(name)).moe for name in MOE_GOLDEN_ARCHS
    }
    assert moe["mixtral"].norm_topk_prob and moe["mixtral"].top_k == 2
    assert not moe["qwen2_moe"].norm_topk_prob and moe["qwen2_moe"].top_k == 4
    assert moe["qwen2_moe"].shared_expert_intermediate_size == 48
    assert moe["qwen2_moe"].sparse_layers == (True, False)
    assert moe["qwen3_moe"].norm_topk_prob and moe["qwen3_moe"].num_experts == 8


PAGED_CASES = [(n, "xla") for n in ("mistral", "qwen2", "qwen2_moe", "gemma2", "gemma3")]
PAGED_CASES += [
    pytest.param("gemma2", backend, marks=pytest.mark.slow, id=f"gemma2-{backend}")
    for backend in ("pallas-gpu", "pallas-tpu")
]


@pytest.mark.parametrize("name,backend", PAGED_CASES)
def test_paged_logits_match_transformers(name, backend):
    """Chunked prefill of the long prompt (past the sliding window) and the short prompt in the
    same ragged batch, then one decode step; every position against transformers. Gemma 2:
    soft caps, windows and query_pre_attn_scalar through the paged path, on the xla backend and
    both Pallas kernels (interpreted on CPU); Gemma 3: local and global RoPE."""
    model, _, _ = load_model(golden_path(name), dtype="float32")
    (p0, e0), (p1, e1) = _golden(name)
    runner = PagedRunner(
        model,
        {"p0": p0, "p1": p1},
        block_size=4,
        backend=backend,
        interpret=backend != "xla",
    )
    got = {"p0": [], "p1": []}
    for schedule in ({"p0": 6, "p1": 2}, {"p0": 4, "p1": 1}, {"p0": 1}):
        for seq, logits in runner.step(schedule).items():
            got[seq].append(logits)
    np.testing.assert_allclose(np.concatenate(got["p0"]), e0, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.concatenate(got["p1"]), e1, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gemma3_mm"])
def test_greedy_tokens_and_logprobs_match_transformers(name):
    """transformers' greedy continuation of each prompt (16 tokens of ``generate``, through its
    sliding-window KV cache) is ours: fed the prompt and that continuation, the dense forward's
    argmax at every generated position is the next token transformers chose (so greedy decoding
    reproduces it token by token), and the log-probabilities of the whole vocabulary there are
    within 1e-4 of transformers', as are the logits at every prompt position. One forward per
    prompt; the engine's own greedy decoding is checked in tests/engine/test_oracle_gemma.py."""
    model, _, _ = load_model(golden_path(name), dtype="float32")
    g = np.load(f"{golden_path(name)}/golden.npz")
    for i, (prompt, expected) in enumerate(_golden(name)):
        want = g[f"greedy_{i}"].tolist()
        assert len(set(want)) >= 6  # the fixture's greedy output follows its context
        assert np.std(expected) > 0.5  # fixture logits are far from uniform
        logits = dense_logits(model, prompt + want[:-1])
        np.testing.assert_allclose(logits[: len(prompt)], expected, atol=ATOL, rtol=0)
        logits = logits[len(prompt) - 1 :]
        assert logits.argmax(-1).tolist() == want
        logprobs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        np.testing.assert_allclose(logprobs, g[f"greedy_logprobs_{i}"], atol=ATOL, rtol=0)


def test_bfloat16_load_tracks_transformers():
    """``dtype="auto"`` takes the fixtures' bfloat16; logits stay close to the float32 golden."""
    model, _, _ = load_model(golden_path("llama"))
    assert model.embed_tokens.weight[...].dtype == np.dtype("bfloat16")
    prompt, expected = _golden("llama")[0]
    err = np.abs(dense_logits(model, prompt) - expected).max()
    assert err < 0.1 * np.abs(expected).max(), err
