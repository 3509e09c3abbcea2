"""Writing a step's new keys and values into the paged KV cache.

Token ``t`` of the step goes to flat slot ``slot_mapping[t]`` of the cache
viewed as ``[num_blocks * block_size, num_kv_heads, head_dim]``, where slot
``block_table[pos // block_size] * block_size + pos % block_size`` holds
position ``pos`` of its sequence (vLLM's ``reshape_and_cache``). Padding
tokens carry slot ``-1`` and write nowhere.

This is a plain XLA scatter rather than a Pallas kernel: inside a jitted step
that donates the caches, XLA performs the scatter in place, so a step costs
``O(T * Hkv * D)`` bytes of writes and no copy of the cache. The unit test
``tests/pallas_kernels/test_kv_cache_write.py`` checks the compiled HLO for
that (no cache-sized copy, outputs aliased to the donated inputs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _write_one(cache, new, slots):
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    flat = cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)
    flat = flat.at[slots].set(new, mode="drop")
    return flat.reshape(cache.shape)


@functools.partial(jax.jit, donate_argnames=("k_cache", "v_cache"))
def write_kv_cache(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatters new K/V rows into the paged caches through the slot mapping.

    Args:
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], model
        dtype. Donated: the caller must use the returned arrays afterwards.
      k, v: [T, num_kv_heads, head_dim] in the cache dtype; the new keys and
        values of the step's tokens.
      slot_mapping: int32 [T]; flat slot of each token, ``-1`` for padding
        tokens, which write nowhere. Slots must be distinct (each token owns
        its slot).

    Returns:
      ``(k_cache, v_cache)`` with the rows written.

    Raises:
      ValueError: if shapes or dtypes disagree (naming the field).
    """
    if k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {k_cache.shape} and {v_cache.shape}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if slot_mapping.ndim != 1 or slot_mapping.dtype != jnp.int32:
        raise ValueError(
            f"slot_mapping must be int32 [num_tokens], got {slot_mapping.dtype}"
            f"{list(slot_mapping.shape)}"
        )
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    for name, x in (("k", k), ("v", v)):
        if x.shape != expected:
            raise ValueError(f"{name} must have shape {expected}, got {x.shape}")
        if x.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {x.dtype} != cache dtype {k_cache.dtype}")
    # Negative indices would wrap around in `.at[]`; send them out of bounds so
    # that mode="drop" discards them.
    num_slots = num_blocks * block_size
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)
    return _write_one(k_cache, k, slots), _write_one(v_cache, v, slots)
