"""The CPU panel matmul (``jaxserve.model.cpu_kernels.panel_matmul``) and the weights packed
for it: products against float64 numpy at row counts on and off its 8-row blocks (and the
6-row blocks of panel pairs it uses from 64 rows) and column counts off its 32-column panels; a packed ``Linear`` equal to the einsum it replaces (several
axes, bias, jitted); ``place_model`` packing exactly the float32 projections of a one-device CPU
model; and a packed model's logits and greedy tokens against the same model unpacked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_testing import dense_logits, golden_path

from jaxserve.model import cpu_kernels
from jaxserve.model.dense_oracle import generate_dense
from jaxserve.model.layers.linear import Linear
from jaxserve.model.layers.quant import ChannelQuant
from jaxserve.model.loader import load_model
from jaxserve.model.quant_config import WeightScheme
from jaxserve.model.sharding import make_mesh, pack_cpu_linears


@pytest.mark.parametrize(
    "m,k,n",
    [(1, 576, 192), (5, 64, 70), (8, 33, 32), (9, 17, 31), (37, 100, 200), (3, 1, 5)]
    # from 64 rows, pairs of panels (an odd panel left over) in blocks of 6 rows (and a rest)
    + [(64, 40, 200), (131, 17, 96), (1100, 8, 1100)],
)
def test_matches_numpy(kernel, m, k, n):
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = cpu_kernels.pack_panels(w)
    assert packed.shape == (-(-n // 32), k, 32)
    got = np.asarray(jax.jit(cpu_kernels.panel_matmul, static_argnums=2)(x, packed, n))
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.sqrt(k) * 4)


def test_empty_and_mismatched_shapes(kernel):
    w = cpu_kernels.pack_panels(np.ones((4, 40), np.float32))
    assert np.asarray(cpu_kernels.panel_matmul(jnp.zeros((0, 4)), w, 40)).shape == (0, 40)
    zero = cpu_kernels.panel_matmul(jnp.ones((2, 0)), cpu_kernels.pack_panels(np.ones((0, 8))), 8)
    assert not np.asarray(zero).any()
    with pytest.raises(ValueError, match="do not match"):
        cpu_kernels.panel_matmul(jnp.ones((2, 5)), w, 40)
    for n in (65, 32, -1):  # P = ceil(n / 32) is 2 here
        with pytest.raises(ValueError, match="do not match"):
            cpu_kernels.panel_matmul(jnp.ones((2, 4)), w, n)
    with pytest.raises(ValueError, match="do not match"):
        cpu_kernels.panel_matmul(jnp.ones((2, 4)), jnp.asarray(w, jnp.bfloat16), 40)
    with pytest.raises(ValueError, match=r"\[K, N\]"):
        cpu_kernels.pack_panels(np.ones((2, 3, 4), np.float32))


@pytest.mark.parametrize(
    "in_shape,out_shape,bias",
    [(48, (3, 16), True), ((3, 16), 48, False), (40, 70, True)],
)
def test_packed_linear_equals_the_einsum(kernel, in_shape, out_shape, bias):
    ins = in_shape if isinstance(in_shape, tuple) else (in_shape,)
    outs = out_shape if isinstance(out_shape, tuple) else (out_shape,)
    layer = Linear(
        in_shape,
        out_shape,
        in_axes=(None,) * len(ins),
        out_axes=(None,) * len(outs),
        bias=bias,
        dtype=jnp.float32,
        rngs=nnx.Rngs(0),
    )
    if bias:
        layer.bias.set_value(jnp.arange(np.prod(outs), dtype=jnp.float32).reshape(outs) / 7)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, *ins)), jnp.float32)
    run = nnx.jit(lambda layer, x: layer(x))
    want = np.asarray(run(layer, x))
    assert layer.can_pack_panels()
    layer.pack_panels()
    assert layer.packed and not layer.can_pack_panels()
    got = np.asarray(run(layer, x))
    assert got.shape == (2, 5, *outs)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    # bfloat16 x with the float32 weight: float32 out, as the einsum's
    assert run(layer, x.astype(jnp.bfloat16)).dtype == jnp.float32
    with pytest.raises(ValueError, match="packed once"):
        layer.pack_panels()


def _linears(model):
    return [m for _, m in nnx.iter_graph(model) if isinstance(m, Linear)]


def test_place_model_packs_the_float32_projections_of_one_cpu(kernel, monkeypatch):
    model = load_model(golden_path("mistral"), dtype="float32")[0]
    linears = _linears(model)
    quantized = linears[0]
    quantized.set_quantization(ChannelQuant(WeightScheme("int8")), None)  # stays as it is
    assert pack_cpu_linears(model, make_mesh(1)) == len(linears) - 1
    assert not quantized.packed and all(m.packed for m in linears[1:])
    assert pack_cpu_linears(model, make_mesh(1)) == 0  # packed once
    fresh = load_model(golden_path("mistral"), dtype="float32")[0]
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)  # no compiler
    assert pack_cpu_linears(fresh, make_mesh(1)) == 0
    assert not any(m.packed for m in _linears(fresh))


def test_a_packed_model_keeps_its_logits_and_greedy_tokens(kernel):
    prompt = [1, 17, 42, 99, 3, 250, 7]
    model = load_model(golden_path("mistral"), dtype="float32")[0]
    want_logits = dense_logits(model, prompt)
    want = generate_dense(model, prompt, 12)
    assert pack_cpu_linears(model, make_mesh(1)) > 0
    np.testing.assert_allclose(dense_logits(model, prompt), want_logits, rtol=0, atol=1e-4)
    assert generate_dense(model, prompt, 12) == want
