"""Logical axis names -> mesh axes, declared once (MaxText's logical axis rules,
jax-llm-examples' ``ShardingRules``), and placing a model on a tensor-parallel mesh.

Every parameter carries logical axis names in its ``out_sharding`` metadata
(``jaxserve.model.layers.params``).
The rules below place them on a 1-D mesh ``("model",)``: Megatron-style tensor parallelism
(Shoeybi et al. 2019) splits the attention heads and the MLP width across it, and the embedding
and LM head by vocabulary rows. XLA's SPMD partitioner inserts the collectives (an all-reduce
after ``o_proj`` and after ``down_proj``); the paged attention runs per shard under
``shard_map`` (``model/attention.py``); the logits are gathered (replicated) before the sampler.

Heads: each shard must hold whole heads. With ``N`` shards and ``Hkv`` KV heads, ``Hkv`` must be
a multiple of ``N`` (each shard holds ``Hkv / N``) or ``N`` a multiple of ``Hkv``; then every KV
head is replicated ``N / Hkv`` times (vLLM's ``num_kv_head_replicas``) so that each shard holds
exactly one, the one its query heads read. Query heads likewise: ``Hq`` a multiple of ``N``, or
``N`` a multiple of ``Hq`` (only tiny models: the bundled one has 4 heads); then every query head
is copied ``N / Hq`` times and only the first copy keeps its ``o_proj`` rows (the others are
zero), so the output is the same sum and each shard runs one head.

Mixture-of-experts layers (``jaxserve.model.layers.moe``): the experts' stacked matrices
``[E, e, f]`` name an "expert" axis and an "expert_mlp" axis (an expert's width). By default
(tensor parallel) each expert's width is split, like a dense MLP; with
``--enable-expert-parallel`` (``EXPERT_PARALLEL_RULES``) whole experts are split instead, ``E / N``
per device, and their width is not. Attention is tensor-parallel either way. The router
("router" axis) is replicated: every device routes every token.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

if TYPE_CHECKING:
    from jaxserve.model.arch_config import ModelArchConfig

MODEL_AXIS = "model"

# logical axis -> mesh axis (None = replicated).
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "vocab": MODEL_AXIS,
    "embed": None,
    "mlp": MODEL_AXIS,
    "q_heads": MODEL_AXIS,
    "kv_heads": MODEL_AXIS,
    "head_dim": None,
    "expert": None,
    "expert_mlp": MODEL_AXIS,
    "router": None,
}

EXPERT_PARALLEL_RULES: dict[str, str | None] = {
    **LOGICAL_AXIS_RULES,
    "expert": MODEL_AXIS,
    "expert_mlp": None,
}
"""The rules with ``--enable-expert-parallel``: experts split over the mesh, each one whole."""


def axis_rules(enable_expert_parallel: bool = False) -> dict[str, str | None]:
    """The logical axis rules of a placement: ``EXPERT_PARALLEL_RULES`` or the default."""
    return EXPERT_PARALLEL_RULES if enable_expert_parallel else LOGICAL_AXIS_RULES


def make_mesh(tensor_parallel_size: int = 1, devices=None) -> Mesh:
    """A 1-D mesh ``("model",)`` over the first ``tensor_parallel_size`` devices (global devices:
    with several processes the mesh spans them all, in ``jax.devices()`` order).

    Raises:
      ValueError: tensor_parallel_size is < 1 or exceeds the available devices (names both).
    """
    devices = jax.devices() if devices is None else devices
    if not 1 <= tensor_parallel_size <= len(devices):
        raise ValueError(
            f"tensor_parallel_size must be in [1, {len(devices)}] (the devices JAX sees), got "
            f"{tensor_parallel_size}; on CPU simulate more devices with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count=N or JAX_NUM_CPU_DEVICES=N"
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


def param_sharding(
    var: nnx.Variable, mesh: Mesh, rules: dict[str, str | None] = LOGICAL_AXIS_RULES
) -> NamedSharding:
    """The ``NamedSharding`` of one parameter (real or abstract) from its logical axes."""
    return NamedSharding(mesh, logical_to_pspec(var.get_metadata().get("out_sharding"), rules))


def model_shardings(
    model: nnx.Module, mesh: Mesh, rules: dict[str, str | None] = LOGICAL_AXIS_RULES
) -> nnx.State:
    """The ``NamedSharding`` of every parameter of ``model`` (an ``nnx.State`` of shardings)."""
    state = nnx.state(model)
    return jax.tree.map(
        lambda v: v.replace(param_sharding(v, mesh, rules)),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def put_global(x, sharding: NamedSharding) -> jax.Array:
    """``x`` (a host or single-device array, the same value on every process) placed with
    ``sharding``. Within one process this is ``jax.device_put``; when the mesh spans processes
    each process builds only its own shards from its copy (no cross-process transfer). An
    array already placed so (the sharded loader's) is returned as it is."""
    placed = getattr(x, "sharding", None)
    if isinstance(placed, NamedSharding) and placed.is_equivalent_to(sharding, x.ndim):
        return x  # (a single-device array still gets the mesh's NamedSharding below)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_model(
    model: nnx.Module, mesh: Mesh, rules: dict[str, str | None] = LOGICAL_AXIS_RULES
) -> nnx.Module:
    """Places ``model``'s parameters on ``mesh`` according to ``rules`` (in place; returns it)."""
    state = nnx.state(model)
    shardings = model_shardings(model, mesh, rules)
    nnx.update(model, jax.tree.map(put_global, state, shardings))
    return model


def q_head_replicas(num_heads: int, tensor_parallel_size: int) -> int:
    """How many copies of each query head the mesh holds (1 = split, not copied; more only
    when the mesh has more devices than the model has heads).

    Raises:
      ValueError: neither divides the other; the message names both numbers.
    """
    n = tensor_parallel_size
    if num_heads % n == 0:
        return 1
    if n % num_heads == 0:
        return n // num_heads
    raise ValueError(
        f"num_attention_heads ({num_heads}) is not divisible by tensor_parallel_size ({n}) "
        f"(nor {n} by {num_heads}); use a tensor_parallel_size that divides {num_heads}"
    )


def kv_head_replicas(num_heads: int, num_kv_heads: int, tensor_parallel_size: int) -> int:
    """How many copies of each KV head the mesh holds (1 = KV heads are split, not copied).

    Raises:
      ValueError: the heads cannot be split over ``tensor_parallel_size`` shards; the message
        names the head count and the size.
    """
    n = tensor_parallel_size
    q_head_replicas(num_heads, n)
    if num_kv_heads >= n:
        if num_kv_heads % n:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) is not divisible by tensor_parallel_size "
                f"({n}); use a tensor_parallel_size that divides {num_kv_heads}"
            )
        return 1
    if n % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({n}) is not a multiple of num_key_value_heads "
            f"({num_kv_heads}), so the KV heads cannot be replicated evenly across the shards"
        )
    return n // num_kv_heads


def check_tensor_parallel(
    arch: ModelArchConfig, tensor_parallel_size: int, enable_expert_parallel: bool = False
) -> tuple[int, int]:
    """Checks that ``arch`` splits over ``tensor_parallel_size`` shards; returns the query- and
    KV-head replication factors (``q_head_replicas``, ``kv_head_replicas``).

    A MoE model's experts split by their width (``moe_intermediate_size``), or with
    ``enable_expert_parallel`` by their number (``num_experts``).

    Raises:
      ValueError: heads, vocabulary, MLP width, expert width or expert count not divisible (the
        message names both numbers); expert parallelism asked of a dense model.
    """
    replicas = kv_head_replicas(arch.num_heads, arch.num_kv_heads, tensor_parallel_size)
    q_replicas = q_head_replicas(arch.num_heads, tensor_parallel_size)
    moe = arch.moe
    if enable_expert_parallel and moe is None:
        raise ValueError(
            f"enable_expert_parallel: {arch.architecture} has no experts (a dense model); "
            "drop the flag"
        )
    sizes = [("vocab_size", arch.vocab_size)]
    if moe is None or not all(moe.sparse_layers):
        sizes.append(("intermediate_size", arch.intermediate_size))
    if moe is not None:
        if enable_expert_parallel:
            sizes.append(("num_experts", moe.num_experts))
        else:
            sizes.append(("moe_intermediate_size", moe.intermediate_size))
        if moe.shared_expert_intermediate_size:
            sizes.append(("shared_expert_intermediate_size", moe.shared_expert_intermediate_size))
    for field, size in sizes:
        if size % tensor_parallel_size:
            raise ValueError(
                f"{field} ({size}) is not divisible by tensor_parallel_size ({tensor_parallel_size})"
            )
    return q_replicas, replicas


def replicate_heads(model: nnx.Module, q_replicas: int, kv_replicas: int) -> None:
    """Calls ``replicate_heads`` on every attention layer of ``model`` (any module that has it,
    e.g. ``jaxserve.model.layers.self_attention.SelfAttention``), in place."""
    layers = [m for _, m in nnx.iter_graph(model) if hasattr(m, "replicate_heads")]
    for layer in layers:
        layer.replicate_heads(q_replicas, kv_replicas)


def replicate_kv_heads(model: nnx.Module, replicas: int) -> None:
    """Repeats every KV head ``replicas`` times in the k/v projections (and biases) of
    ``model``, in place: KV head ``j`` becomes heads ``j * replicas ... j * replicas + r - 1``,
    so query head ``h`` still reads a copy of its own KV head (``h // (Hq / Hkv)``)."""
    replicate_heads(model, 1, replicas)


def replicate_q_heads(model: nnx.Module, replicas: int) -> None:
    """Repeats every query head ``replicas`` times in the q projection (and bias) of ``model``,
    in place; ``o_proj`` keeps the first copy's rows and zeroes the others', so the attention
    output (a sum over heads) is unchanged. Query head ``h`` becomes heads ``h * replicas ...``,
    which still read (copies of) KV head ``h // (Hq / Hkv)`` once KV heads are replicated to the
    same count."""
    replicate_heads(model, replicas, 1)


def place_model(
    model: nnx.Module, arch: ModelArchConfig, mesh: Mesh, enable_expert_parallel: bool = False
) -> tuple[nnx.Module, ModelArchConfig]:
    """Prepares ``model`` for ``mesh`` and places it there (in place).

    Checks that the heads split (``check_tensor_parallel``), replicates KV (and query) heads
    when the mesh is larger than their number, and places every parameter by the logical axis
    rules (``axis_rules(enable_expert_parallel)``; a parameter already placed so, as the sharded
    loader leaves it, is not moved); MoE layers (any module with an
    ``expert_parallel`` attribute) learn which placement their experts have.

    Returns:
      ``(model, arch)`` where ``arch.num_heads`` / ``arch.num_kv_heads`` count the replicated
      heads (``num_kv_heads`` is the KV cache's head axis).

    Raises:
      ValueError: the model cannot be split over the mesh (see ``check_tensor_parallel``).
    """
    q_replicas, replicas = check_tensor_parallel(arch, mesh.size, enable_expert_parallel)
    # A model loaded onto the mesh (``load_model(..., tensor_parallel_size=N)``) has its heads
    # replicated already: its config counts them.
    loaded = getattr(model, "config", arch)
    if loaded.num_kv_heads != arch.num_kv_heads or loaded.num_heads != arch.num_heads:
        q_replicas = replicas = 1
        arch = loaded
    if q_replicas > 1 or replicas > 1:
        replicate_heads(model, q_replicas, replicas)
        arch = dataclasses.replace(
            arch, num_heads=arch.num_heads * q_replicas, num_kv_heads=arch.num_kv_heads * replicas
        )
        model.config = arch
    for module in [m for _, m in nnx.iter_graph(model) if hasattr(m, "expert_parallel")]:
        module.expert_parallel = enable_expert_parallel
    model = shard_model(model, mesh, axis_rules(enable_expert_parallel))
    pack_cpu_linears(model, mesh)
    return model, arch


def pack_cpu_linears(model: nnx.Module, mesh: Mesh) -> int:
    """On a one-device CPU mesh with our CPU kernels built, packs every float32 ``Linear`` for
    the panel matmul (``Linear.pack_panels``), in place; returns how many it packed (0 on any
    other mesh, or with ``JAXSERVE_CPU_KERNEL=0`` or no compiler: XLA's dot then). The LM head
    stays XLA's: packed (the embedding lookup gathering from the panels) it ran SmolLM2's
    verification steps no faster end to end (7.4-7.6 vs 7.8-8.1 ms of head per step, within
    the runs' noise) nor its one-row head (4.5 ms either way)."""
    from jaxserve.model import cpu_kernels
    from jaxserve.model.layers.linear import Linear

    if mesh.size != 1 or mesh.devices.flat[0].platform != "cpu":
        return 0
    layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, Linear) and m.can_pack_panels()]
    if not layers or not cpu_kernels.available():
        return 0
    for layer in layers:
        layer.pack_panels()
    return len(layers)


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a ``[num_blocks, block_size, Hkv, D]`` cache array: kv heads on "model"."""
    return NamedSharding(mesh, logical_to_pspec((None, None, "kv_heads", "head_dim")))


def replicated(mesh: Mesh) -> NamedSharding:
    """The fully replicated sharding on ``mesh`` (step inputs, logits before the sampler)."""
    return NamedSharding(mesh, PartitionSpec())


def gather_logits(logits: jax.Array, mesh: Mesh | None) -> jax.Array:
    """Inside a jitted step: constrains ``logits [..., V]`` (vocab-sharded by the LM head) to be
    replicated, so the sampler sees every row whole on every device, exactly as on one device.
    A no-op without a mesh or on a one-device mesh."""
    if mesh is None or mesh.size == 1:
        return logits
    return jax.lax.with_sharding_constraint(logits, replicated(mesh))
