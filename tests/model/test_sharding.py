"""Logical axis rules -> mesh placement on a one-device mesh, and the tensor-parallel checks
(KV heads split or replicated). The multi-device runs are in tests/parallel (subprocesses)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from model_testing import dense_logits, tiny_config

from jaxserve.model.models.llama import LlamaForCausalLM
from jaxserve.model.sharding import (
    check_tensor_parallel,
    gather_logits,
    kv_cache_sharding,
    kv_head_replicas,
    logical_to_pspec,
    make_mesh,
    model_shardings,
    place_model,
    q_head_replicas,
    replicate_kv_heads,
    replicate_q_heads,
    shard_model,
)


def test_logical_to_pspec():
    assert logical_to_pspec(("embed", "q_heads", "head_dim")) == P(None, "model", None)
    assert logical_to_pspec(("vocab", "embed")) == P("model", None)
    assert logical_to_pspec(("mlp", "embed")) == P("model", None)
    assert logical_to_pspec(None) == P()
    with pytest.raises(ValueError, match="no sharding rule for logical axis 'batch'"):
        logical_to_pspec(("batch",))


def test_make_mesh_validates_size():
    assert make_mesh().shape == {"model": 1}
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_mesh(len(jax.devices()) + 1)


def test_shard_model_on_one_device_mesh():
    model = LlamaForCausalLM(
        tiny_config(architectures=["Qwen2ForCausalLM"]), dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    before = dense_logits(model, [1, 2, 3])
    mesh = make_mesh(1)
    specs = model_shardings(model, mesh)
    assert specs["layers"][0]["self_attn"]["q_proj"]["weight"].get_value().spec == P(
        None, "model", None
    )
    assert specs["layers"][0]["self_attn"]["q_proj"]["bias"].get_value().spec == P("model", None)
    shard_model(model, mesh)
    q = model.layers[0].self_attn.q_proj.weight[...]
    assert q.sharding.spec == P(None, "model", None) and q.sharding.mesh.shape == {"model": 1}
    np.testing.assert_array_equal(dense_logits(model, [1, 2, 3]), before)
    assert kv_cache_sharding(mesh).spec == P(None, None, "model", None)


@pytest.mark.parametrize(
    "heads,kv_heads,tp,replicas",
    [
        (8, 8, 2, 1),
        (8, 2, 2, 1),
        (8, 2, 4, 2),
        (8, 2, 8, 4),
        (8, 1, 8, 8),
        (32, 8, 8, 1),
        (4, 2, 8, 4),
    ],
)
def test_kv_heads_split_or_replicate(heads, kv_heads, tp, replicas):
    assert kv_head_replicas(heads, kv_heads, tp) == replicas


@pytest.mark.parametrize(
    "heads,kv_heads,tp,message",
    [
        (4, 2, 6, r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(6\)"),
        (12, 6, 4, r"num_key_value_heads \(6\) is not divisible by tensor_parallel_size \(4\)"),
        (24, 4, 6, r"tensor_parallel_size \(6\) is not a multiple of num_key_value_heads \(4\)"),
    ],
)
def test_heads_that_cannot_split_name_both_numbers(heads, kv_heads, tp, message):
    with pytest.raises(ValueError, match=message):
        kv_head_replicas(heads, kv_heads, tp)


def test_vocab_that_cannot_split_is_named():
    with pytest.raises(ValueError, match=r"vocab_size \(130\) is not divisible by .* \(4\)"):
        check_tensor_parallel(tiny_config(vocab_size=130, num_attention_heads=8), 4)


def test_replicated_kv_heads_keep_the_dense_logits():
    """Each query head reads a copy of its own KV head after replication (GQA 4/2 -> 4/4)."""
    cfg = tiny_config(architectures=["Qwen2ForCausalLM"])  # q/k/v biases replicate too
    model = LlamaForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    for layer in model.layers:  # non-zero biases, so a misplaced bias would show
        attn = layer.self_attn
        for name in ("k_proj", "v_proj"):
            p = getattr(attn, name).bias
            p.set_value(0.1 * jax.random.normal(jax.random.key(1), p[...].shape))
    before = dense_logits(model, [1, 2, 3, 9, 4])
    replicate_kv_heads(model, 2)
    assert model.layers[0].self_attn.k_proj.weight[...].shape == (32, 4, 16)
    assert model.layers[0].self_attn.v_proj.bias[...].shape == (4, 16)
    np.testing.assert_allclose(dense_logits(model, [1, 2, 3, 9, 4]), before, atol=1e-5, rtol=0)


def test_replicated_query_heads_keep_the_dense_logits():
    """More shards than query heads (4 heads, TP 8): each query head is copied, only the first
    copy feeds o_proj, KV heads are copied to match; the logits stay the same."""
    cfg = tiny_config(architectures=["Qwen2ForCausalLM"])  # GQA 4/2 with q/k/v biases
    model = LlamaForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    for layer in model.layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            p = getattr(layer.self_attn, name).bias
            p.set_value(0.1 * jax.random.normal(jax.random.key(2), p[...].shape))
    before = dense_logits(model, [1, 2, 3, 9, 4])
    assert q_head_replicas(4, 8) == 2 and kv_head_replicas(4, 2, 8) == 4
    replicate_q_heads(model, 2)
    replicate_kv_heads(model, 4)
    attn = model.layers[0].self_attn
    assert attn.q_proj.weight[...].shape == (32, 8, 16)
    assert attn.o_proj.weight[...].shape == (8, 16, 32)
    assert attn.k_proj.weight[...].shape == (32, 8, 16)
    np.testing.assert_allclose(dense_logits(model, [1, 2, 3, 9, 4]), before, atol=1e-5, rtol=0)


def test_place_model_on_one_device_keeps_the_arch():
    cfg = tiny_config()
    model = LlamaForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    placed, arch = place_model(model, cfg, make_mesh(1))
    assert placed is model and arch == cfg
    assert gather_logits(jnp.ones((2, 3)), None).shape == (2, 3)
