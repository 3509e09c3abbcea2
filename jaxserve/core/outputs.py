"""What the runner hands back, and what the scheduler hands the engine (vLLM V1's ``v1/outputs.py``,
``v1/engine/__init__.py``).

Plain dataclasses of ints, floats, lists and dicts; no jax. The runner brings to the host once
per step only the sampled token ids (and logprobs when a request asked for them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass
class TokenLogprobs:
    """Log-probabilities at one position (OpenAI ``logprobs`` / ``top_logprobs``).

    Attributes:
      token_ids: ``[1 + k]`` the chosen token (sampled, or the actual prompt token) first, then
        the top-k alternatives in descending probability (k = the request's ``logprobs`` or
        ``prompt_logprobs``; the chosen token may appear again among them).
      logprobs: ``[1 + k]`` natural-log probabilities of those tokens, float, from the
        distribution after logit_bias and penalties, before temperature/top-k/top-p (vLLM's
        "raw logprobs" of the processed logits).
      rank: 1-based rank of the chosen token in that distribution (1 = most probable).
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class OneTokenEach(Sequence):
    """``[[t] for t in tokens]``, each inner list made when read: ``sampled_token_ids`` of a step
    in which every request sampled one token, without 256 lists a step nobody reads (the
    scheduler's steady-decode update reads ``sampled_flat``). Read-only; equal to any sequence
    with the same items.
    """

    __slots__ = ("tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [[t] for t in self.tokens[i]]
        return [self.tokens[i]]

    def __iter__(self):
        return ([t] for t in self.tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))


@dataclasses.dataclass
class ModelRunnerOutput:
    """The runner's result for one step.

    Attributes:
      req_ids: ids of the requests that ran this step (the keys of
        ``SchedulerOutput.num_scheduled_tokens``, in the runner's batch order).
      req_id_to_index: req_id -> index into the per-request lists below.
      sampled_token_ids: per request, the tokens sampled this step: ``[t]`` when the request
        reached the end of its known tokens, ``[]`` when the step only advanced a prompt chunk.
        The scheduler may pass these lists on as ``EngineCoreOutput.new_token_ids``: build
        fresh ones each step and do not mutate them afterwards.
      logprobs: None when no request in the step asked for logprobs; otherwise per request a
        list parallel to ``sampled_token_ids[i]`` (empty for requests that did not ask).
      prompt_logprobs_dict: req_id -> TokenLogprobs of the prompt tokens this step scored, in
        position order, for requests with ``prompt_logprobs`` set. A step computing positions
        ``[s, e)`` scores the prompt tokens at positions ``s+1 .. min(e, prompt_len - 1)`` (a
        token's logprob comes from the logits of the position before it; position 0 has none
        and the engine reports None there).
      sampled_flat: when every request of the step sampled exactly one token, those tokens in
        ``req_ids`` order (``sampled_token_ids[i] == [sampled_flat[i]]``); else None.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: Sequence[list[int]]
    logprobs: list[list[TokenLogprobs]] | None = None
    prompt_logprobs_dict: dict[str, list[TokenLogprobs]] = dataclasses.field(default_factory=dict)
    sampled_flat: list[int] | None = None


@dataclasses.dataclass(slots=True)
class DecodeTokens:
    """One steady-decode step's news for the engine, in one object instead of an
    EngineCoreOutput per request (``Scheduler.update_from_output(..., batched=True)``): each
    request appended exactly one token, which ended nothing, without logprobs.

    Attributes:
      req_ids: ``[n]`` the request ids (read-only: the same list object on every step of one
        steady run, so consumers may key per-request caches on its identity).
      token_ids: ``[n]`` the token each appended, in the same order.
    """

    req_ids: list[str]
    token_ids: list[int]


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
"""For steps that scheduled nothing (do not mutate)."""


@dataclasses.dataclass(slots=True)
class EngineCoreOutput:
    """One request's news from one step, for the engine (detokenizer, streams, metrics).

    Attributes:
      req_id: the request id.
      new_token_ids: tokens appended this step (usually 0 or 1). A stop token id or EOS that
        ended the request is included (the detokenizer hides special tokens). Read-only: it
        may be the runner's list from ``ModelRunnerOutput.sampled_token_ids``.
      finish_reason: None while running; "stop", "length", "abort" or "error" when finished.
      stop_reason: the ``stop_token_ids`` entry (int) that ended it; None when EOS ended it
        (unless ``ignore_eos``) or for any other finish, as vLLM reports it (stop *strings* are
        found by the engine's detokenizer, which then calls ``Scheduler.finish_requests``).
      new_logprobs: TokenLogprobs parallel to new_token_ids, when the request asked for
        logprobs; else None.
      new_prompt_logprobs: prompt positions scored this step (see ModelRunnerOutput), else None.
      num_cached_tokens: prompt tokens served from the prefix cache at first admission
        (``usage.prompt_tokens_details.cached_tokens``).
    """

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        """True when this step ended the request (``finish_reason`` is set)."""
        return self.finish_reason is not None


@dataclasses.dataclass
class SchedulerStats:
    """Scheduler and KV-cache figures for metrics, read by the engine each step.

    Gauges are the state now; ``*`` interval counters count since the previous ``make_stats()``.

    Attributes:
      num_running_reqs: requests holding KV blocks (gauge).
      num_waiting_reqs: requests queued, including preempted ones (gauge).
      kv_cache_usage: used blocks / (total - 1), in [0, 1] (gauge; cached-but-free blocks
        count as free).
      num_free_blocks: blocks in the free queue, evictable cached ones included (gauge).
      prefix_cache_queries: prompt tokens looked up in the prefix cache (interval; only a
        request's first admission counts, not the recompute after preemption).
      prefix_cache_hits: of those, tokens found in the cache (interval).
      prefix_cache_requests: requests looked up (interval).
      num_evictions: cached blocks evicted to be reused (interval).
      host_cache_hits: of prefix_cache_hits, tokens found in the host tier (interval).
      host_kv_cache_usage: host-tier slots in use / all (gauge; 0.0 without offloading).
      kv_offload_stored_tokens, kv_offload_loaded_tokens: tokens copied device -> host and
        host -> device (interval).
      kv_offload_resumed_loaded_tokens, kv_offload_resumed_recomputed_tokens: host-hit tokens
        of resumed (preempted) requests loaded / recomputed by the cost model's choice
        (interval).
      num_preemptions: preemptions (interval).
      num_scheduled_tokens: tokens scheduled (interval).
      num_steps: schedule() calls (interval).
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_requests: int = 0
    num_evictions: int = 0
    host_cache_hits: int = 0
    host_kv_cache_usage: float = 0.0
    kv_offload_stored_tokens: int = 0
    kv_offload_loaded_tokens: int = 0
    kv_offload_resumed_loaded_tokens: int = 0
    kv_offload_resumed_recomputed_tokens: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    num_steps: int = 0
