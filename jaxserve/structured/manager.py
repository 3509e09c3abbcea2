"""Per-request token-mask state and the step's bitmask (one call per engine step).

    masks = TokenMaskManager(tokenizer)
    masks.add_request(req_id, params)             # at admission; ValueError if it cannot compile
    mask = masks.step_mask(sched_out, requests)   # once per step: StepTokenMask | None
    mask.req_ids[k], mask.bitmask[k]             # row k: int32[W], W = ceil(vocab / 32)

Bit ``t % 32`` of word ``t // 32`` of a row is 1 when token ``t`` may be sampled. A row is the
AND of the request's grammar mask (structured outputs), its ``allowed_token_ids`` and its
``bad_words`` bans. Requests without any of them get no row (the sampler leaves their logits
alone).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.sampling_params import SamplingParams
from jaxserve.structured.grammar import continuation_ids, new_matcher

if TYPE_CHECKING:
    from jaxserve.core.request import Request
    from jaxserve.core.sched_output import SchedulerOutput
    from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PARALLEL_MIN_ROWS = 8
"""Grammar rows from which masks are filled by llguidance's thread pool (fewer: one by one)."""

PARALLEL_MIN_CPUS = 4
"""CPUs from which the thread pool is used at all: on a 2-core box shared with the engine
thread it measured slower than filling the masks one by one (32-79 ms vs 16-30 ms for 256)."""


@dataclasses.dataclass(frozen=True)
class StepTokenMask:
    """The token masks of one step's constrained requests (plain numpy, no jax).

    Attributes:
      req_ids: the constrained requests scheduled this step (any order).
      bitmask: int32 [len(req_ids), W] with W = ceil(vocab_size / 32), vocab_size the
        tokenizer's; row k belongs to ``req_ids[k]``. Tokens past the tokenizer's vocabulary
        are never allowed on these rows.
    """

    req_ids: list[str]
    bitmask: np.ndarray


def _bits(token_ids: list[int], words: int) -> np.ndarray:
    """int32 [words] with the bits of ``token_ids`` set (ids past the width are dropped)."""
    flat = np.zeros(words * 32, np.bool_)
    ids = np.asarray([t for t in token_ids if t < words * 32], np.int64)
    flat[ids] = True
    return np.packbits(flat, bitorder="little").view(np.int32)


@dataclasses.dataclass
class _RequestMaskState:
    matcher: Any | None  # llguidance.LLMatcher, or None without structured outputs
    num_consumed: int  # output tokens the matcher has consumed
    allowed: np.ndarray | None  # int32 [W] from allowed_token_ids
    bad_words: list[list[int]]  # token sequences of bad_words


class TokenMaskManager:
    """Keeps a matcher per constrained request and builds each step's :class:`StepTokenMask`.

    Args:
      tokenizer: the model's tokenizer (token bytes for the grammar; its EOS ends a grammar).

    Not thread-safe: the engine thread calls it once per step.
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size if tokenizer is not None else 0
        self.num_words = (self.vocab_size + 31) // 32
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else None
        self._states: dict[str, _RequestMaskState] = {}
        self._executor: Any | None = None
        self.mask_seconds = 0.0  # cumulative host time in step_mask (benchmarks)

    def __len__(self) -> int:
        return len(self._states)

    def add_request(self, req_id: str, params: SamplingParams) -> None:
        """Starts the mask state of a request that needs one (no-op for the others).

        Raises:
          ValueError: no tokenizer (for grammars and bad_words), or the constraint does not
            compile (naming ``structured_outputs``).
        """
        if not params.needs_token_mask:
            return
        if self.tokenizer is None and (params.structured_outputs or params.bad_words):
            raise ValueError("structured_outputs: needs a tokenizer, and this model has none")
        matcher = None
        if params.structured_outputs is not None:
            matcher = new_matcher(params.structured_outputs, self.tokenizer)
        allowed = None
        if params.allowed_token_ids is not None:
            allowed = _bits(params.allowed_token_ids, self.num_words)
        bad = []
        for word in params.bad_words:
            for text in (word, " " + word):
                ids = continuation_ids(self.tokenizer, text)
                if ids and ids not in bad:
                    bad.append(ids)
        self._states[req_id] = _RequestMaskState(matcher, 0, allowed, bad)

    def _only_eos(self, row: np.ndarray) -> None:
        row[:] = 0
        if self.eos_token_id is not None:
            row.view(np.uint32)[self.eos_token_id // 32] = 1 << (self.eos_token_id % 32)

    def drop(self, req_ids: Any) -> None:
        """Forgets finished or aborted requests (unknown ids are ignored)."""
        for req_id in req_ids:
            self._states.pop(req_id, None)

    def step_mask(
        self, sched_out: SchedulerOutput, requests: Mapping[str, Request]
    ) -> StepTokenMask | None:
        """The masks of this step's scheduled constrained requests, or None when there are none.

        Drops the state of ``sched_out.finished_req_ids``; advances each matcher over the
        request's output tokens it has not consumed yet; fills the next-token masks.
        """
        t0 = time.perf_counter()
        if sched_out.finished_req_ids:
            self.drop(sched_out.finished_req_ids)
        if not self._states:
            return None
        scheduled = sched_out.num_scheduled_tokens
        req_ids = [r for r in self._states if r in scheduled]
        if not req_ids:
            return None
        bitmask = np.full((len(req_ids), self.num_words), -1, np.int32)
        grammar_rows: list[tuple[Any, int]] = []
        broken: list[int] = []
        for k, req_id in enumerate(req_ids):
            request = requests[req_id]
            state = self._states[req_id]
            matcher = state.matcher
            if matcher is None:
                continue
            new = request.output_token_ids[state.num_consumed :]
            if new:
                state.num_consumed += len(new)
                if not matcher.consume_tokens(list(new)):
                    logger.warning(
                        "request %s: its grammar refused a sampled token (%s); only EOS is "
                        "allowed from here",
                        req_id,
                        matcher.get_error().splitlines()[0],
                    )
            if matcher.is_error():
                broken.append(k)
            else:
                grammar_rows.append((matcher, k))
        self._fill(grammar_rows, bitmask)
        for k in broken:
            self._only_eos(bitmask[k])
        for k, req_id in enumerate(req_ids):
            state = self._states[req_id]
            if state.allowed is not None:
                bitmask[k] &= state.allowed
            if state.bad_words:
                self._ban_bad_words(bitmask[k], state.bad_words, requests[req_id].output_token_ids)
        self.mask_seconds += time.perf_counter() - t0
        return StepTokenMask(req_ids, bitmask)

    def _fill(self, rows: list[tuple[Any, int]], bitmask: np.ndarray) -> None:
        if not rows:
            return
        import llguidance.numpy as lln

        if len(rows) < PARALLEL_MIN_ROWS or (os.cpu_count() or 1) < PARALLEL_MIN_CPUS:
            for matcher, k in rows:
                lln.fill_next_token_bitmask(matcher, bitmask, k)
            return
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        lln.fill_next_token_bitmask_par(self._executor, rows, bitmask)

    @staticmethod
    def _ban_bad_words(row: np.ndarray, words: list[list[int]], output: list[int]) -> None:
        """vLLM's bad-words rule: the last token of a word is banned when the output ends with
        the rest of the word (a one-token word is always banned)."""
        for word in words:
            prefix = word[:-1]
            if prefix and (len(output) < len(prefix) or output[-len(prefix) :] != prefix):
                continue
            last = word[-1]
            if last < row.shape[0] * 32:
                row.view(np.uint32)[last // 32] &= ~(1 << (last % 32)) & 0xFFFFFFFF
