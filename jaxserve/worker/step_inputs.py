"""The jitted step's array inputs: a dataclass registered as a jax pytree (one packed int32 buffer
and the previous step's sampled tokens are its data, the layout its static part)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np

_HOST_FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "block_tables",
    "context_lens",
    "query_start_loc",
    "num_seqs",
    "logits_indices",
    "prev_index",
)


@functools.cache
def _offsets(layout: tuple) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """name -> (start, size, shape) of each field in the packed buffer."""
    out, start = {}, 0
    for name, shape in layout:
        size = math.prod(shape)
        out[name] = (start, size, shape)
        start += size
    return out


def _field(name: str) -> property:
    def get(self: StepInputs):
        start, size, shape = _offsets(self.layout)[name]
        return self.packed[start : start + size].reshape(shape)

    return property(get, doc=f"``{name}``: a view of ``packed`` (see the class docstring).")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["packed", "prev_tokens"],
    meta_fields=["layout"],
)
@dataclasses.dataclass
class StepInputs:
    """The jitted step's array inputs, padded (int32).

    The host-built fields live in one int32 buffer, ``packed``, so a step makes one
    host-to-device copy for them, not one per field; each field is a view of it (numpy on the
    host, a slice of the traced buffer inside the jitted step). Build with :meth:`from_arrays`.

    Fields (views of ``packed``):
      input_ids: ``[T]`` token ids (0 for padding).
      positions: ``[T]`` position of each token in its sequence (0 for padding).
      slot_mapping: ``[G, T]`` per KV-cache group, the flat cache slot of each token; -1 for
        padding.
      block_tables: ``[G, S, P]`` per KV-cache group, the block ids of each sequence, padded
        with the null block 0.
      context_lens: ``[S]`` tokens in the cache after this step's writes; 0 for padding.
      query_start_loc: ``[S + 1]`` cumulative query lengths (padding sequences are empty).
      num_seqs: ``[]`` real sequences.
      logits_indices: ``[S]`` index into the step's tokens of each sequence's last token (the
        one whose logits are sampled); 0 for padding sequences.
      prev_index: ``[T]`` for a token the host does not know yet (async scheduling: sampled by
        the step still in flight), its row in ``prev_tokens``; -1 elsewhere.

    Attributes:
      packed: int32 ``[sum of the fields' sizes]``, the fields above in that order.
      prev_tokens: ``[S_max]`` the previous step's sampled tokens, padded to the largest
        sequence bucket; a device array, so they never visit the host before this step.
      layout: ``((name, shape), ...)`` of the packed fields (static: part of the pytree's
        structure, so each bucket's shapes compile once).
    """

    packed: np.ndarray | jax.Array
    prev_tokens: np.ndarray | jax.Array
    layout: tuple

    input_ids = _field("input_ids")
    positions = _field("positions")
    slot_mapping = _field("slot_mapping")
    block_tables = _field("block_tables")
    context_lens = _field("context_lens")
    query_start_loc = _field("query_start_loc")
    num_seqs = _field("num_seqs")
    logits_indices = _field("logits_indices")
    prev_index = _field("prev_index")

    @staticmethod
    def offsets(layout: tuple) -> dict[str, tuple[int, int, tuple[int, ...]]]:
        """name -> (start, size, shape) of each field of ``layout`` in the packed buffer."""
        return _offsets(layout)

    @classmethod
    def from_arrays(cls, prev_tokens: np.ndarray | jax.Array, **fields: np.ndarray) -> StepInputs:
        """Packs the host fields (the names above, int32-convertible) into one buffer.

        Raises:
          KeyError: a field is missing.
        """
        arrays = [np.asarray(fields[name], np.int32) for name in _HOST_FIELDS]
        layout = tuple((name, a.shape) for name, a in zip(_HOST_FIELDS, arrays))
        packed = np.concatenate([a.ravel() for a in arrays])
        return cls(packed, prev_tokens, layout)

    @classmethod
    def padding(
        cls,
        token_bucket: int,
        seq_bucket: int,
        max_blocks_per_req: int,
        max_seq_bucket: int,
        num_groups: int = 1,
    ) -> StepInputs:
        """All-padding inputs of a ``[T = token_bucket, S = seq_bucket]`` step with
        ``num_groups`` KV-cache groups: one sequence of one token whose slots are -1 (it writes
        nothing); for compiling and profiling."""
        query_start_loc = np.ones(seq_bucket + 1, np.int32)
        query_start_loc[0] = 0
        context_lens = np.zeros(seq_bucket, np.int32)
        context_lens[0] = 1
        return cls.from_arrays(
            input_ids=np.zeros(token_bucket, np.int32),
            positions=np.zeros(token_bucket, np.int32),
            slot_mapping=np.full((num_groups, token_bucket), -1, np.int32),
            block_tables=np.zeros((num_groups, seq_bucket, max_blocks_per_req), np.int32),
            context_lens=context_lens,
            query_start_loc=query_start_loc,
            num_seqs=np.asarray(1, np.int32),
            logits_indices=np.zeros(seq_bucket, np.int32),
            prev_index=np.full(token_bucket, -1, np.int32),
            prev_tokens=np.zeros(max_seq_bucket, np.int32),
        )
