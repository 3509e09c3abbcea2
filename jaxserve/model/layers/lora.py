"""LoRA deltas at the ``Linear`` seam: a step's tokens, each on its own adapter or on none.

A LoRA adapter (Hu et al. 2021) adds ``x · A_i · B_i`` to a projection's output, where ``A_i``
is ``[in, r]`` and ``B_i`` ``[r, out]`` (the adapter's scaling already folded into ``B_i``).
Adapters resident on the device sit in a fixed pool of ``max_loras`` slots per projection,
zero-padded to ``max_lora_rank`` (``Linear.lora_a [L, *in, R]`` / ``lora_b [L, R, *out]``), so
swapping one in is an in-place write of one slot and no recompile.

A step's adapter batch (``LoraBatch``) is built on the host: each token's slot (-1: the base
model), the order that sorts tokens by slot, the tokens per slot and the tiles below.
``lora_delta`` runs one of three backends, all of whose cost is set by the step's tokens and
static shapes, not by how many adapters the step uses:

* ``"sgmv"`` (the default; punica's SGMV, megablox's grouped GEMM in tiles): the adapter tokens,
  sorted by adapter, are cut into tiles of ``SGMV_TILE`` tokens, each tile on one adapter; one
  batched GEMM over a static ``num_tiles(T, L) = T // 16 + min(L, T)`` tiles gathers each
  tile's ``A`` / ``B`` once. Base tokens sit in no tile. It reads ``K * (in + out) * R``
  adapter elements (K = 48 at T = 256, L = 32) instead of the per-token ``T * (in + out) * R``.
* ``"gather"`` (punica's BGMV): gathers each token's ``A[slot]`` / ``B[slot]`` and contracts per
  token; memory-bound (a [T, in, R] gather per projection).
* ``"ragged"``: ``jax.lax.ragged_dot`` over the adapter-sorted tokens (a grouped GEMM that reads
  each used adapter once; rows after the last group come out zero).

Measured on XLA:CPU (``benchmarks/bench_lora_delta.py``, 256 tokens, rank 16, 32 slots, 4096 x
4096 projection, 2026-12-01, machine load ~19): sgmv 116-136 ms, gather 300-343 ms, ragged
467-586 ms (XLA:CPU lowers it to a loop), and the one-hot einsum over all slots that public JAX
servers use 71-89 ms: on CPU a dense GEMM over 32 slots still beats the gathers, but its cost
grows with ``max_loras`` (T * L * (in + out) * R flops), which is what #33 avoids; sgmv's grows
only by the ``min(L, T)`` padding tiles. At the step level (``benchmarks/bench_lora.py``) sgmv
is flat from 1 to 32 adapters in use (figures in ``benchmarks/RESULTS.md``). On GPU/TPU,
``"ragged"`` (a real grouped GEMM there) and a Pallas SGMV kernel are what to measure against
it; unmeasured (no device this session).

Base-only tokens add no work at the step level: a step with no adapter token runs the model
without a ``LoraBatch`` (the same executable as without ``--enable-lora``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

LORA_BACKENDS = ("sgmv", "gather", "ragged")
SGMV_TILE = 16
"""Tokens per tile of the ``"sgmv"`` backend."""


def num_tiles(num_tokens: int, max_loras: int, tile: int = SGMV_TILE) -> int:
    """The ``"sgmv"`` backend's static tile count for ``num_tokens`` tokens over at most
    ``max_loras`` adapters: each adapter's tokens take ``ceil(n / tile)`` tiles, at most
    ``num_tokens // tile + min(max_loras, num_tokens)`` in all."""
    return num_tokens // tile + min(max_loras, num_tokens)


@dataclasses.dataclass(frozen=True)
class LoraBatch:
    """A step's adapter assignment, shared by every LoRA-enabled ``Linear``.

    Attributes:
      token_slots: int32 ``[T]``, each token's device slot, -1 for the base model (and padding).
      sort_order: int32 ``[T]``, token indices sorted by slot, base tokens last (``"ragged"``).
      unsort_order: int32 ``[T]``, the inverse permutation of ``sort_order``.
      group_sizes: int32 ``[L]``, tokens per slot (``"ragged"``).
      tile_tokens: int32 ``[K, SGMV_TILE]``, the adapter tokens tile by tile, each tile on one
        adapter; T (a zero row) pads a tile (``"sgmv"``; K = ``num_tiles(T, L)``).
      tile_slots: int32 ``[K]``, each tile's slot (0 for all-padding tiles).
      backend: static; one of ``LORA_BACKENDS``.
    """

    token_slots: jax.Array
    sort_order: jax.Array
    unsort_order: jax.Array
    group_sizes: jax.Array
    tile_tokens: jax.Array
    tile_slots: jax.Array
    backend: str = "sgmv"

    @classmethod
    def from_slots(cls, token_slots: np.ndarray, max_loras: int, backend: str = "sgmv"):
        """Builds the batch on the host from int ``[T]`` slots (-1: base model).

        Raises:
          ValueError: a slot outside ``[-1, max_loras)`` or an unknown backend.
        """
        if backend not in LORA_BACKENDS:
            raise ValueError(f"lora backend must be one of {LORA_BACKENDS}, got {backend!r}")
        slots = np.asarray(token_slots, np.int32)
        if slots.size and (slots.min() < -1 or slots.max() >= max_loras):
            raise ValueError(f"LoRA slots must lie in [-1, {max_loras}), got {slots}")
        key = np.where(slots < 0, max_loras, slots)
        order = np.argsort(key, kind="stable").astype(np.int32)
        unsort = np.empty_like(order)
        unsort[order] = np.arange(order.size, dtype=np.int32)
        sizes = np.bincount(key, minlength=max_loras + 1)[:max_loras].astype(np.int32)
        t = slots.size
        tiles = np.full((num_tiles(t, max_loras), SGMV_TILE), t, np.int32)
        tile_slots = np.zeros(len(tiles), np.int32)
        k = start = 0
        for slot in np.nonzero(sizes)[0]:  # each adapter's tokens, tile by tile
            n = int(sizes[slot])
            for first in range(0, n, SGMV_TILE):
                chunk = order[start + first : start + min(n, first + SGMV_TILE)]
                tiles[k, : chunk.size] = chunk
                tile_slots[k] = slot
                k += 1
            start += n
        return cls(slots, order, unsort, sizes, tiles, tile_slots, backend)


jax.tree_util.register_dataclass(
    LoraBatch,
    data_fields=[
        "token_slots",
        "sort_order",
        "unsort_order",
        "group_sizes",
        "tile_tokens",
        "tile_slots",
    ],
    meta_fields=["backend"],
)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, batch: LoraBatch) -> jax.Array:
    """The adapters' delta ``x · A[slot] · B[slot]`` per token (0 for slot -1).

    Args:
      x: ``[T, *in]`` (the leading axes flattened into T must equal ``batch``'s T).
      a: ``[L, *in, R]`` the pool's A matrices; b: ``[L, R, *out]`` its B (scaling folded in).
      batch: the step's ``LoraBatch``.

    Returns:
      ``[T, *out]`` in x's dtype.
    """
    num_slots, rank = a.shape[0], a.shape[-1]
    in_shape, out_shape = a.shape[1:-1], b.shape[2:]
    lead = x.shape[: x.ndim - len(in_shape)]
    xf = x.reshape(-1, math.prod(in_shape))  # [T, in]
    af = a.reshape(num_slots, -1, rank).astype(x.dtype)  # [L, in, R]
    bf = b.reshape(num_slots, rank, -1).astype(x.dtype)  # [L, R, out]
    if batch.backend == "sgmv":
        tiles = batch.tile_tokens  # [K, tile]
        xp = jnp.concatenate([xf, jnp.zeros((1, xf.shape[1]), xf.dtype)])[tiles]  # [K, tile, in]
        h = jnp.einsum("kti,kir->ktr", xp, af[batch.tile_slots])  # [K, tile, R]
        dk = jnp.einsum("ktr,kro->kto", h, bf[batch.tile_slots])  # [K, tile, out]
        d = jnp.zeros((xf.shape[0] + 1, dk.shape[-1]), dk.dtype)
        d = d.at[tiles.reshape(-1)].add(dk.reshape(-1, dk.shape[-1]))[:-1]  # [T, out]
    elif batch.backend == "ragged":
        xs = xf[batch.sort_order]
        h = jax.lax.ragged_dot(xs, af, batch.group_sizes)  # [T, R]
        d = jax.lax.ragged_dot(h, bf, batch.group_sizes)[batch.unsort_order]  # [T, out]
    else:
        slots = batch.token_slots
        sel = jnp.maximum(slots, 0)
        h = jnp.einsum("ti,tir->tr", xf, af[sel])  # [T, R]
        h = jnp.where((slots >= 0)[:, None], h, jnp.zeros((), h.dtype))
        d = jnp.einsum("tr,tro->to", h, bf[sel])  # [T, out]
    return d.reshape(*lead, *out_shape)
