"""The n-gram proposer of speculative decoding (prompt lookup; vLLM's ``NgramProposer``).

A sequence whose output repeats its prompt (copying a list with one change, editing code,
quoting a document) often continues as it did the last time it read its current last tokens.
For each request that sampled in a step, the proposer takes its last ``n`` tokens, for ``n``
from ``prompt_lookup_max`` down to ``prompt_lookup_min``, finds their latest earlier occurrence
in its own tokens (prompt and output), and proposes the up to K tokens that followed it. The
longest ``n`` that occurs wins; no occurrence, no drafts.

Host-side numpy over the runner's persistent rows (``InputBatch.token_ids``), after the step's
tokens are written there; about ten vector operations over the row per request (the candidate
positions shrink with each token of the n-gram compared).
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes draft tokens by prompt lookup.

    Args:
      num_speculative_tokens: K, most drafts per request (>= 1).
      prompt_lookup_min, prompt_lookup_max: shortest and longest n-gram tried (1 <= min <= max).

    Raises:
      ValueError: a size out of range (named).
    """

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{prompt_lookup_min} and {prompt_lookup_max}"
            )
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, tokens: np.ndarray) -> list[int]:
        """Drafts that follow ``tokens`` (int ``[L]``, a request's prompt + output so far).

        Returns:
          Up to K token ids: those that followed the latest earlier occurrence of the longest
          suffix n-gram (``min_n <= n <= max_n``) that occurs earlier; fewer when the sequence
          ends sooner after it; ``[]`` when none occurs.
        """
        length = tokens.shape[0]
        if length <= self.min_n:
            return []
        # Candidates: end positions e (exclusive) of an earlier n-gram, e <= length - 1 so that
        # a token follows it; each pass keeps those whose n-th last token matches too.
        ends = np.arange(1, length)
        best = -1
        for n in range(1, min(self.max_n, length - 1) + 1):
            ends = ends[ends >= n]
            ends = ends[tokens[ends - n] == tokens[length - n]]
            if ends.size == 0:
                break
            if n >= self.min_n:
                best = int(ends[-1])  # the latest occurrence of the longest match so far
        if best < 0:
            return []
        return tokens[best : best + self.k].tolist()

    def propose_rows(
        self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: list[int]
    ) -> list[list[int]]:
        """``propose`` for each of ``rows`` of the runner's persistent batch.

        Args:
          token_ids: int32 ``[max_num_reqs, max_model_len]`` (``InputBatch.token_ids``).
          num_tokens: int ``[max_num_reqs]``, known tokens per row.
          rows: the rows to propose for.
        """
        return [self.propose(token_ids[row, : num_tokens[row]]) for row in rows]
