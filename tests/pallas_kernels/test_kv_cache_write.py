"""write_kv_cache: rows land in their slots, padding writes nowhere, and the
compiled update is in place when the caches are donated."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_cache_write import write_kv_cache

N, BS, HKV, D = 6, 4, 2, 8


def _caches(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((N, BS, HKV, D)).astype(np.float32)
    v = rng.standard_normal((N, BS, HKV, D)).astype(np.float32)
    return k, v, jnp.asarray(k, dtype), jnp.asarray(v, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_land_in_slots_and_padding_writes_nowhere(dtype):
    k_np, v_np, k_cache, v_cache = _caches(dtype)
    rng = np.random.default_rng(1)
    slots = np.array([5, -1, 22, 0, -1, 12], np.int32)  # two padding tokens
    k_new = rng.standard_normal((6, HKV, D)).astype(np.float32)
    v_new = rng.standard_normal((6, HKV, D)).astype(np.float32)
    k_out, v_out = write_kv_cache(
        k_cache, v_cache, jnp.asarray(k_new, dtype), jnp.asarray(v_new, dtype), jnp.asarray(slots)
    )
    cast = lambda x: np.array(jnp.asarray(x, dtype).astype(jnp.float32))
    want_k = cast(k_np).reshape(N * BS, HKV, D)
    want_v = cast(v_np).reshape(N * BS, HKV, D)
    for t, s in enumerate(slots):
        if s >= 0:
            want_k[s], want_v[s] = cast(k_new[t]), cast(v_new[t])
    np.testing.assert_array_equal(
        np.asarray(k_out.astype(jnp.float32)), want_k.reshape(N, BS, HKV, D)
    )
    np.testing.assert_array_equal(
        np.asarray(v_out.astype(jnp.float32)), want_v.reshape(N, BS, HKV, D)
    )
    # The last slot (where a wrapped -1 would go) is untouched.
    np.testing.assert_array_equal(np.asarray(k_out.astype(jnp.float32))[-1, -1], cast(k_np)[-1, -1])


def test_all_padding_leaves_cache_unchanged():
    k_np, v_np, k_cache, v_cache = _caches()
    new = jnp.ones((3, HKV, D), jnp.float32)
    k_out, v_out = write_kv_cache(k_cache, v_cache, new, new, jnp.full((3,), -1, jnp.int32))
    np.testing.assert_array_equal(np.asarray(k_out), k_np)
    np.testing.assert_array_equal(np.asarray(v_out), v_np)


def _cache_copies(hlo: str) -> list[str]:
    """Instructions of the optimized HLO that copy a whole cache-sized buffer."""
    dims = f"{N},{BS},{HKV},{D}|{N * BS},{HKV},{D}"
    pattern = re.compile(rf"= \w+\[({dims})\]\S* copy(-start)?\(")
    return [line for line in hlo.splitlines() if pattern.search(line)]


def test_donated_update_is_in_place():
    """With donated caches the scatter updates the buffers in place: outputs alias
    the inputs and the optimized HLO holds no cache-sized copy."""
    cache = jax.ShapeDtypeStruct((N, BS, HKV, D), jnp.bfloat16)
    new = jax.ShapeDtypeStruct((5, HKV, D), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((5,), jnp.int32)
    hlo = write_kv_cache.trace(cache, cache, new, new, slots).lower().compile().as_text()
    assert "input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }" in hlo
    assert _cache_copies(hlo) == []
    if jax.default_backend() == "cpu":
        # Without donation XLA must copy the caches; the check above would see it.
        plain = jax.jit(write_kv_cache.__wrapped__)
        hlo_plain = plain.trace(cache, cache, new, new, slots).lower().compile().as_text()
        assert "input_output_alias" not in hlo_plain
        assert len(_cache_copies(hlo_plain)) == 2


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(k=jnp.zeros((4, HKV, D + 1))), "k must have shape"),
        (dict(v=jnp.zeros((4, HKV, D), jnp.bfloat16)), "v dtype"),
        (
            dict(slot_mapping=jnp.zeros((4,), jnp.int64 if jax.config.x64_enabled else jnp.uint32)),
            "slot_mapping",
        ),
        (dict(v_cache=jnp.zeros((N, BS, HKV, D * 2))), "v_cache"),
    ],
)
def test_invalid_inputs_raise(kwargs, field):
    args = dict(
        k_cache=jnp.zeros((N, BS, HKV, D)),
        v_cache=jnp.zeros((N, BS, HKV, D)),
        k=jnp.zeros((4, HKV, D)),
        v=jnp.zeros((4, HKV, D)),
        slot_mapping=jnp.zeros((4,), jnp.int32),
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        write_kv_cache(**args)
