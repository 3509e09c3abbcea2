"""The shared MoE layer (jaxserve.model.layers.moe) against plain numpy: grouped matmuls (tiled
and ragged_dot), top-k routing with and without renormalisation, the block with a shared expert
and padding tokens; the MoE config fields, the expert axes' placement checks, the expert-load
recorder and its metric. Parity with transformers is in test_hf_parity.py, the multi-device
runs in tests/parallel/test_moe_parallel.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_testing import tiny_hf_config
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.metrics import EngineMetrics
from jaxserve.model.arch_config import ModelArchConfig, ModelLoadError, MoEConfig
from jaxserve.model.expert_load import ExpertLoadRecorder, max_over_mean
from jaxserve.model.layers.moe import (
    SparseMoeBlock,
    attach_expert_load_recorder,
    expert_token_counts,
    grouped_matmul,
    route,
)
from jaxserve.model.loader import abstract_model
from jaxserve.model.param_counts import parameter_counts
from jaxserve.model.presets import PRESET_HF_CONFIGS
from jaxserve.model.sharding import check_tensor_parallel


def _grouped_reference(x, w, sizes):
    out = np.zeros((x.shape[0], w.shape[-1]), np.float32)
    start = 0
    for g, n in enumerate(sizes):
        out[start : start + n] = x[start : start + n] @ w[g]
        start += n
    return out, start


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot"])
@pytest.mark.parametrize(
    "sizes",
    [(5, 0, 12, 3, 0, 1, 9, 2), (32, 0, 0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0, 0, 20)],
)
def test_grouped_matmul_matches_per_group_products(impl, sizes):
    """Empty groups, one group holding every row, and rows past the last group (padding)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 16), np.float32)
    w = rng.standard_normal((8, 16, 24), np.float32)
    want, used = _grouped_reference(x, w, sizes)
    got = np.asarray(grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), impl=impl))
    np.testing.assert_allclose(got[:used], want[:used], rtol=1e-5, atol=1e-5)
    if impl == "tiled":
        assert not got[used:].any()  # rows of no group are zero
    with pytest.raises(ValueError, match="impl must be one of"):
        grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), impl="einsum")


def test_route_top_k_in_float32_with_and_without_renormalisation():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.0, 1.0]], jnp.bfloat16)
    ids, w = route(logits, 2, normalize=False)
    probs = jax.nn.softmax(np.asarray(logits, np.float32), axis=-1)
    assert ids.dtype == jnp.int32 and w.dtype == jnp.float32
    assert ids.tolist() == [[0, 1], [1, 2]]  # ties: the lower id first
    np.testing.assert_allclose(w, np.take_along_axis(np.asarray(probs), np.asarray(ids), 1))
    _, wn = route(logits, 2, normalize=True)
    np.testing.assert_allclose(wn.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(wn, w / w.sum(-1, keepdims=True), rtol=1e-6)


def _block_reference(block: SparseMoeBlock, x: np.ndarray) -> np.ndarray:
    """Token by token in numpy: softmax top-k, each chosen expert's SwiGLU, weighted sum."""
    router = np.asarray(block.gate.weight[...], np.float32)
    g, u, d = (np.asarray(getattr(block.experts, p).weight[...]) for p in block.experts.PROJECTIONS)
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        logits = row @ router
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[: block.top_k]
        w = p[top] / (p[top].sum() if block.normalize else 1.0)
        for wi, ex in zip(w, top):
            h = row @ g[ex]
            out[t] += wi * (((h / (1 + np.exp(-h))) * (row @ u[ex])) @ d[ex])
    if block.shared_expert is not None:
        gate = 1 / (1 + np.exp(-(x @ np.asarray(block.shared_expert_gate.weight[...]))))
        out += gate * np.asarray(block.shared_expert(jnp.asarray(x)))
    return out


@pytest.mark.parametrize(
    "moe",
    [
        MoEConfig(8, 2, 24, norm_topk_prob=True, sparse_layers=(True,)),
        MoEConfig(8, 4, 24, norm_topk_prob=False, shared_expert_intermediate_size=40),
    ],
    ids=["mixtral-like", "qwen2-moe-like"],
)
def test_block_matches_token_by_token_reference_and_ignores_padding(moe):
    block = SparseMoeBlock(32, moe, dtype=jnp.float32, rngs=nnx.Rngs(3), impl="tiled")
    x = np.random.default_rng(1).standard_normal((12, 32), np.float32)
    want = _block_reference(block, x)
    np.testing.assert_allclose(_jit_block(block, x), want, rtol=2e-5, atol=2e-5)
    # Padding tokens (mask False) reach no expert; the real ones are unchanged.
    mask = jnp.arange(12) < 7
    got = _jit_block(block, x, mask)
    np.testing.assert_allclose(got[:7], want[:7], rtol=2e-5, atol=2e-5)
    if block.shared_expert is None:
        assert not got[7:].any()


def _jit_block(block: SparseMoeBlock, x: np.ndarray, mask=None) -> np.ndarray:
    graphdef, state = nnx.split(block)
    return np.asarray(jax.jit(lambda s, x, m: nnx.merge(graphdef, s)(x, m))(state, x, mask))


def _moe_hf(**overrides) -> dict:
    hf = dict(
        architectures=["Qwen2MoeForCausalLM"],
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    return tiny_hf_config(**{**hf, **overrides})


def test_moe_config_fields_per_family():
    mixtral = ModelArchConfig.from_hf_config(
        tiny_hf_config(
            architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=2
        )
    )
    assert mixtral.moe == MoEConfig(4, 2, 48, True, 0, (True, True))
    qwen2 = ModelArchConfig.from_hf_config(
        _moe_hf(mlp_only_layers=[0], decoder_sparse_step=2, shared_expert_intermediate_size=24)
    )
    assert qwen2.moe.sparse_layers == (False, True, False, True)
    assert qwen2.moe.shared_expert_intermediate_size == 24 and not qwen2.moe.norm_topk_prob
    assert qwen2.qkv_bias
    qwen3 = ModelArchConfig.from_hf_config(
        _moe_hf(architectures=["Qwen3MoeForCausalLM"], norm_topk_prob=True)
    )
    assert (
        qwen3.qk_norm
        and qwen3.moe.norm_topk_prob
        and qwen3.moe.shared_expert_intermediate_size == 0
    )
    assert ModelArchConfig.from_hf_config(tiny_hf_config()).moe is None


@pytest.mark.parametrize(
    "drop,extra,match",
    [
        ("num_experts", {}, "num_local_experts / num_experts"),
        ("num_experts_per_tok", {}, "num_experts_per_tok"),
        ("moe_intermediate_size", {}, "moe_intermediate_size"),
        (None, {"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) exceeds"),
    ],
)
def test_bad_moe_configs_name_the_field(drop, extra, match):
    hf = _moe_hf(**extra)
    hf.pop(drop, None)
    with pytest.raises(ModelLoadError, match=match):
        ModelArchConfig.from_hf_config(hf)


def test_placement_checks_name_the_expert_numbers():
    cfg = ModelArchConfig.from_hf_config(_moe_hf(num_experts=6, moe_intermediate_size=20))
    with pytest.raises(ValueError, match=r"num_experts \(6\).*tensor_parallel_size \(4\)"):
        check_tensor_parallel(cfg, 4, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(20\).*\(8\)"):
        check_tensor_parallel(cfg, 8)
    assert check_tensor_parallel(cfg, 2, enable_expert_parallel=True) == (1, 1)
    with pytest.raises(ValueError, match="has no experts"):
        check_tensor_parallel(ModelArchConfig.from_hf_config(tiny_hf_config()), 2, True)


def test_expert_load_recorder_counts_real_tokens_and_exports_them():
    moe = MoEConfig(8, 2, 16, sparse_layers=(True,))
    block = SparseMoeBlock(32, moe, dtype=jnp.float32, rngs=nnx.Rngs(0), layer_index=3)
    recorder = attach_expert_load_recorder(block)
    assert recorder.layers == (3,)
    metrics = EngineMetrics("tiny-moe")
    metrics.add_expert_load(recorder)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((10, 32), np.float32))
    mask = jnp.arange(10) < 6
    graphdef, state = nnx.split(block)
    jax.jit(lambda s, x, m: nnx.merge(graphdef, s)(x, m))(state, x, mask).block_until_ready()
    jax.effects_barrier()
    ids, _ = block.route(x[:6])
    want = np.bincount(np.asarray(ids).ravel(), minlength=8)
    np.testing.assert_array_equal(recorder.totals(), want[None])
    assert recorder.totals().sum() == 6 * 2  # k per real token, padding not counted
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(metrics.render().decode())
        for s in fam.samples
    }
    for e in range(8):
        key = (
            "jaxserve:moe_expert_tokens_total",
            (("expert", str(e)), ("layer", "3"), ("model_name", "tiny-moe")),
        )
        assert samples[key] == want[e]
    ratio = samples[
        ("jaxserve:moe_expert_load_max_over_mean", (("layer", "3"), ("model_name", "tiny-moe")))
    ]
    assert ratio == pytest.approx(want.max() / want.mean())
    # The next scrape covers no new step: the gauge is absent, the counters stay.
    again = metrics.render().decode()
    assert "moe_expert_load_max_over_mean{" not in again and "moe_expert_tokens_total{" in again


def test_max_over_mean_and_counts():
    np.testing.assert_allclose(max_over_mean(np.array([[2, 2, 2, 2], [8, 0, 0, 0]])), [1.0, 4.0])
    assert np.isnan(max_over_mean(np.zeros((1, 4)))[0])
    ids = jnp.asarray([[0, 1], [1, 3], [2, 3]], jnp.int32)
    assert expert_token_counts(ids, 4).tolist() == [1, 2, 1, 2]
    assert expert_token_counts(ids, 4, jnp.asarray([True, True, False])).tolist() == [1, 2, 0, 1]
    rec = ExpertLoadRecorder((0, 2), 4)
    rec.record(2, [1, 0, 0, 1])
    assert rec.totals().tolist() == [[0, 0, 0, 0], [1, 0, 0, 1]]


def test_moe_config_is_hashable_and_checked():
    cfg = ModelArchConfig.from_hf_config(_moe_hf())
    hash(cfg)
    with pytest.raises(ModelLoadError, match="names 3 layers"):
        dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, sparse_layers=(True,) * 3))


@pytest.mark.parametrize(
    "name,total,active",
    [
        ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),
        ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),
        ("llama-3.2-1b", 1_235_814_400, 1_235_814_400),
    ],
)
def test_parameter_counts_match_the_built_model_and_the_published_figures(name, total, active):
    """Shapes only (``nnx.eval_shape``): nothing is allocated."""
    cfg = ModelArchConfig.from_hf_config(PRESET_HF_CONFIGS[name])
    counts = parameter_counts(cfg)
    built = sum(x.size for x in jax.tree.leaves(nnx.state(abstract_model(cfg, jnp.bfloat16))))
    assert counts.total == built == total
    assert counts.active == active
    assert counts.weight_bytes(2) == 2 * total
