"""What the scheduler hands the model runner each step (vLLM V1's ``v1/core/sched/output.py``).

Plain dataclasses of ints, lists and dicts; no jax. The runner keeps a persistent batch keyed by
request id, so a request's prompt and sampling params cross this boundary once (in
``NewRequestData``); afterwards only what changed is sent (``CachedRequestData``).

One step, for the runner:
  1. drop the rows of ``finished_req_ids`` and ``preempted_req_ids``;
  2. add a row for each of ``scheduled_new_reqs``;
  3. for each of ``scheduled_cached_reqs``, append ``new_block_ids`` to its block tables (one
     per KV-cache group: ``jaxserve/core/kv_cache_groups.py``; a layer reads its group's);
  4. run ``num_scheduled_tokens[req_id]`` tokens of each scheduled request, starting at
     position ``num_computed_tokens`` (the token ids are ``all_token_ids[start:start+n]``;
     ``CachedRequestData.new_token_ids`` carries them);
  5. sample one token for each request whose ``num_computed_tokens + num_scheduled_tokens``
     reaches its current length (prompt + output so far); a partial prefill chunk samples
     nothing.

Speculative decoding: a decoding request may carry draft tokens
(``scheduled_spec_decode_tokens``): its step computes its last known token plus the drafts (1 +
k query tokens, all counted in ``num_scheduled_tokens``), and the runner returns the drafts its
sampler agrees with plus one token of its own (1 to k + 1 tokens).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.core.kv_cache_utils import KVTransfers
    from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass
class NewRequestData:
    """A request the runner has no row for: admitted for the first time, or resumed after
    preemption (the runner dropped its row when it was preempted).

    Attributes:
      req_id: the request id; the key of the runner's persistent batch.
      prompt_token_ids: the prompt, token ids (the Request's own list: read, do not mutate).
      output_token_ids: tokens generated before a preemption (empty for a fresh request). A
        resumed request recomputes K/V for prompt + these tokens, and the sampler needs them
        for presence/frequency/repetition penalties. A copy: the runner may keep it.
      sampling_params: the request's SamplingParams (temperature, top-p, seed, logprobs, ...).
      eos_token_id: the EOS id (None if the model has none); the sampler masks it, together
        with ``sampling_params.stop_token_ids``, while fewer than ``min_tokens`` were generated.
      block_ids: the request's whole block tables so far, one list per KV-cache group, all of
        one length (prefix-cache hits first, then new blocks; 0, the null block, where a
        sliding-window group freed or never needed a block). In group g, token t lives in slot
        ``block_ids[g][t // block_size] * block_size + t % block_size``.
      num_computed_tokens: tokens already in the cache (the prefix-cache hit, block-aligned);
        this step's tokens start at this position.
      lora_name: the LoRA adapter the request runs on (#33), None for the base model.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_name: str | None = None


@dataclasses.dataclass
class CachedRequestData:
    """Requests the runner already holds a row for, scheduled again this step.

    Parallel lists, one entry per request, in the scheduler's order.

    Attributes:
      req_ids: request ids.
      new_block_ids: per request, None when it gets no new block this step (usual for
        decode), else the block ids appended to its block table of each KV-cache group (one
        list per group, one id each when a block boundary is crossed). The runner's tables are
        append-only while a request runs (a sliding-window group's freed blocks stay in them,
        outside every query's window).
      num_computed_tokens: tokens in the cache before this step; this step's tokens start at
        this position.
      new_token_ids: the token ids this step feeds for each request,
        ``all_token_ids[num_computed_tokens : num_computed_tokens + num_scheduled_tokens]``. For
        decode that is the token sampled last step, which the runner already knows; it is sent
        anyway so the runner can check itself (and needs no state to continue a prompt chunk).
    """

    req_ids: list[str] = dataclasses.field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = dataclasses.field(default_factory=list)
    num_computed_tokens: list[int] = dataclasses.field(default_factory=list)
    new_token_ids: list[list[int]] = dataclasses.field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        """Number of cached requests scheduled this step (len(req_ids))."""
        return len(self.req_ids)


@dataclasses.dataclass
class SchedulerOutput:
    """Everything the runner needs for one step.

    Attributes:
      scheduled_new_reqs: requests to add to the persistent batch (see NewRequestData).
      scheduled_cached_reqs: requests already in the batch that run this step.
      num_scheduled_tokens: req_id -> tokens to compute this step (>= 1). Its keys are exactly
        the scheduled requests (new and cached); a request not in it does not run this step
        but keeps its row.
      total_num_scheduled_tokens: sum of num_scheduled_tokens (<= max_num_batched_tokens);
        picks the runner's padded token bucket.
      preempted_req_ids: requests preempted this step; the runner drops their rows (their
        blocks were freed and may be reused by this very step).
      finished_req_ids: requests that finished or were aborted since the previous step; the
        runner drops their rows (it ignores ids it has no row for: a request aborted while
        waiting never reached it).
      kv_transfers: KV offloading's copies for this step (saves, then loads), executed before
        the step's forward; None when there are none (see ``KVTransfers``).
      steady_decode: True when the step repeats the previous one's requests in the same order,
        one decode token each (the scheduler's steady-decode path): nothing new, finished or
        preempted among them, ``new_token_ids`` empty (the runner knows every token: it
        recorded the previous step's samples, or reads them on the device), ``new_block_ids``
        set only for the requests that crossed a block boundary. The runner may build the step
        from the previous one (it checks its own rows still match).
      scheduled_spec_decode_tokens: req_id -> the draft tokens this step verifies for it
        (vLLM's name); they follow its known tokens, at positions ``num_computed_tokens + 1``
        on, and are part of its ``num_scheduled_tokens``. Empty when no request speculates.
      speculate: speculative decoding is on for this step (not disabled by batch size): the
        runner proposes drafts for the next step of each request that samples in this one
        (``ModelRunnerOutput.draft_token_ids``) whose sampling allows it.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    kv_transfers: KVTransfers | None = None
    steady_decode: bool = False
    scheduled_spec_decode_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    speculate: bool = False

    @property
    def is_empty(self) -> bool:
        """True when no token is scheduled (the engine skips the model step)."""
        return self.total_num_scheduled_tokens == 0
