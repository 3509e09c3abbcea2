"""KV-cache groups: which layers share a block table, and how the pool's arrays are shared.

vLLM V1's hybrid KV-cache manager (``vllm/v1/core/kv_cache_utils.py``,
``_get_kv_cache_groups_uniform_page_size``). Layers are grouped by attention kind: full
attention, or a sliding window of W tokens (one kind per window size). Each group has its own
block table per request, with blocks from one shared pool; a sliding-window group keeps only
the blocks a future token can still read (``KVCacheManager``), so a Gemma-3-style model (5 local
layers of window 1,024 to 1 global layer) holds a long context's blocks for its global layers
only.

Sharing the pool's memory: every group has the same number of layers, ``num_tensors`` (the
smallest count of any kind, as vLLM does; a kind with a remainder gets a group with fewer
layers, whose missing layers' rows are unused). The pool is ``num_tensors`` ``(k_cache,
v_cache)`` pairs of ``[num_blocks, block_size, Hkv, D]``; layer ``j`` of every group reads and
writes pair ``j``, so one block id is ``num_tensors`` layers' worth of memory and a block holds
K/V of the one group whose table holds it. Without sliding layers (or with the hybrid cache
off) there is one group of every layer and ``num_tensors`` is the number of layers: the layout
of a plain paged cache.

Grouping, e.g. 6 layers ``L L L L L G`` (L: window 1,024, G: global): the global kind has 1
layer, so ``num_tensors`` is 1 and there are 6 groups, ``(5,)`` full, then ``(0,)``, ``(1,)``,
..., ``(4,)`` sliding; 12 layers in the same pattern: 2 tensors, groups ``(5, 11)`` full and
``(0, 6)``, ``(1, 7)``, ``(2, 8)``, ``(3, 9)``, ``(4, 10)`` sliding (``layers[i::n]`` of each kind,
vLLM's order, which spreads each group's layers over the model). Full-attention groups come first, then
sliding groups by window size, each kind's groups in layer order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: layers of one attention kind that share a block table.

    Attributes:
      layers: the model's layer indices in the group (at most ``KVCacheLayout.num_tensors``);
        layer ``layers[j]`` uses the pool's array pair ``j``.
      sliding_window: the layers' window in tokens (a query at position p reads keys at
        positions > p - W), or None for full attention.
    """

    layers: tuple[int, ...]
    sliding_window: int | None = None


@dataclasses.dataclass(frozen=True)
class KVCacheLayout:
    """The model's KV-cache groups and how they share the pool's arrays (module docstring).

    Attributes:
      groups: the groups, full attention first.
      num_tensors: ``(k_cache, v_cache)`` pairs in the pool (layers per group).
      num_layers: the model's layers.

    Raises:
      ValueError: a layer in no group or in two, a group with more layers than
        ``num_tensors``, or no group.
    """

    groups: tuple[KVCacheGroupSpec, ...]
    num_tensors: int
    num_layers: int

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a KV-cache layout needs at least one group")
        seen = sorted(i for g in self.groups for i in g.layers)
        if seen != list(range(self.num_layers)):
            raise ValueError(
                f"KV-cache groups must hold each of the {self.num_layers} layers once, got "
                f"{[g.layers for g in self.groups]}"
            )
        if any(len(g.layers) > self.num_tensors for g in self.groups):
            raise ValueError(
                f"a KV-cache group has more layers than num_tensors={self.num_tensors}"
            )

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each group's sliding window (None: full attention), in group order: what the KV
        manager needs (``CacheConfig.kv_cache_groups``)."""
        return tuple(g.sliding_window for g in self.groups)

    @property
    def layer_kv(self) -> tuple[tuple[int, int], ...]:
        """Per layer, ``(group, array pair)``: the block table it reads and the pool array it
        uses (``PagedAttentionMetadata.kv_layout``)."""
        out: list[tuple[int, int] | None] = [None] * self.num_layers
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                out[layer] = (g, j)
        return tuple(out)  # type: ignore[arg-type]


def make_kv_cache_layout(
    layer_sliding_windows: Sequence[int | None],
    *,
    hybrid: bool = True,
    max_model_len: int | None = None,
) -> KVCacheLayout:
    """The KV-cache groups of a model whose layer ``i`` has window ``layer_sliding_windows[i]``.

    Args:
      layer_sliding_windows: per layer, its sliding window in tokens or None (full attention),
        ``ModelArchConfig.layer_sliding_windows``.
      hybrid: group layers by kind (vLLM's hybrid KV-cache manager). False
        (``--disable-hybrid-kv-cache-manager``): one full-attention group of every layer, so
        every layer keeps K/V for the whole context (each layer still attends within its own
        window).
      max_model_len: a window at least this long never leaves a block behind: its layers are
        grouped as full attention (None: windows are taken as they are).

    Returns:
      The layout (module docstring). One group of every layer when all layers have the same
      kind; that group is a sliding one when they all share one window (Mistral) and
      ``hybrid`` is on.

    Raises:
      ValueError: no layers, or a window < 1.
    """
    windows = list(layer_sliding_windows)
    if not windows:
        raise ValueError("layer_sliding_windows is empty: a model needs at least one layer")
    if any(w is not None and w < 1 for w in windows):
        raise ValueError(f"sliding windows must be >= 1 token, got {windows}")
    if max_model_len is not None:
        windows = [None if w is not None and w >= max_model_len else w for w in windows]
    n = len(windows)
    if not hybrid:
        return KVCacheLayout((KVCacheGroupSpec(tuple(range(n)), None),), n, n)
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        kinds.setdefault(w, []).append(i)
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))  # full first, then by window
    counts = [len(kinds[w]) for w in order]
    size = min(counts)
    if max(counts) < 1.5 * size:  # vLLM's rule: pad to the larger count when they are close
        size = max(counts)
    groups = []
    for w in order:
        layers = kinds[w]
        num_groups = -(-len(layers) // size)
        groups.extend(KVCacheGroupSpec(tuple(layers[i::num_groups]), w) for i in range(num_groups))
    return KVCacheLayout(tuple(groups), size, n)


def group_blocks_per_sequence(
    sliding_window: int | None, num_tokens: int, block_size: int, max_chunk_tokens: int | None
) -> int:
    """Most blocks one group's table holds at once for a sequence of ``num_tokens`` tokens.

    Full attention: ``ceil(num_tokens / block_size)``. A sliding window W: the blocks a chunk of
    at most ``max_chunk_tokens`` new tokens reads or writes, ``ceil((W - 1 + chunk) /
    block_size) + 1`` (the window before the chunk, the chunk, one block for misalignment;
    vLLM's ``SlidingWindowSpec.max_admission_blocks_per_request``), never more than the full
    count; ``max_chunk_tokens`` None counts the full count (no bound on a chunk).
    """
    full = -(-num_tokens // block_size)
    if sliding_window is None or max_chunk_tokens is None:
        return full
    return min(full, -(-(sliding_window - 1 + max_chunk_tokens) // block_size) + 1)


def blocks_per_sequence(
    sliding_windows: Sequence[int | None],
    num_tokens: int,
    block_size: int,
    max_chunk_tokens: int | None,
) -> int:
    """Most pool blocks a sequence of ``num_tokens`` tokens holds at once, summed over the
    groups (:func:`group_blocks_per_sequence`): the one count that KV sizing, the scheduler's
    admission and its capacity check use."""
    return sum(
        group_blocks_per_sequence(w, num_tokens, block_size, max_chunk_tokens)
        for w in sliding_windows
    )
