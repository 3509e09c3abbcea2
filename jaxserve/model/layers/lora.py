"""LoRA deltas at the ``Linear`` seam: a step's tokens, each on its own adapter or on none.

A LoRA adapter (Hu et al. 2021) adds ``x · A_i · B_i`` to a projection's output, where ``A_i``
is ``[in, r]`` and ``B_i`` ``[r, out]`` (the adapter's scaling already folded into ``B_i``).
Adapters resident on the device sit in a fixed pool of ``max_loras`` slots per projection,
zero-padded to ``max_lora_rank`` (``Linear.lora_a [L, *in, R]`` / ``lora_b [L, R, *out]``), so
swapping one in is an in-place write of one slot and no recompile.

A step's adapter batch (``LoraBatch``) is built on the host: each token's slot (-1: the base
model), the order that sorts tokens by slot (adapter tokens first, slot 0's, then slot 1's,
...; base tokens last) and the tokens per slot. ``lora_delta`` then runs one of two backends,
both of whose cost follows the tokens, not the number of adapters loaded:

* ``"gather"`` (the default; punica's BGMV): gathers each token's ``A[slot]`` / ``B[slot]``
  and contracts per token, ``T * (in + out) * R`` flops and gathered elements, flat in the
  adapters resident or in use. On XLA:CPU it measured flat from 1 to 32 adapters at 256
  decode tokens, while ``jax.lax.ragged_dot`` grew with the adapters in use (it lowers to a
  loop over groups there); figures in ``benchmarks/RESULTS.md`` (``bench_lora.py``).
* ``"ragged"``: ``jax.lax.ragged_dot`` over the adapter-sorted tokens (a grouped GEMM that
  reads each used adapter once; rows after the last group come out zero). On GPU/TPU this is
  the grouped-matmul path to measure against ``"gather"``; unmeasured there.

Base-only tokens add no work at the step level: a step with no adapter token runs the model
without a ``LoraBatch`` (the same executable as without ``--enable-lora``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

LORA_BACKENDS = ("gather", "ragged")


@dataclasses.dataclass(frozen=True)
class LoraBatch:
    """A step's adapter assignment, shared by every LoRA-enabled ``Linear``.

    Attributes:
      token_slots: int32 ``[T]``, each token's device slot, -1 for the base model (and padding).
      sort_order: int32 ``[T]``, token indices sorted by slot, base tokens last (``"ragged"``).
      unsort_order: int32 ``[T]``, the inverse permutation of ``sort_order``.
      group_sizes: int32 ``[L]``, tokens per slot (``"ragged"``).
      backend: static; one of ``LORA_BACKENDS``.
    """

    token_slots: jax.Array
    sort_order: jax.Array
    unsort_order: jax.Array
    group_sizes: jax.Array
    backend: str = "gather"

    @classmethod
    def from_slots(cls, token_slots: np.ndarray, max_loras: int, backend: str = "gather"):
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
        return cls(slots, order, unsort, sizes, backend)


jax.tree_util.register_dataclass(
    LoraBatch,
    data_fields=["token_slots", "sort_order", "unsort_order", "group_sizes"],
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
    if batch.backend == "ragged":
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
