"""Per-request token-mask state and the step's bitmask (one call per engine step).

    masks = TokenMaskManager(tokenizer)
    masks.add_request(req_id, params)             # at admission: copies the prepared plan
    ended = masks.advance(core_outputs)           # after each step's update: grammar done/failed
    mask = masks.step_mask(sched_out, requests)   # once per step: StepTokenMask | None
    mask.req_ids[k], mask.bitmask[k]             # row k: int32[W], W = ceil(vocab / 32)

Bit ``t % 32`` of word ``t // 32`` of a row is 1 when token ``t`` may be sampled. A row is the
AND of the request's grammar mask (structured outputs), its ``allowed_token_ids`` and its
``bad_words`` bans. Requests without any of them get no row (the sampler leaves their logits
alone).

Engine-thread work per request is bounded by what ``prepare_token_masks`` made beforehand
(the server prepares it in a worker thread, ``SamplingParams.token_mask_plan``): ``add_request``
copies a template matcher; each step consumes the new tokens (llguidance, GIL released), fills
the grammar row within llguidance's per-mask limits, ANDs one fixed row and clears the bad-word
automaton node's banned ids.

A grammar that is complete (its matcher can take no more tokens) ends the request with "stop" on
the token that completed it, even with ``ignore_eos`` or when EOS is banned; a matcher that
refuses a token or hits a limit mid-generation ends it with "error", the reason in
``stop_reason`` and one warning in the log (``advance``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.core.request import FinishReason, RequestStatus
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured.bad_words import BadWords
from jaxserve.structured.plan import TokenMaskPlan, prepare_token_masks

if TYPE_CHECKING:
    from jaxserve.core.engine_core_output import DecodeTokens, EngineCoreOutput
    from jaxserve.core.request import Request
    from jaxserve.core.sched_output import SchedulerOutput
    from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PARALLEL_MIN_ROWS = 8
"""Grammar rows from which masks are filled by llguidance's thread pool (fewer: one by one)."""

PARALLEL_MIN_CPUS = 4
"""CPUs from which the thread pool is used at all: on a 2-core box shared with the engine
thread it measured slower than filling the masks one by one (32-79 ms vs 16-30 ms for 256)."""

MATCHER_ERROR_PREFIX = "structured output constraint failed: "
"""Start of the ``stop_reason`` of a request its grammar ended with "error"."""


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


@dataclasses.dataclass
class _RequestMaskState:
    plan: TokenMaskPlan
    matcher: Any | None  # llguidance.LLMatcher, or None without structured outputs
    num_consumed: int = 0  # output tokens the matcher has consumed
    bad_node: int = BadWords.ROOT  # bad-word automaton node after ``bad_seen`` output tokens
    bad_seen: int = 0
    failed: bool = False  # the matcher failed (logged once; only EOS from here)


class TokenMaskManager:
    """Keeps a matcher per constrained request and builds each step's :class:`StepTokenMask`.

    Args:
      tokenizer: the model's tokenizer (token bytes for the grammar; its EOS ends a grammar).
      bounded_numbers: the default for JSON numbers of requests that do not say (see
        ``jaxserve.structured.json_numbers``).
      vocab_size: the mask width's vocabulary without a tokenizer (the model's).

    Not thread-safe: the engine thread calls it.
    """

    def __init__(
        self, tokenizer: Tokenizer | None, *, bounded_numbers: bool = True, vocab_size: int = 0
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size if tokenizer is not None else vocab_size
        self.num_words = (self.vocab_size + 31) // 32
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else None
        self.bounded_numbers = bounded_numbers
        self._states: dict[str, _RequestMaskState] = {}
        self._executor: Any | None = None
        self.mask_seconds = 0.0  # cumulative host time in step_mask (benchmarks)

    def __len__(self) -> int:
        return len(self._states)

    def add_request(self, req_id: str, params: SamplingParams) -> None:
        """Starts the mask state of a request that needs one (no-op for the others): copies
        ``params.token_mask_plan``, or prepares the plan here when there is none (the offline
        API; linear in the request, but on this thread).

        Raises:
          ValueError: no tokenizer (for grammars and bad_words), or the constraint is refused
            (naming ``structured_outputs``).
        """
        if not params.needs_token_mask:
            return
        plan = params.token_mask_plan
        if not isinstance(plan, TokenMaskPlan) or (
            plan.tokenizer is not self.tokenizer or plan.num_words != self.num_words
        ):
            plan = prepare_token_masks(
                params,
                self.tokenizer,
                bounded_numbers=self.bounded_numbers,
                vocab_size=self.vocab_size,
            )
        compiled = plan.compiled()  # done: AsyncLLM awaited it (or it was prepared here)
        matcher = compiled.template.deep_copy() if compiled is not None else None
        self._states[req_id] = _RequestMaskState(plan, matcher)

    def drop(self, req_ids: Any) -> None:
        """Forgets finished or aborted requests (unknown ids are ignored)."""
        for req_id in req_ids:
            self._states.pop(req_id, None)

    def _fail(self, req_id: str, state: _RequestMaskState) -> str:
        """Marks the matcher failed, logs it once; returns the reason."""
        error = state.matcher.get_error() or "the grammar refused a sampled token"
        reason = MATCHER_ERROR_PREFIX + error.strip().splitlines()[0]
        if not state.failed:
            state.failed = True
            logger.warning("request %s: %s", req_id, reason)
        return reason

    def _consume(self, req_id: str, state: _RequestMaskState, tokens: Any) -> None:
        """Feeds output tokens to the request's matcher (marks it failed if one is refused)."""
        state.num_consumed += len(tokens)
        if not state.failed and not state.matcher.consume_tokens(list(tokens)):
            self._fail(req_id, state)

    def advance(
        self, outputs: list[EngineCoreOutput] | DecodeTokens
    ) -> dict[RequestStatus, list[str]]:
        """Feeds each constrained request's new tokens to its matcher right after the step's
        update, and ends the requests whose grammar is done with them.

        A grammar that can take no more tokens ends its request with "stop" on this token (a
        "length" finish on the same token becomes "stop": the answer is whole); a matcher
        that failed (a refused token, a limit hit) ends it with "error" and the reason in
        ``stop_reason``. The outputs are updated in place.

        A steady-decode step's ``DecodeTokens`` holds no request with a grammar (their sampling
        reads their output, which keeps them off that path) and is skipped.

        Returns:
          Request ids to finish in the scheduler, by status (requests still running there).
        """
        ended: dict[RequestStatus, list[str]] = {}
        if not self._states or not isinstance(outputs, list):
            return ended
        states = self._states
        for co in outputs:
            state = states.get(co.req_id)
            if state is None or state.matcher is None or not co.new_token_ids:
                continue
            running = co.finish_reason is None
            if not running and co.finish_reason != FinishReason.LENGTH.value:
                continue
            self._consume(co.req_id, state, co.new_token_ids)
            if state.failed:
                if running:
                    co.finish_reason = FinishReason.ERROR.value
                    co.stop_reason = self._fail(co.req_id, state)
                    ended.setdefault(RequestStatus.FINISHED_ERROR, []).append(co.req_id)
            elif state.matcher.is_stopped():
                co.finish_reason = FinishReason.STOP.value
                if running:
                    ended.setdefault(RequestStatus.FINISHED_STOPPED, []).append(co.req_id)
        return ended

    def step_mask(
        self, sched_out: SchedulerOutput, requests: Mapping[str, Request]
    ) -> StepTokenMask | None:
        """The masks of this step's scheduled constrained requests, or None when there are none.

        Drops the state of ``sched_out.finished_req_ids``; feeds each matcher the output tokens
        ``advance`` did not (e.g. a step whose update went another way); fills the next-token
        masks.
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
            state = self._states[req_id]
            matcher = state.matcher
            if matcher is None:
                continue
            new = requests[req_id].output_token_ids[state.num_consumed :]
            if new:
                self._consume(req_id, state, new)
            if state.failed or matcher.is_error():
                if not state.failed:
                    self._fail(req_id, state)
                broken.append(k)
            else:
                grammar_rows.append((matcher, k))
        self._fill(grammar_rows, bitmask)
        for k in broken:
            self._only_eos(bitmask[k])
        for k, req_id in enumerate(req_ids):
            state = self._states[req_id]
            plan = state.plan
            if plan.fixed_row is not None:
                bitmask[k] &= plan.fixed_row
            if plan.bad_words is not None:
                self._ban_bad_words(bitmask[k], state, requests[req_id].output_token_ids)
        self.mask_seconds += time.perf_counter() - t0
        return StepTokenMask(req_ids, bitmask)

    def _only_eos(self, row: np.ndarray) -> None:
        row[:] = 0
        if self.eos_token_id is not None:
            row.view(np.uint32)[self.eos_token_id // 32] = 1 << (self.eos_token_id % 32)

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
    def _ban_bad_words(row: np.ndarray, state: _RequestMaskState, output: list[int]) -> None:
        """vLLM's bad-words rule through the automaton: moves the request's node over its new
        output tokens, then clears the bits of the tokens that node bans."""
        words = state.plan.bad_words
        if len(output) > state.bad_seen:
            state.bad_node = words.advance(state.bad_node, output[state.bad_seen :])
            state.bad_seen = len(output)
        banned = words.banned(state.bad_node)
        if len(banned):
            banned = banned[banned < row.shape[0] * 32]
            view = row.view(np.uint32)
            np.bitwise_and.at(
                view, banned // 32, ~(np.uint32(1) << (banned % 32).astype(np.uint32))
            )
