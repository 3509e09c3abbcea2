"""The jitted step's array inputs: a dataclass registered as a jax pytree (all fields are data)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    """The jitted step's array inputs, padded (numpy int32).

    Attributes:
      input_ids: ``[T]`` token ids (0 for padding).
      positions: ``[T]`` position of each token in its sequence (0 for padding).
      slot_mapping: ``[T]`` flat cache slot of each token; -1 for padding.
      block_tables: ``[S, P]`` block ids per sequence, padded with the null block 0.
      context_lens: ``[S]`` tokens in the cache after this step's writes; 0 for padding.
      query_start_loc: ``[S + 1]`` cumulative query lengths (padding sequences are empty).
      num_seqs: ``[]`` real sequences.
      logits_indices: ``[S]`` index into the step's tokens of each sequence's last token (the
        one whose logits are sampled); 0 for padding sequences.
      prev_index: ``[T]`` for a token the host does not know yet (async scheduling: sampled by
        the step still in flight), its row in ``prev_tokens``; -1 elsewhere.
      prev_tokens: ``[S_max]`` the previous step's sampled tokens, padded to the largest
        sequence bucket; a device array, so they never visit the host before this step.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray
    query_start_loc: np.ndarray
    num_seqs: np.ndarray
    logits_indices: np.ndarray
    prev_index: np.ndarray
    prev_tokens: np.ndarray | jax.Array

    @classmethod
    def padding(
        cls, token_bucket: int, seq_bucket: int, max_blocks_per_req: int, max_seq_bucket: int
    ) -> StepInputs:
        """All-padding inputs of a ``[T = token_bucket, S = seq_bucket]`` step: one sequence of
        one token whose slot is -1 (it writes nothing); for compiling and profiling."""
        query_start_loc = np.ones(seq_bucket + 1, np.int32)
        query_start_loc[0] = 0
        context_lens = np.zeros(seq_bucket, np.int32)
        context_lens[0] = 1
        return cls(
            input_ids=np.zeros(token_bucket, np.int32),
            positions=np.zeros(token_bucket, np.int32),
            slot_mapping=np.full(token_bucket, -1, np.int32),
            block_tables=np.zeros((seq_bucket, max_blocks_per_req), np.int32),
            context_lens=context_lens,
            query_start_loc=query_start_loc,
            num_seqs=np.asarray(1, np.int32),
            logits_indices=np.zeros(seq_bucket, np.int32),
            prev_index=np.full(token_bucket, -1, np.int32),
            prev_tokens=np.zeros(max_seq_bucket, np.int32),
        )
