"""Logical axis names -> mesh axes, declared once (MaxText's logical axis rules,
jax-llm-examples' ``ShardingRules``).

Every parameter carries logical axis names in its ``out_sharding`` metadata (see ``llama.py``).
The rules below place them on a mesh with a single "model" axis: Megatron-style tensor parallelism
(Shoeybi et al. 2019) splits heads and the MLP width across it. Today the mesh has one device, so
everything is replicated; tensor parallelism only needs a bigger mesh, not a model rewrite.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MODEL_AXIS = "model"

# logical axis -> mesh axis (None = replicated).
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "vocab": MODEL_AXIS,
    "embed": None,
    "mlp": MODEL_AXIS,
    "q_heads": MODEL_AXIS,
    "kv_heads": MODEL_AXIS,
    "head_dim": None,
}


def make_mesh(tensor_parallel_size: int = 1, devices=None) -> Mesh:
    """A 1-D mesh ``("model",)`` over the first ``tensor_parallel_size`` devices.

    Raises:
      ValueError: tensor_parallel_size is < 1 or exceeds the available devices.
    """
    devices = jax.devices() if devices is None else devices
    if not 1 <= tensor_parallel_size <= len(devices):
        raise ValueError(
            f"tensor_parallel_size must be in [1, {len(devices)}], got {tensor_parallel_size}"
        )
    return Mesh(np.asarray(devices[:tensor_parallel_size]), (MODEL_AXIS,))


def logical_to_pspec(
    axes: tuple[str | None, ...] | None, rules: dict[str, str | None] = LOGICAL_AXIS_RULES
) -> PartitionSpec:
    """Maps logical axis names to a ``PartitionSpec`` (MaxText's logical axis rules).

    ``("embed", "mlp") -> PartitionSpec(None, "model")``; ``None`` or ``()`` -> ``PartitionSpec()``
    (replicated); a ``None`` entry stays unsharded.

    Raises:
      ValueError: if a name has no rule in ``rules`` (the message lists the known names).
    """
    if not axes:
        return PartitionSpec()
    for a in axes:
        if a is not None and a not in rules:
            raise ValueError(f"no sharding rule for logical axis {a!r}; known: {sorted(rules)}")
    return PartitionSpec(*(None if a is None else rules[a] for a in axes))


def model_shardings(
    model: nnx.Module, mesh: Mesh, rules: dict[str, str | None] = LOGICAL_AXIS_RULES
) -> nnx.State:
    """The ``NamedSharding`` of every parameter of ``model`` (an ``nnx.State`` of shardings)."""
    state = nnx.state(model)
    return jax.tree.map(
        lambda v: v.replace(
            NamedSharding(mesh, logical_to_pspec(v.get_metadata().get("out_sharding"), rules))
        ),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def shard_model(
    model: nnx.Module, mesh: Mesh, rules: dict[str, str | None] = LOGICAL_AXIS_RULES
) -> nnx.Module:
    """Places ``model``'s parameters on ``mesh`` according to ``rules`` (in place; returns it)."""
    state = nnx.state(model)
    shardings = model_shardings(model, mesh, rules)
    nnx.update(model, jax.device_put(state, shardings))
    return model


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a ``[num_blocks, block_size, Hkv, D]`` cache array: kv heads on "model"."""
    return NamedSharding(mesh, logical_to_pspec((None, None, "kv_heads", "head_dim")))
