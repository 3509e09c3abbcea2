"""The model's two forward paths agree: paged (chunked prefill + decode through a block-table
cache) against dense causal, on tiny random configs of each architecture switch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_testing import PagedRunner, dense_logits, tiny_config

from jaxserve.model.loader import abstract_model
from jaxserve.model.models.llama import LlamaForCausalLM

SEQ_A = [1, 5, 9, 33, 7, 100, 12, 64, 3, 90, 17, 44, 8, 21, 5, 77]  # 16 tokens
SEQ_B = [1, 40, 2, 11, 120, 6, 7, 99, 55, 31]  # 10 tokens


SCHEDULE = (
    {"a": 7, "b": 6},
    {"a": 5, "b": 1},
    {"b": 1, "a": 1},
    {"a": 1, "b": 1},
    {"a": 1, "b": 1},
    {"a": 1},
)


def _run_paged(model, backend, block_size=4, schedule=SCHEDULE, interpret=False):
    """Two sequences in one ragged batch: A prefilled in 2 chunks (7 + 5) while B prefills (6)
    and then decodes; then both decode. Returns per sequence the logits of every position."""
    runner = PagedRunner(
        model, {"a": SEQ_A, "b": SEQ_B}, backend=backend, block_size=block_size, interpret=interpret
    )
    out = {"a": [], "b": []}
    for step in schedule:
        for name, logits in runner.step(step).items():
            out[name].append(logits)
    return {name: np.concatenate(chunks) for name, chunks in out.items()}


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # Llama, GQA, untied
        dict(architectures=["MistralForCausalLM"], sliding_window=5),  # sliding window
        dict(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),  # q/k/v bias, tied
        dict(architectures=["Qwen3ForCausalLM"]),  # q/k norm
    ],
    ids=["llama", "mistral-window", "qwen2-bias-tied", "qwen3-qknorm"],
)
def test_paged_matches_dense_xla_backend(overrides):
    model = LlamaForCausalLM(tiny_config(**overrides), dtype=jnp.float32, rngs=nnx.Rngs(0))
    paged = _run_paged(model, "xla")
    for name, seq in (("a", SEQ_A), ("b", SEQ_B)):
        n = len(paged[name])
        dense = dense_logits(model, seq)[:n]
        assert np.abs(dense).max() > 0.1  # non-degenerate logits
        np.testing.assert_allclose(paged[name], dense, atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["pallas-gpu", "pallas-tpu"])
def test_paged_matches_dense_pallas_backend(backend):
    """Each Pallas kernel (interpret mode on CPU) behind the same model call; block_size 16 so
    the GPU kernel's 16-token KV tiles are whole blocks. For pallas-tpu the cache has the
    kernel's padded head dim (128 for the model's 32): the padding must change nothing."""
    cfg = tiny_config(architectures=["MistralForCausalLM"], sliding_window=6, num_hidden_layers=1)
    model = LlamaForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(1))
    paged = _run_paged(model, backend, block_size=16, schedule=SCHEDULE[:3], interpret=True)
    for name, seq in (("a", SEQ_A), ("b", SEQ_B)):
        dense = dense_logits(model, seq)[: len(paged[name])]
        np.testing.assert_allclose(paged[name], dense, atol=1e-4, rtol=0)


def test_sliding_window_changes_logits():
    """Guards the test above: a window shorter than the sequence must matter."""
    full = LlamaForCausalLM(tiny_config(), dtype=jnp.float32, rngs=nnx.Rngs(0))
    windowed = LlamaForCausalLM(
        tiny_config(architectures=["MistralForCausalLM"], sliding_window=5),
        dtype=jnp.float32,
        rngs=nnx.Rngs(0),
    )
    a, b = dense_logits(full, SEQ_A), dense_logits(windowed, SEQ_A)
    np.testing.assert_allclose(a[:5], b[:5], atol=1e-5)  # within the window: identical
    assert np.abs(a[5:] - b[5:]).max() > 1e-3


def test_dense_right_padding_does_not_change_real_positions():
    model = LlamaForCausalLM(tiny_config(), dtype=jnp.float32, rngs=nnx.Rngs(0))
    exact = dense_logits(model, SEQ_B)
    padded = dense_logits(model, SEQ_B + [0] * 6)[: len(SEQ_B)]
    np.testing.assert_allclose(padded, exact, atol=1e-6)


def test_bfloat16_params_and_float32_logits():
    cfg = tiny_config()
    ref = LlamaForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, _ = nnx.split(abstract_model(cfg, jnp.bfloat16))
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(ref)))
    dtypes = {v.dtype for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    logits = dense_logits(model, SEQ_A)
    assert logits.dtype == np.float32 and logits.shape == (len(SEQ_A), cfg.vocab_size)
    # bf16 weights and activations track float32 to bf16 accuracy (logits are O(0.1..1) here).
    np.testing.assert_allclose(logits, dense_logits(ref, SEQ_A), atol=0.03)


def test_parameters_carry_logical_axes():
    model = LlamaForCausalLM(
        tiny_config(architectures=["Qwen2ForCausalLM"]), dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    attn = model.layers[0].self_attn
    assert attn.q_proj.weight.get_metadata()["out_sharding"] == ("embed", "q_heads", "head_dim")
    assert attn.k_proj.bias.get_metadata()["out_sharding"] == ("kv_heads", "head_dim")
    assert attn.o_proj.weight.get_metadata()["out_sharding"] == ("q_heads", "head_dim", "embed")
    assert model.layers[1].mlp.down_proj.weight.get_metadata()["out_sharding"] == ("mlp", "embed")
    assert model.embed_tokens.weight.get_metadata()["out_sharding"] == ("vocab", "embed")
