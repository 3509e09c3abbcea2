"""Loading a checkpoint straight into a tensor-parallel mesh, slice by slice.

Each parameter becomes a global array with ``jax.make_array_from_callback``: for every device of
this process it asks for the part that device holds (its ``NamedSharding``'s index, from the
logical axis rules in ``jaxserve.model.sharding``), and the callback reads only that part:

    our index -> (head replication) -> the unreplicated parameter's index
              -> (the family's Layout.stored_index) -> the stored tensor's slices
              -> reader.read(name, slices) -> Layout.slice_to_ours -> cast to the model dtype

so a process never holds a whole tensor it only holds a slice of, and host memory in use is one
tensor's local slices at a time (no read-ahead beyond the part being placed). Replicated
parameters (norms) are read once and placed on each device. With more devices than KV (or query)
heads the replicated heads are built per slice (``SelfAttention.head_replication``): device ``i``
reads KV head ``i // replicas``. Layers that a quantization method replaces are read whole
(their method sets their parameters) and then placed. Our orbax layout is restored by orbax
itself with each array's target sharding (``OrbaxReader.restore_placed``): each device's chunk is
read by tensorstore.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.model import quant_loading
from jaxserve.model.arch_config import ModelArchConfig, ModelLoadError
from jaxserve.model.layers.quant import QuantMethod
from jaxserve.model.readers.base import CheckpointReader
from jaxserve.model.registry import resolve_model_class
from jaxserve.model.sharding import (
    axis_rules,
    check_tensor_parallel,
    param_sharding,
    put_global,
    replicate_heads,
)
from jaxserve.model.weight_mapping import Layout, TensorSource, normalize_index

logger = logging.getLogger(__name__)


class LoadProgress:
    """Bytes placed so far, shown as ``loading weights: 3.2/16.1 GB (1.4 GB/s)`` on stderr when
    it is a terminal (at most every half second), and logged once at the end.

    Args:
      total_bytes: the model's bytes in the load dtype.
      stream: where the live line goes (default stderr; shown only if it is a terminal).
    """

    def __init__(self, total_bytes: int, stream=None):
        self.total = total_bytes
        self.done = 0
        self.stream = sys.stderr if stream is None else stream
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = self.last_shown = time.perf_counter()

    def line(self) -> str:
        """The progress in words: GB placed of the total and the GB/s since the start."""
        dt = max(time.perf_counter() - self.t0, 1e-9)
        return (
            f"loading weights: {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
            f"({self.done / 1e9 / dt:.2f} GB/s)"
        )

    def update(self, nbytes: int) -> None:
        """Counts ``nbytes`` more placed."""
        self.done += nbytes
        now = time.perf_counter()
        if self.live and now - self.last_shown >= 0.5:
            self.last_shown = now
            print("\r" + self.line(), end="", file=self.stream, flush=True)

    def close(self) -> None:
        """Ends the live line and logs the total."""
        if self.live:
            print("\r" + self.line(), file=self.stream, flush=True)
        logger.info("%s in %.1f s", self.line(), time.perf_counter() - self.t0)


@dataclasses.dataclass(frozen=True)
class TensorPart:
    """How to read any part of one parameter (``read_part``).

    Attributes:
      names: the stored tensor's name, or one name per index of axis 0 (``stacked`` experts).
      stacked: axis 0 indexes ``names``.
      layout: the family's layout of the stored tensor(s).
      shape: the (unreplicated) parameter's shape.
    """

    names: tuple[str, ...]
    stacked: bool
    layout: Layout
    shape: tuple[int, ...]


def read_part(reader: CheckpointReader, part: TensorPart, index: tuple[slice, ...]) -> np.ndarray:
    """``x[index]`` of the unreplicated parameter ``part`` describes, reading only the stored
    slices that hold it (the whole tensor only where ``Layout.stored_index`` says the part is
    not contiguous). numpy, in the stored dtype."""
    index = normalize_index(index, part.shape)
    if part.stacked:
        experts = index[0]
        one = dataclasses.replace(part, stacked=False, shape=part.shape[1:])
        return np.stack(
            [
                read_part(reader, dataclasses.replace(one, names=(part.names[e],)), index[1:])
                for e in range(experts.start, experts.stop)
            ]
        )
    name, layout = part.names[0], part.layout
    stored = layout.stored_index(index, part.shape)
    if stored is None:
        return np.asarray(layout.to_ours(np.asarray(reader.read(name)), part.shape))[index]
    return np.asarray(
        layout.slice_to_ours(np.asarray(reader.read(name, stored)), index, part.shape)
    )


def read_replicated_part(
    reader: CheckpointReader, part: TensorPart, index: tuple[slice, ...], replication: tuple | None
) -> np.ndarray:
    """``x[index]`` of a parameter whose axis ``replication[0]`` repeats each unreplicated index
    ``replication[1]`` times (``SelfAttention.head_replication``; None: not replicated): only the
    unreplicated indices the part covers are read."""
    if replication is None:
        return read_part(reader, part, index)
    axis, repeats, first_only = replication
    shape = list(part.shape)
    shape[axis] *= repeats
    index = normalize_index(index, tuple(shape))
    lo, hi = index[axis].start, index[axis].stop
    src = slice(lo // repeats, (hi - 1) // repeats + 1)
    x = read_part(reader, part, index[:axis] + (src,) + index[axis + 1 :])
    x = np.repeat(x, repeats, axis=axis)
    off = lo - src.start * repeats
    x = x[(slice(None),) * axis + (slice(off, off + hi - lo),)]
    if first_only:  # copies after the first are zero (o_proj rows of replicated query heads)
        keep = (np.arange(lo, hi) % repeats == 0).reshape((-1,) + (1,) * (x.ndim - axis - 1))
        x = np.where(keep, x, np.zeros((), x.dtype))
    return x


def check_stored(reader: CheckpointReader, part: TensorPart) -> None:
    """Raises ModelLoadError when a stored tensor's shape is not the one ``part`` needs."""
    shape = part.shape[1:] if part.stacked else part.shape
    want = part.layout.stored_shape(shape)
    for name in part.names:
        got = reader.spec(name).shape
        if got != want:
            raise ModelLoadError(
                f"{reader.error_prefix}shape mismatch for tensor {name}: expected {list(want)}, "
                f"got {list(got)} in {reader.where}"
            )


def tensor_part(
    reader: CheckpointReader, source: TensorSource, shape: tuple[int, ...]
) -> TensorPart:
    """The ``TensorPart`` of a parameter of (unreplicated) ``shape`` stored as ``source``."""
    if source.stacked:
        missing = [n for n in source.stacked if n not in reader]
        if missing:
            raise ModelLoadError(
                f"{reader.error_prefix}tensor {missing[0]} not found in {reader.where}"
            )
        part = TensorPart(tuple(source.stacked), True, source.layout, shape)
    else:
        name = next((n for n in source.names if n in reader), None)
        if name is None:
            raise ModelLoadError(
                f"{reader.error_prefix}tensor {source.names[0]} not found in {reader.where}"
            )
        part = TensorPart((name,), False, source.layout, shape)
    check_stored(reader, part)
    return part


def placed_abstract_model(
    cfg: ModelArchConfig,
    dtype,
    methods: dict[tuple, QuantMethod],
    kv_scales: bool,
    q_replicas: int = 1,
    kv_replicas: int = 1,
) -> nnx.Module:
    """The model as the runner holds it on a mesh, ``jax.ShapeDtypeStruct`` parameters only:
    ``methods``' layers quantized, FP8 KV scales with ``kv_scales``, heads replicated
    (``check_tensor_parallel``'s factors). Nothing is allocated."""
    model_cls = resolve_model_class(cfg.architecture)

    def build():
        m = model_cls(cfg, dtype=dtype, rngs=nnx.Rngs(0))
        quant_loading.apply(m, methods, kv_scales)
        if q_replicas > 1 or kv_replicas > 1:
            replicate_heads(m, q_replicas, kv_replicas)
        return m

    return nnx.eval_shape(build)


def head_replications(model: nnx.Module, q_replicas: int, kv_replicas: int) -> dict[tuple, tuple]:
    """{parameter path: (axis, repeats, first_only)} of every parameter that head replication
    changes (``SelfAttention.head_replication`` of each attention layer)."""
    out: dict[tuple, tuple] = {}
    if q_replicas == 1 and kv_replicas == 1:
        return out
    for path, node in nnx.iter_graph(model):
        if hasattr(node, "head_replication"):
            for sub, rep in node.head_replication(q_replicas, kv_replicas).items():
                out[tuple(path) + sub] = rep
    return out


def load_sharded(
    cfg: ModelArchConfig,
    dtype,
    reader: CheckpointReader,
    methods: dict[tuple, QuantMethod],
    kv_scales: bool,
    mesh: Mesh,
    enable_expert_parallel: bool = False,
) -> nnx.Module:
    """The model of ``cfg`` with every parameter read from ``reader`` straight onto ``mesh``
    (see the module docstring); heads are replicated when the mesh has more devices than heads
    (the returned model's ``config`` then counts the copies, as ``place_model`` leaves it).

    Args:
      cfg, dtype, reader: as ``jaxserve.model.loader.load_weights``.
      methods: the quantization plan (``quant_loading.plan``); its layers are read whole. Must
        be empty when heads are replicated.
      kv_scales: add FP8 KV-cache scales.
      mesh: the tensor-parallel mesh (``jaxserve.model.sharding.make_mesh``).
      enable_expert_parallel: place experts by ``EXPERT_PARALLEL_RULES``.

    Raises:
      ModelLoadError: a tensor missing or of the wrong shape (named), before any is read.
      ValueError: the model cannot be split over the mesh.
    """
    q_replicas, kv_replicas = check_tensor_parallel(cfg, mesh.size, enable_expert_parallel)
    rules = axis_rules(enable_expert_parallel)
    model = placed_abstract_model(cfg, dtype, methods, kv_scales, q_replicas, kv_replicas)
    replications = head_replications(model, q_replicas, kv_replicas)
    quant = quant_loading.LayerReads(model, cfg, reader, methods, kv_scales)
    graphdef, abs_state = nnx.split(model)
    flat_abs = list(nnx.to_flat_state(abs_state))

    def part_of(path, var) -> tuple[TensorPart, tuple | None]:
        rep = replications.get(tuple(path))
        shape = tuple(var.shape)
        if rep is not None:
            shape = shape[: rep[0]] + (shape[rep[0]] // rep[1],) + shape[rep[0] + 1 :]
        return tensor_part(reader, model.weight_source(path, cfg, reader.naming), shape), rep

    # Every other parameter's plan first, so a missing tensor fails before anything is read.
    quantized = {
        tuple(p[:-1])
        for p, _ in flat_abs
        if tuple(p[:-1]) in methods or p[-1] in quant_loading.KV_SCALE_NAMES
    }
    plans = [None if tuple(p[:-1]) in quantized else part_of(p, v) for p, v in flat_abs]

    placed = {}
    # orbax: restored by orbax onto the mesh. Over several processes each restores the whole
    # checkpoint on its own, as before (a collective sharded restore is not verified there).
    if hasattr(reader, "restore_placed") and jax.process_count() == 1:
        targets = {}
        for (_, var), plan in zip(flat_abs, plans):
            if plan is not None and plan[1] is None and not plan[0].stacked:
                if plan[0].layout == Layout() and plan[0].shape == tuple(var.shape):
                    targets[plan[0].names[0]] = param_sharding(var, mesh, rules)
        placed = reader.restore_placed(targets, NamedSharding(mesh, PartitionSpec()))

    total = sum(int(np.prod(var.shape)) * jnp.dtype(var.dtype).itemsize for _, var in flat_abs)
    progress = LoadProgress(total)
    flat = []
    np_dtype = np.dtype(dtype)
    for (path, var), plan in zip(flat_abs, plans):
        sharding = param_sharding(var, mesh, rules)
        value = quant.pop(tuple(path)) if plan is None else None
        if value is not None:  # a quantized layer's parameter or a KV scale: read whole
            x = put_global(np.asarray(value).astype(var.dtype), sharding)
        else:
            part, rep = plan or part_of(path, var)  # (a quantized layer's bias)
            y = placed.get(part.names[0])
            if y is not None and y.sharding == sharding and y.dtype == np_dtype:
                x = y
            else:
                x = jax.make_array_from_callback(
                    tuple(var.shape), sharding, _filler(reader, part, rep, np_dtype)
                )
        flat.append((path, var.replace(x)))
        progress.update(int(np.prod(var.shape)) * jnp.dtype(var.dtype).itemsize)
    progress.close()
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    if q_replicas > 1 or kv_replicas > 1:
        model.config = dataclasses.replace(
            cfg, num_heads=cfg.num_heads * q_replicas, num_kv_heads=cfg.num_kv_heads * kv_replicas
        )
    return model


def _filler(reader: CheckpointReader, part: TensorPart, rep: tuple | None, dtype: np.dtype):
    """The ``make_array_from_callback`` callback of one parameter: a device's index -> its part,
    cast to ``dtype``; the last part is kept, so devices holding the same part (replicated
    parameters) read it once."""
    last: list = [None, None]

    def fill(index):
        key = tuple((s.start, s.stop) for s in index)
        if last[0] != key:
            last[0] = key
            last[1] = read_replicated_part(reader, part, index, rep).astype(dtype, copy=False)
        return last[1]

    return fill
