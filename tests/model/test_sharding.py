"""Logical axis rules -> mesh placement on a one-device mesh (tensor parallelism later)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from model_testing import dense_logits, tiny_config

from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model.sharding import (
    kv_cache_sharding,
    logical_to_pspec,
    make_mesh,
    model_shardings,
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
    assert specs["layers"][0]["self_attn"]["q_proj"].get_value().spec == P(None, "model", None)
    assert specs["layers"][0]["self_attn"]["q_bias"].get_value().spec == P("model", None)
    shard_model(model, mesh)
    q = model.layers[0].self_attn.q_proj[...]
    assert q.sharding.spec == P(None, "model", None) and q.sharding.mesh.shape == {"model": 1}
    np.testing.assert_array_equal(dense_logits(model, [1, 2, 3]), before)
    assert kv_cache_sharding(mesh).spec == P(None, None, "model", None)
