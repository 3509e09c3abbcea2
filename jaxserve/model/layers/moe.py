"""The mixture-of-experts feed-forward: a top-k router and experts computed as grouped matmuls
over the tokens sorted by expert (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; dropless as in
MegaBlocks, Gale et al. 2022).

One step of ``SparseMoeBlock`` over ``T`` tokens with ``E`` experts, top ``k``:

1. **Route** (float32): ``logits = x · W_router`` ``[T, E]``, softmax, top-k ids and
   probabilities ``[T, k]``, renormalised to sum to 1 where the family says so
   (``MoEConfig.norm_topk_prob``: Mixtral always, Qwen by config).
2. **Sort**: the ``M = T * k`` (token, expert) pairs are sorted by expert (a stable argsort of
   the expert ids), so each expert's rows are contiguous; ``group_sizes [E]`` counts them. The
   buffer is always ``M`` rows, so shapes are fixed per token bucket. Dropless: every pair is
   computed, there is no capacity factor. Padding tokens of the bucket (``token_mask`` False)
   sort past the last group and cost nothing.
3. **Experts**: ``down(silu(gate(x_sorted)) * up(x_sorted))``, each a ``grouped_matmul``: row
   ``i`` of the sorted buffer multiplies the matrix of its expert (``GroupedLinear``).
4. **Combine**: unsort, weight each token's k outputs by its router probabilities and sum.
   Qwen2-MoE adds a shared expert (a dense SwiGLU) scaled by ``sigmoid(x · w_gate)``.

``grouped_matmul`` is ``jax.lax.ragged_dot`` (XLA's grouped GEMM) on GPU and TPU. On CPU, JAX
lowers ``ragged_dot`` to a dense product over every group (each row times all E matrices,
masked: E times the FLOPs), so the CPU path is
``tiled_grouped_matmul``: a ``lax.fori_loop`` over the (row tile, expert) pairs that hold rows,
MegaBlocks' block-sparse schedule, whose cost follows the rows present. Both compute the same
function (tests compare them).

Parallelism (the mesh ``("model",)``, ``jaxserve.model.sharding``): attention stays
tensor-parallel, so after its all-reduce every device holds every token of the step. The
experts then run under ``shard_map`` in one of two placements:

* **tensor parallel** (default): each expert's width ``f`` is split (``expert_mlp`` on the
  mesh); every device runs every expert on its ``f / N`` slice, and the partial ``down``
  outputs are summed with one all-reduce of ``[T, e]``, like a dense Megatron MLP.
* **expert parallel** (``--enable-expert-parallel``): whole experts are split (``expert`` on the
  mesh): device ``r`` holds experts ``[r E/N, (r+1) E/N)`` and computes only the pairs routed to
  them (the others sort past its groups); the outputs are summed with the same all-reduce.

Why this dispatch and not an all-to-all. Per device and MoE layer, with ``b`` bytes per element:
the tokens are already replicated by TP attention, so gathering them costs nothing, and the
all-reduce that combines the experts' outputs moves ``2 (N-1)/N T e b`` bytes (a reduce-scatter
plus an all-gather), exactly what the dense TP MLP's all-reduce moves. An all-to-all dispatch
sends each (token, expert) pair to its expert's device and back: ``2 (N-1)/N T k e b / N``
when the tokens are sharded over devices (data-parallel attention), less than the all-reduce
only when ``k < N``; and with replicated tokens it would still need the all-gather before the
next TP attention. So with TP attention, all-gather (free) + expert-sharded compute +
all-reduce is the least traffic (vLLM's default ``allgather_reducescatter`` backend makes the
same choice); the all-to-all pays off with data-parallel attention, which jaxserve does not
have. docs/PARALLELISM.md has the figures for Mixtral-8x7B and Qwen3-30B-A3B.

Letters: T tokens, e hidden, f an expert's width, E experts (``El`` on one device), k top-k,
M = T * k sorted rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxserve.model.expert_load import ExpertLoadRecorder
from jaxserve.model.layers.linear import Linear
from jaxserve.model.layers.mlp import GatedMLP
from jaxserve.model.layers.params import logical_param
from jaxserve.model.sharding import (
    EXPERT_PARALLEL_RULES,
    LOGICAL_AXIS_RULES,
    MODEL_AXIS,
    logical_to_pspec,
)
from pallas_kernels.bucketing import next_power_of_2

if TYPE_CHECKING:
    from jaxserve.model.arch_config import MoEConfig

GROUPED_MATMUL_IMPLS = ("auto", "ragged_dot", "tiled")
"""``grouped_matmul`` implementations: "ragged_dot" (``jax.lax.ragged_dot``), "tiled"
(``tiled_grouped_matmul``), "auto" (tiled on CPU, ragged_dot elsewhere)."""


def tile_rows(num_rows: int, num_groups: int) -> int:
    """Rows per tile of ``tiled_grouped_matmul``: the mean group size rounded up to a power of
    two, within [8, 256]. Smaller tiles waste fewer rows at group edges; larger ones read each
    expert's matrix fewer times."""
    return min(256, max(8, next_power_of_2(-(-num_rows // num_groups))))


def tiled_grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, tile: int | None = None
) -> jax.Array:
    """``ragged_dot`` as a loop over (row tile, group) pairs: only tiles that hold rows of a
    group are multiplied, by that group's matrix (MegaBlocks' schedule; JAX's megablox ``gmm``
    without a kernel). At most ``ceil(M / tile) + G - 1`` iterations; fewer when rows are
    padding. Same arguments and result as ``grouped_matmul``; ``tile``: rows per tile
    (default ``tile_rows``)."""
    m, _ = x.shape
    n = w.shape[-1]
    tile = tile or tile_rows(m, w.shape[0])
    num_tiles = -(-m // tile)
    xp = jnp.pad(x, ((0, num_tiles * tile - m), (0, 0)))
    group_sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first_tile = starts // tile
    num_items = jnp.where(group_sizes > 0, (ends - 1) // tile - first_tile + 1, 0)
    items_end = jnp.cumsum(num_items)  # work item i belongs to the group whose range holds it
    row = jnp.arange(tile, dtype=jnp.int32)

    def body(i, acc):
        g = jnp.searchsorted(items_end, i, side="right").astype(jnp.int32)
        row0 = (first_tile[g] + i - (items_end[g] - num_items[g])) * tile
        rows = jax.lax.dynamic_slice_in_dim(xp, row0, tile)  # [tile, K]
        y = jnp.dot(rows, w[g], preferred_element_type=jnp.float32)  # [tile, N]
        mine = ((row0 + row) >= starts[g]) & ((row0 + row) < ends[g])
        cur = jax.lax.dynamic_slice_in_dim(acc, row0, tile)
        return jax.lax.dynamic_update_slice_in_dim(
            acc, cur + jnp.where(mine[:, None], y, 0.0), row0, 0
        )

    acc = jax.lax.fori_loop(0, items_end[-1], body, jnp.zeros((num_tiles * tile, n), jnp.float32))
    return acc[:m].astype(x.dtype)


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: str = "auto"
) -> jax.Array:
    """Row ``i`` of ``x`` times the matrix of the group it falls in.

    Args:
      x: ``[M, K]`` rows sorted by group: group 0's ``group_sizes[0]`` rows first, and so on.
      w: ``[G, K, N]``, one matrix per group.
      group_sizes: int32 ``[G]``, summing to at most M; rows past the sum belong to no group.
      impl: one of ``GROUPED_MATMUL_IMPLS``.

    Returns:
      ``[M, N]`` in x's dtype, accumulated in float32; rows of no group are unspecified
      (zero for "tiled"), so callers mask them.

    Raises:
      ValueError: an unknown ``impl``.
    """
    if impl not in GROUPED_MATMUL_IMPLS:
        raise ValueError(f"impl must be one of {GROUPED_MATMUL_IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "tiled" if jax.default_backend() == "cpu" else "ragged_dot"
    x, w = jnp.asarray(x), jnp.asarray(w)
    if impl == "tiled":
        return tiled_grouped_matmul(x, w, group_sizes)
    y = jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


class GroupedLinear(nnx.Module):
    """One ``[in, out]`` matrix per expert, applied to rows sorted by expert: the experts'
    counterpart of ``Linear`` (same conventions: ``weight`` stored input axis first, named
    logical axes, ``project`` is the matmul a quantized weight would replace).

    Parameter: ``weight [E, in, out]``, axes ``("expert", in_axis, out_axis)``. The expert
    computation runs under ``shard_map``, so it takes the layer's arrays, not the layer:
    ``arrays()`` hands them out with ``axes()`` (their logical axes, for the shard_map specs),
    and ``project(arrays, ...)`` multiplies. A quantized variant (#31) adds ``weight_scale``
    (``[E, out]``, axes ``("expert", out_axis)``) to both and dequantizes in ``project``.

    Args:
      num_experts, in_dim, out_dim: E and the matrix shape.
      in_axis, out_axis: logical axis names (``"embed"`` and ``"expert_mlp"`` for gate / up).
      dtype: parameter dtype.
      rngs: initialiser keys (one draw, N(0, 0.02)).
    """

    def __init__(
        self,
        num_experts: int,
        in_dim: int,
        out_dim: int,
        *,
        in_axis: str,
        out_axis: str,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.weight = logical_param(
            rngs, (num_experts, in_dim, out_dim), dtype, ("expert", in_axis, out_axis)
        )

    def arrays(self) -> dict[str, jax.Array]:
        """The arrays ``project`` reads, by name."""
        return {"weight": self.weight[...]}

    def axes(self) -> dict[str, tuple[str, ...]]:
        """Each array's logical axes (``arrays()``'s keys)."""
        return {"weight": self.weight.get_metadata()["out_sharding"]}

    @staticmethod
    def project(
        arrays: dict[str, jax.Array], x: jax.Array, group_sizes: jax.Array, impl: str = "auto"
    ) -> jax.Array:
        """``x [M, in]`` sorted by expert, ``group_sizes [E]`` -> ``[M, out]`` in x's dtype
        (``grouped_matmul``; ``arrays`` may hold only a device's experts or width)."""
        return grouped_matmul(x, arrays["weight"], group_sizes, impl=impl)


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Top-k routing: softmax over the experts, the k most probable, optionally renormalised.

    Args:
      logits: float32 ``[T, E]`` router logits.
      top_k: k.
      normalize: divide the k probabilities by their sum (``norm_topk_prob``).

    Returns:
      ``(ids int32 [T, k], weights float32 [T, k])``, most probable first (ties: lower id).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def expert_token_counts(
    ids: jax.Array, num_experts: int, token_mask: jax.Array | None = None
) -> jax.Array:
    """Tokens routed to each expert: ``ids int32 [T, k]`` (and a bool ``[T]`` mask of real
    tokens) -> int32 ``[E]``, summing to ``k x`` the real tokens."""
    hits = jnp.ones(ids.shape, jnp.int32)
    if token_mask is not None:
        hits = hits * token_mask[:, None].astype(jnp.int32)
    return jnp.zeros(num_experts, jnp.int32).at[ids.reshape(-1)].add(hits.reshape(-1))


def _experts(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    token_mask: jax.Array | None,
    arrays: dict[str, dict[str, jax.Array]],
    *,
    first_expert: jax.Array | int,
    impl: str,
) -> jax.Array:
    """The routed experts on one device: the pairs routed to experts ``first_expert ..
    first_expert + El - 1`` (those whose matrices ``arrays`` holds) are sorted, computed and
    combined; the others contribute zero.

    x ``[T, e]``, ids int32 / weights float32 ``[T, k]``, token_mask bool ``[T]`` or None ->
    ``[T, e]`` float32 (this device's share of the sum over experts).
    """
    t, k = ids.shape
    num_local = arrays["gate_proj"]["weight"].shape[0]
    local = ids.reshape(-1) - first_expert  # [M]
    keep = (local >= 0) & (local < num_local)
    if token_mask is not None:
        keep &= jnp.repeat(token_mask, k)
    key = jnp.where(keep, local, num_local)  # pairs of no local expert sort last
    order = jnp.argsort(key, stable=True)  # [M]
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    xs = x[order // k]  # [M, e]
    gate = GroupedLinear.project(arrays["gate_proj"], xs, group_sizes, impl)
    up = GroupedLinear.project(arrays["up_proj"], xs, group_sizes, impl)
    ys = GroupedLinear.project(arrays["down_proj"], jax.nn.silu(gate) * up, group_sizes, impl)
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(t, k, -1)  # unsorted, [T, k, e]
    y = jnp.where(keep.reshape(t, k, 1), y.astype(jnp.float32), 0.0)
    return jnp.einsum("tk,tke->te", weights, y)


class Experts(nnx.Module):
    """The routed experts' SwiGLU matrices: ``gate_proj``, ``up_proj`` ``[E, e, f]`` and
    ``down_proj`` ``[E, f, e]`` (``GroupedLinear``; random initialisation draws them in that
    order)."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden_size: int, width: int, *, dtype, rngs):
        n, e, f = num_experts, hidden_size, width
        kw = dict(dtype=dtype, rngs=rngs)
        self.gate_proj = GroupedLinear(n, e, f, in_axis="embed", out_axis="expert_mlp", **kw)
        self.up_proj = GroupedLinear(n, e, f, in_axis="embed", out_axis="expert_mlp", **kw)
        self.down_proj = GroupedLinear(n, f, e, in_axis="expert_mlp", out_axis="embed", **kw)

    def arrays(self) -> dict[str, dict[str, jax.Array]]:
        """``{projection: GroupedLinear.arrays()}``."""
        return {name: getattr(self, name).arrays() for name in self.PROJECTIONS}

    def axes(self) -> dict[str, dict[str, tuple[str, ...]]]:
        """``{projection: GroupedLinear.axes()}``, the logical axes of ``arrays()``."""
        return {name: getattr(self, name).axes() for name in self.PROJECTIONS}


class SparseMoeBlock(nnx.Module):
    """The MoE feed-forward of one decoder layer (see the module docstring).

    Parameters (Hugging Face's module names): ``gate`` (the router, ``Linear [e, E]``),
    ``experts.{gate,up,down}_proj`` (``GroupedLinear``: ``[E, e, f]``, ``[E, e, f]``,
    ``[E, f, e]``), and with a shared expert ``shared_expert`` (``GatedMLP``) and
    ``shared_expert_gate`` (``Linear [e, 1]``). Random initialisation draws router, gate, up,
    down, then the shared expert's.

    Static attributes the placement sets (``jaxserve.model.sharding.place_model``):
    ``expert_parallel`` (experts split over the mesh rather than their width); and for the
    opt-in expert-load metric, ``load_recorder`` with ``layer_index`` (each step's tokens per
    expert are sent to it, ``jaxserve.model.expert_load``).

    Args:
      hidden_size: e.
      moe: the family's ``MoEConfig`` (E, k, f, normalisation, shared expert width).
      dtype: parameter dtype; routing is float32 whatever it is.
      rngs: initialiser keys.
      layer_index: the decoder layer's index (labels its expert load).
      impl: ``grouped_matmul``'s implementation (static).
    """

    def __init__(
        self,
        hidden_size: int,
        moe: MoEConfig,
        *,
        dtype,
        rngs: nnx.Rngs,
        layer_index: int = 0,
        impl: str = "auto",
    ):
        e, f, n = hidden_size, moe.intermediate_size, moe.num_experts
        self.num_experts, self.top_k, self.normalize = n, moe.top_k, moe.norm_topk_prob
        self.impl = impl
        self.expert_parallel = False
        self.load_recorder: ExpertLoadRecorder | None = None
        self.layer_index = layer_index
        self.gate = Linear(e, n, in_axes=("embed",), out_axes=("router",), dtype=dtype, rngs=rngs)
        kw = dict(dtype=dtype, rngs=rngs)
        self.experts = Experts(n, e, f, **kw)
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(e, shared, bias=False, **kw) if shared else None
        self.shared_expert_gate = (
            Linear(e, 1, in_axes=("embed",), out_axes=("router",), **kw) if shared else None
        )

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [T, e]`` -> ``(ids int32 [T, k], weights float32 [T, k])``; the router's logits
        are computed in float32 (``route``)."""
        return route(self.gate(x.astype(jnp.float32)), self.top_k, self.normalize)

    def __call__(
        self, x: jax.Array, token_mask: jax.Array | None = None, mesh: Mesh | None = None
    ) -> jax.Array:
        """``x [..., e]`` -> ``[..., e]`` in x's dtype.

        Args:
          token_mask: bool ``[T]`` (x flattened to ``[T, e]``), False for the bucket's padding
            tokens: they reach no expert; None: every token is real.
          mesh: the step's mesh when it has more than one device (the experts then run per
            shard, see the module docstring), else None.
        """
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, e]
        ids, weights = self.route(x)
        arrays = self.experts.arrays()
        if mesh is None:
            y = _experts(x, ids, weights, token_mask, arrays, first_expert=0, impl=self.impl)
        else:
            y = self._sharded_experts(x, ids, weights, token_mask, arrays, mesh)
        y = y.astype(x.dtype)
        if self.shared_expert is not None:
            y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.load_recorder is not None:
            counts = expert_token_counts(ids, self.num_experts, token_mask)
            jax.debug.callback(self.load_recorder.record, self.layer_index, counts)
        return y.reshape(shape)

    def _sharded_experts(self, x, ids, weights, token_mask, arrays, mesh: Mesh) -> jax.Array:
        """``_experts`` under ``shard_map``: each device runs its experts (expert parallel) or
        its slice of every expert's width (tensor parallel), then one all-reduce sums them."""
        rules = EXPERT_PARALLEL_RULES if self.expert_parallel else LOGICAL_AXIS_RULES
        specs = jax.tree.map(
            lambda a: logical_to_pspec(a, rules),
            self.experts.axes(),
            is_leaf=lambda a: isinstance(a, tuple),
        )
        mask = jnp.ones(x.shape[0], bool) if token_mask is None else token_mask
        rep = PartitionSpec()

        def per_device(x, ids, weights, mask, arrays):
            num_local = arrays["gate_proj"]["weight"].shape[0]
            first = jax.lax.axis_index(MODEL_AXIS) * num_local if self.expert_parallel else 0
            y = _experts(x, ids, weights, mask, arrays, first_expert=first, impl=self.impl)
            return jax.lax.psum(y.astype(x.dtype), MODEL_AXIS)

        return jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(rep, rep, rep, rep, specs),
            out_specs=rep,
            check_vma=False,
        )(x, ids, weights, mask, arrays)


def attach_expert_load_recorder(model: nnx.Module) -> ExpertLoadRecorder | None:
    """Gives every ``SparseMoeBlock`` of ``model`` one shared ``ExpertLoadRecorder`` (in place,
    before the model is split for jit); returns it, or None for a model without experts."""
    blocks = [m for _, m in nnx.iter_graph(model) if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return None
    recorder = ExpertLoadRecorder(tuple(b.layer_index for b in blocks), blocks[0].num_experts)
    for block in blocks:
        block.load_recorder = recorder
    return recorder
