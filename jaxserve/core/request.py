"""One request's state as the scheduler sees it (vLLM V1's ``v1/request.py``).

There is no prefill phase and no decode phase. A request keeps one ledger,
``num_computed_tokens`` (tokens whose K/V are in the paged cache), which catches up to
``num_tokens`` (prompt + output so far) under the scheduler's token budget. A prompt chunk, a
prefix-cache hit, a decode step and the recompute after preemption are the same arithmetic.

All timestamps are ``time.monotonic()`` seconds, so the engine can subtract them for TTFT
(first_token_time - arrival_time), TPOT/ITL and queueing time (first_scheduled_time -
arrival_time).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from jaxserve.core.ledger import RequestLedger

if TYPE_CHECKING:
    from jaxserve.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a request ended; the string values are OpenAI's ``finish_reason`` (plus "abort", "error")."""

    STOP = "stop"  # EOS or a stop token id / stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the client went away or the engine aborted it
    ERROR = "error"  # the engine could not serve it

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every status after PREEMPTED is a finished one."""

    WAITING = 0  # queued, holds no KV blocks
    RUNNING = 1  # admitted, holds KV blocks and a row in the runner's batch
    PREEMPTED = 2  # evicted by recompute; queued again, holds no KV blocks
    FINISHED_STOPPED = 3  # EOS / stop token / stop string
    FINISHED_LENGTH_CAPPED = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for every FINISHED_* status."""
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finish_reason(status: RequestStatus) -> FinishReason | None:
        """The OpenAI-style finish reason of a finished status; None while unfinished."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """A generation request: token ledger, status, and the timestamps metrics need.

    Args:
      request_id: unique id (the engine's; child ``{id}-{k}`` for n > 1).
      prompt_token_ids: the prompt, token ids (ints in [0, vocab)). May be empty here; the
        scheduler rejects empty prompts with ValueError in ``add_request``.
      sampling_params: the request's SamplingParams (max_tokens, min_tokens, stop_token_ids,
        ignore_eos, logprobs, prompt_logprobs are read by the scheduler).
      eos_token_id: the tokenizer's EOS id, or None when the model has none.
      arrival_time: ``time.monotonic()`` seconds; defaults to now.
      priority: smaller is more urgent (vLLM's convention); used by the "priority" policy.
      lora_name: the LoRA adapter it runs on (#33), None for the base model; mixed into the
        first block's prefix-cache hash like the salt.
      cache_salt: optional per-tenant salt mixed into the first block's prefix-cache hash so
        tenants cannot share or probe each other's cached prefixes.

    Attributes (beyond the args):
      status: a RequestStatus.
      output_token_ids: generated tokens, in order (a stop token id stays in the list).
      all_token_ids: prompt + output, one list (read-only for callers: append through
        ``append_output_token_ids``).
      num_computed_tokens: tokens of all_token_ids whose K/V are in the paged cache. The
        scheduler advances it when it schedules tokens and resets it to 0 on preemption.
      num_cached_tokens: prompt tokens served from the prefix cache at the first admission
        (OpenAI ``usage.prompt_tokens_details.cached_tokens``); -1 until first scheduled.
      max_tokens: resolved output cap (sampling_params.max_tokens, or what max_model_len
        leaves when it is None); set by the scheduler on admission.
      stop_reason: the stop token id (int) or stop string (str) that ended the request; None
        for EOS or when it did not stop on one.
      error_message: why the request finished with FINISHED_ERROR, if it did.
      num_preemptions: how many times it was preempted.
      block_hashes: prefix-cache hashes of its full blocks, filled lazily by
        ``kv_cache_utils.update_block_hashes`` and kept so each block is hashed once.
      first_scheduled_time, first_token_time, finished_time: monotonic seconds or None.
      preempted_times: monotonic seconds of each preemption.
      stop_token_set: token ids that end the request once more than min_tokens tokens exist
        (stop_token_ids, plus eos_token_id unless ignore_eos).
      ledger: the request's RequestLedger (steps, prefix hits, preemptions), filled by the
        scheduler; it outlives the request (the engine keeps finished ones).
      num_output_placeholders: tokens scheduled to be sampled whose ids are not known yet
        (async scheduling; 0 between steps of the synchronous loop).
      needs_output_history: its sampling reads the output so far (penalties, structured
        outputs, bad_words), so it is not scheduled while a token of it is in flight; nor
        does it speculate (its next token's distribution depends on the drafts before it).
      spec_token_ids: speculative decoding: the proposer's draft tokens for its next step
        (proposed when its latest tokens landed; consumed, and emptied, when it is scheduled).
      num_spec_in_flight: draft tokens of it in a step not yet updated (its position after
        that step is not known until their verification lands: it waits for it).
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "priority",
        "cache_salt",
        "lora_name",
        "status",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "max_tokens",
        "stop_reason",
        "error_message",
        "num_preemptions",
        "block_hashes",
        "first_scheduled_time",
        "first_token_time",
        "finished_time",
        "preempted_times",
        "sort_key",
        "stop_token_set",
        "ledger",
        "num_output_placeholders",
        "needs_output_history",
        "spec_token_ids",
        "num_spec_in_flight",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora_name = lora_name
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        max_tokens = sampling_params.max_tokens
        self.max_tokens: int = max_tokens if max_tokens is not None else 2**62
        self.stop_reason: int | str | None = None
        self.error_message: str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.preempted_times: list[float] = []
        # (priority, arrival_time, request_id): the "priority" policy's order. Ties on
        # (priority, arrival) break by id so the order is total and deterministic.
        self.sort_key = (priority, self.arrival_time, request_id)
        # Token ids that may end the request (stop_token_ids, plus EOS unless ignore_eos).
        stop = set(sampling_params.stop_token_ids)
        if eos_token_id is not None and not sampling_params.ignore_eos:
            stop.add(eos_token_id)
        self.stop_token_set = frozenset(stop)
        self.ledger = RequestLedger()
        # Async scheduling: tokens scheduled to be sampled whose ids have not reached the host
        # yet (at most 2: one in the step in flight, one in the step being planned).
        self.num_output_placeholders = 0
        # Its next token's distribution reads its output so far on the host (penalties, a
        # grammar's matcher, bad_words): with a token in flight it waits for it instead of being
        # scheduled (async scheduling stays exact).
        self.needs_output_history = sampling_params.needs_output_history
        self.spec_token_ids: list[int] = []
        self.num_spec_in_flight = 0

    @property
    def num_tokens(self) -> int:
        """len(prompt) + len(output)."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """len(prompt_token_ids), in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (kept across preemption), in tokens."""
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        """Appends one sampled token to the output and to all_token_ids (the scheduler's
        per-step update)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Appends sampled token(s) to the output and to all_token_ids."""
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        """True once the status is any FINISHED_* one."""
        return self.status > RequestStatus.PREEMPTED

    def get_finish_reason(self) -> FinishReason | None:
        """The OpenAI-style finish reason of this request's status; None while unfinished."""
        return _FINISH_REASONS.get(self.status)

    def close_ledger(self) -> None:
        """Hands this request's times, counts and finish reason to its ledger, which outlives
        it (the scheduler calls this when it frees the request)."""
        reason = self.get_finish_reason()
        self.ledger.finished(
            request_id=self.request_id,
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            finished_time=self.finished_time,
            finish_reason=None if reason is None else reason.value,
            stop_reason=self.stop_reason,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_output_tokens=len(self.output_token_ids),
            num_cached_tokens=self.num_cached_tokens,
            lora_name=self.lora_name,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
