"""The token-budget scheduler: chunked prefill, prefix caching, fcfs/priority, recompute preemption.

Follows vLLM V1's ``v1/core/sched/scheduler.py``. There are no phases: each request's
``num_computed_tokens`` catches up to its ``num_tokens`` (prompt + output so far). Each step:

1. Candidates are visited in policy order. FCFS: the running requests in admission order, then
   the waiting queue. Priority: running and waiting merged by ``(priority, arrival_time)``, so
   a more urgent request is served before a less urgent one for the token budget, for
   sequence slots and for KV blocks (it preempts the least urgent running request for slots
   or blocks).
2. A candidate gets ``min(tokens it lacks, long_prefill_token_threshold, budget left)`` tokens
   (chunked prefill). With chunked prefill off, a waiting prompt must fit the budget whole
   (resumed requests may still recompute in chunks, else they could never come back).
3. A running request that cannot get blocks preempts a victim: the most recently admitted
   running request (FCFS) or the least urgent one (priority); possibly itself. Preemption is
   by recompute: its blocks are freed (they stay in the prefix cache), its ledger goes back to
   0, and it waits at the front of the queue (FCFS) or in its place (priority).
4. Against thrash: victims are always requests not yet scheduled in the step, so a resumed
   request gets its step of progress before it can be preempted again; no waiting request is
   admitted in a step where a running request had to be preempted (vLLM V1's rule); and a
   waiting request is admitted only if its whole remaining sequence (not just this step's
   chunk) fits in the free blocks that partially prefilled requests and the watermark do not
   already claim, so a prompt is not started only to starve for blocks half-way.
5. ``update_from_output`` appends sampled tokens to requests whose ledger reached their
   length, checks stop conditions and frees finished requests.

The ledgers advance in one place, ``_update_after_schedule``, once the step is decided.

Hot path (benchmarks/bench_scheduler.py): a running request one token behind whose block table
has room (``KVCacheManager.get_noop_ends``) is scheduled without calling ``allocate_slots``, and
``update_from_output`` starts with a lean update for one sampled token that ends nothing;
everything else takes the general path, with the same result
(tests/core/test_scheduler_fast_paths.py runs both side by side). Steady decode (a step that
repeats the previous one's decodes: docs/ARCHITECTURE.md) goes further: ``_schedule_steady`` and
``_update_steady`` work from a ``_SteadyDecode`` snapshot with no per-request general loop.

Call ``add_request``, ``abort_requests`` and ``finish_requests`` between steps (after
``update_from_output``, before the next ``schedule``): freed blocks may be handed out by the
next ``schedule``.

Admission (``add_request``) rejects with ValueError what could never run: an empty prompt, a
prompt longer than max_model_len, a prompt longer than the budget with chunked prefill off,
and a request whose prompt + max_tokens exceeds the whole KV cache (it would cycle through
preemptions forever). ``max_tokens`` is capped so prompt + output <= max_model_len (a prompt of
exactly max_model_len tokens gets no output; the server may reject such requests earlier, as
OpenAI does). ``max_tokens == 0`` is a prompt-only request: its prompt is prefilled (for prompt
logprobs) and it finishes with "length" and no tokens.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from jaxserve.core.engine_core_output import DecodeTokens, EngineCoreOutput
from jaxserve.core.kv_cache_manager import KVCacheManager, block_ids
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.request_queue import make_request_queue
from jaxserve.core.runner_output import ModelRunnerOutput
from jaxserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxserve.stats_schema import SchedulerStats

if TYPE_CHECKING:
    from jaxserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig

_RUNNING = RequestStatus.RUNNING
_FINISH_REASON = {
    status: reason.value
    for status, reason in ((st, RequestStatus.get_finish_reason(st)) for st in RequestStatus)
    if reason is not None
}


def _sort_key(request: Request) -> tuple:
    return request.sort_key


@dataclasses.dataclass(slots=True)
class _Step:
    """What one ``schedule()`` call has decided so far."""

    index: int  # the step number the request ledgers record
    now: float
    scheduled: list[Request] = dataclasses.field(default_factory=list)  # num_scheduled order
    num_scheduled: dict[str, int] = dataclasses.field(default_factory=dict)
    new_reqs: list[NewRequestData] = dataclasses.field(default_factory=list)
    cached: CachedRequestData = dataclasses.field(default_factory=CachedRequestData)
    preempted: set[str] = dataclasses.field(default_factory=set)
    prefix_hits: list[tuple[Request, int]] = dataclasses.field(default_factory=list)
    # Blocks that requests scheduled so far still need to finish their prompts: admission does
    # not hand them out (see Scheduler._try_admit).
    pending_blocks: int = 0
    admit: bool = True  # False once the waiting queue is blocked for this step
    samples: list[bool] = dataclasses.field(default_factory=list)  # per scheduled: samples a token
    spec_on: bool = False  # speculative decoding on for this step (not disabled by batch size)
    spec: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # req_id -> its drafts


@dataclasses.dataclass(slots=True, eq=False)
class _SteadyDecode:
    """The running requests of a step in which each decoded one token (steady decode), kept so
    the next steps that do the same again are scheduled and updated with a thin loop or two
    instead of the per-request general path (``Scheduler._schedule_steady``).

    Valid while ``Scheduler._running_epoch`` is ``epoch`` (nothing admitted to or removed from
    ``running``). Steps are counted from the snapshot: fast step ``k`` computes position
    ``c + k - 1`` of a request whose ``num_computed_tokens`` was ``c`` at the snapshot.
    """

    epoch: int
    reqs: list[Request]
    req_ids: list[str]
    by_id: dict[str, Request]
    num_scheduled: dict[str, int]  # req_id -> 1 (copied into each output)
    stop_ids: frozenset[int]  # union of the requests' stop_token_set
    # fast step k -> indices into reqs of the requests whose token that step ends past their
    # no-op end (KVCacheManager.get_noop_ends): they call allocate_slots
    grow_at: dict[int, list[int]]
    gap: int  # min(prompt + max_tokens - num_computed_tokens): a step may run while gap > 1
    appends: list  # each request's (output_token_ids.append, all_token_ids.append)
    steps: int = 0  # fast steps taken
    # Placeholders owed to every request: its fast steps' tokens not landed yet. Each request's
    # num_output_placeholders is that much too low until ``Scheduler._settle`` adds it (before
    # anything reads the count itself: only relative updates run meanwhile).
    owed: int = 0
    settled: bool = False  # owed was added: its steps in flight update by the general path
    # The fast steps' indices, each a decode step of every request: added to the ledgers when
    # the run is settled, or to one request's when it is freed first (``flushed``).
    step_indices: list[int] = dataclasses.field(default_factory=list)
    flushed: set[str] = dataclasses.field(default_factory=set)


def _waits_for_in_flight(request: Request, spec_on: bool) -> bool:
    """Whether a running request with a token in flight (``num_output_placeholders`` > 0) is
    left out of the next step: it ends with that token, or its sampler needs to see it first,
    or its position waits for its drafts' verification, or (speculation on) its next drafts
    wait for it."""
    return (
        len(request.output_token_ids) + request.num_output_placeholders >= request.max_tokens
        or request.needs_output_history
        or spec_on
        or request.num_spec_in_flight > 0
    )


class Scheduler:
    """Decides, each step, which tokens of which requests the model computes.

    Args:
      scheduler_config: budget (max_num_batched_tokens), max_num_seqs,
        long_prefill_token_threshold, enable_chunked_prefill, policy, max_model_len.
      cache_config: block_size, enable_prefix_caching, watermark (and num_gpu_blocks).
      num_gpu_blocks: KV blocks on the device, null block included; defaults to
        ``cache_config.num_gpu_blocks``.
      speculative_config: speculative decoding (None: off). A decoding request then carries
        its proposer's drafts (``Request.spec_token_ids``, at most K, within the token budget,
        ``max_tokens`` and ``max_model_len``) as extra query tokens; ``update_from_output``
        rolls its ledger back over the drafts the runner rejected. While speculation is on, a
        request with a token in flight waits for it (async scheduling): its drafts are proposed
        from its latest tokens.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        # A step's tables reach past its tokens by the draft model's lookahead slots: a sliding
        # group's peak (KVCacheManager's max_num_batched_tokens) counts them too.
        lookahead = 0 if speculative_config is None else speculative_config.num_lookahead_tokens
        self.kv_cache_manager = KVCacheManager(
            cache_config, num_gpu_blocks, scheduler_config.max_num_batched_tokens + lookahead
        )
        self.block_size = cache_config.block_size
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        # --max-loras (0: LoRA off): running requests use at most this many distinct adapters,
        # so every step's adapters fit the device pool (the engine sets it)
        self.max_loras = 0
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.chunk_limit = scheduler_config.chunk_limit
        self.policy = scheduler_config.policy
        self._priority = self.policy == "priority"
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(self.policy)
        # Running requests: admission order (fcfs) or sorted by Request.sort_key (priority).
        # Either way running[-1] is the preemption victim.
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self._num_preemptions = 0
        self._num_scheduled_tokens = 0
        self._num_steps = 0
        self._step_index = 0  # steps scheduled so far (never reset): the ledgers' step numbers
        # The SchedulerOutputs not yet updated (one, or two under async scheduling), each with
        # its requests in num_scheduled_tokens order, so update_from_output needs no id lookups.
        # Each: (output, its requests, whether each samples, the steady run it came from or None,
        # that run's gap after it, _running_removals when it was scheduled).
        self._in_flight: collections.deque[
            tuple[SchedulerOutput, list[Request], list[bool], _SteadyDecode | None, int, int]
        ] = collections.deque()
        # Bumped whenever a request joins or leaves ``running`` (the steady-decode snapshot's
        # validity); removals are also counted apart (a steady step's update stays valid
        # through later admissions, not through removals).
        self._running_epoch = 0
        self._running_removals = 0
        self._steady: _SteadyDecode | None = None
        self._decode_epoch = -1  # _running_epoch at the latest all-decode general step
        # Speculative decoding: K (0 = off), the draft model's lookahead slots, the batch size
        # above which it is skipped, and the interval counters of make_stats.
        spec = speculative_config
        self.speculative_config = spec
        self._spec_k = 0 if spec is None else spec.num_speculative_tokens
        self._spec_lookahead = 0 if spec is None else spec.num_lookahead_tokens
        self._spec_disable = None if spec is None else spec.disable_by_batch_size
        self._spec_drafts = self._spec_draft_tokens = self._spec_accepted = 0
        self._spec_accepted_per_pos = [0] * self._spec_k
        self._spec_was_on = False

    def add_request(self, request: Request) -> None:
        """Queues a request after checking that it can ever run.

        Raises:
          ValueError: duplicate request id; empty prompt; prompt longer than max_model_len;
            prompt longer than max_num_batched_tokens with chunked prefill off; prompt +
            max_tokens larger than the KV cache (messages name both numbers).
        """
        req_id = request.request_id
        if req_id in self.requests:
            raise ValueError(f"request_id {req_id!r} is already in use")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError(
                "prompt_token_ids: the prompt is empty; at least one token is required"
            )
        if num_prompt > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: the prompt has {num_prompt} tokens, more than "
                f"max_model_len ({self.max_model_len})"
            )
        if not self.enable_chunked_prefill and num_prompt > self.max_num_scheduled_tokens:
            raise ValueError(
                f"prompt_token_ids: the prompt has {num_prompt} tokens, more than "
                f"max_num_batched_tokens ({self.max_num_scheduled_tokens}) and chunked "
                "prefill is disabled"
            )
        room = self.max_model_len - num_prompt
        max_tokens = request.sampling_params.max_tokens
        request.max_tokens = room if max_tokens is None else min(max_tokens, room)
        need = num_prompt + request.max_tokens
        capacity = self.kv_cache_manager.max_num_tokens
        if need > capacity:
            raise ValueError(
                f"max_tokens: the prompt ({num_prompt} tokens) plus max_tokens ({request.max_tokens}) "
                f"needs {need} tokens of KV cache, more than the whole cache holds ({capacity} tokens)"
            )
        request.status = RequestStatus.WAITING
        self.requests[req_id] = request
        self.waiting.add(request)

    def finish_requests(self, req_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Ends requests from outside the step (stop strings, aborts, errors).

        Unknown or already finished ids are ignored. Their blocks are freed now and their ids
        reach the runner in the next SchedulerOutput.finished_req_ids.

        Raises:
          ValueError: finished_status is not a FINISHED_* status.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(
                f"finished_status must be a FINISHED_* status, got {finished_status!r}"
            )
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == _RUNNING:
                self.running.remove(request)
                self._running_epoch += 1
                self._running_removals += 1
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request, time.monotonic())

    def abort_requests(self, req_ids: str | Iterable[str]) -> None:
        """Aborts waiting, running or preempted requests, freeing their blocks."""
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def _free_request(self, request: Request, now: float) -> None:
        request.finished_time = now
        st = self._steady
        if st is not None and st.step_indices and request.request_id not in st.flushed:
            if st.by_id.get(request.request_id) is request:  # its ledger: complete it now
                request.ledger.decode_steps.extend(st.step_indices)
                st.flushed.add(request.request_id)
        request.close_ledger()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet finished or aborted (waiting, running and preempted)."""
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or preempted."""
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        """Finished ids not yet reported to the runner (the engine should still step)."""
        return bool(self.finished_req_ids)

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting) requests now; waiting includes preempted ones."""
        return len(self.running), len(self.waiting)

    def schedule(self) -> SchedulerOutput:
        """Picks this step's tokens and advances the scheduled requests' ledgers.

        Returns:
          The SchedulerOutput for the runner. Never more than max_num_batched_tokens tokens,
          never more than max_num_seqs running requests.
        """
        self._num_steps += 1
        self._step_index += 1
        spec_on = self._spec_k > 0 and self._spec_on()
        if spec_on != self._spec_was_on:
            self._spec_was_on = spec_on
            if not spec_on:  # proposals go stale while it is off
                for request in self.running:
                    request.spec_token_ids = []
        if self._steady is not None:
            output = None if spec_on else self._schedule_steady(self._steady)
            if output is not None:
                return output
            self._settle()
        step = _Step(self._step_index, time.monotonic(), spec_on=spec_on)
        budget = self._schedule_running(step, self.max_num_scheduled_tokens)
        # Then the waiting queue (priority: what is left is less urgent than every running request).
        budget = self._admit_waiting(step, budget)
        self._update_after_schedule(step)
        total = self.max_num_scheduled_tokens - budget
        self._num_scheduled_tokens += total
        finished, self.finished_req_ids = self.finished_req_ids, set()
        output = SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=total,
            preempted_req_ids=step.preempted,
            finished_req_ids=finished,
            kv_transfers=self.kv_cache_manager.take_transfers(),
            scheduled_spec_decode_tokens=step.spec,
            speculate=spec_on,
        )
        if (
            step.scheduled
            and not step.new_reqs
            and not step.preempted
            and total == len(step.scheduled) == len(self.running) == len(step.cached.req_ids)
            and all(step.samples)
        ):
            # The second such step in a row with the same running requests: a steady run is
            # likely, worth the snapshot's cost (a request joins or leaves every step in some
            # workloads: they never pay for it). Not while a waiting request could be admitted
            # (_schedule_steady would give the snapshot up at once, step after step).
            if (
                self._decode_epoch == self._running_epoch
                and not spec_on  # each step's drafts differ: no steady run
                and not self._may_admit(total)
            ):
                self._steady = self._steady_snapshot(step)
            self._decode_epoch = self._running_epoch
        self._track(output, step.scheduled, step.samples, None, 0)
        return output

    def _track(
        self,
        output: SchedulerOutput,
        scheduled: list[Request],
        samples: list[bool],
        steady: _SteadyDecode | None,
        gap: int,
    ) -> None:
        in_flight = self._in_flight
        if len(in_flight) >= 2:  # a caller that never updates: forget the oldest
            in_flight.popleft()
        in_flight.append((output, scheduled, samples, steady, gap, self._running_removals))

    def waits_for_in_flight(self) -> bool:
        """True when the next ``schedule()`` could schedule nothing before the step in flight is
        updated (async scheduling): every running request has a token of that step in flight
        and waits for it (speculation, penalties or structured outputs, or its last token), and
        no request waits for admission. The engine then collects and updates that step first,
        so the next step is dispatched in the same engine step instead of one later."""
        if not self._in_flight or self._steady is not None or self.waiting or not self.running:
            return False
        spec_on = self._spec_k > 0 and self._spec_on()
        for request in self.running:
            if not request.num_output_placeholders or not _waits_for_in_flight(request, spec_on):
                return False
        return True

    def _spec_on(self) -> bool:
        """Whether speculation runs this step: not more than ``disable_by_batch_size`` requests
        running or waiting (vLLM V0's rule)."""
        limit = self._spec_disable
        return limit is None or len(self.running) + len(self.waiting) <= limit

    def _num_drafts(self, request: Request, budget: int) -> int:
        """How many of the request's proposed drafts its decode step may carry: within the
        budget and the per-request chunk limit (its own token first) and its ``max_tokens`` (all drafts accepted plus the token
        after them must not pass it; ``max_tokens`` is capped by ``max_model_len``, so the
        positions fit too); none while it is under ``min_tokens`` (the sampler bans its stop
        tokens by its output count, one count per step)."""
        num_output = len(request.output_token_ids)
        if num_output < request.sampling_params.min_tokens:
            return 0
        k = min(
            len(request.spec_token_ids),
            budget - 1,
            self.chunk_limit - 1,
            request.max_tokens - num_output - 1,
        )
        return k if k > 0 else 0

    def _may_admit(self, num_running_tokens: int) -> bool:
        """Whether a waiting request might be admitted in a step whose running requests take
        ``num_running_tokens``: priority, any waiting one (it may preempt); fcfs, the head of
        the queue when a slot is free, unless ``_head_blocked`` says it cannot be."""
        if not self.waiting:
            return False
        if self._priority:
            return True
        if len(self.running) >= self.max_num_running_reqs:
            return False  # _try_admit refuses at once, before any lookup
        return not self._head_blocked(self.max_num_scheduled_tokens - num_running_tokens)

    def _head_blocked(self, budget: int) -> bool:
        """fcfs: the head of the waiting queue cannot be admitted in this step, by the checks
        ``_try_admit`` makes (the token budget without chunked prefill, blocks for its whole
        sequence beyond the watermark), taken before this step's block-table growth: growth only
        takes blocks (an evicted prefix hit costs one free block and adds at least one needed),
        so a head refused before is refused after. Makes the same prefix lookup as _try_admit."""
        if budget <= 0:
            return True  # _admit_waiting does not try
        request = self.waiting.peek()
        kv = self.kv_cache_manager
        hit, num_hit = kv.get_computed_blocks(request)
        num_tokens = request.num_tokens
        if not (self.enable_chunked_prefill or request.num_preemptions > 0):
            if num_tokens - num_hit > budget:
                return True
        need, evictable = kv.admission_blocks(num_tokens, hit)
        return need > kv.num_free_blocks - evictable - kv.watermark_blocks

    def _settle(self) -> None:
        """Ends the steady run: its requests' placeholder counts and ledgers are made whole."""
        st, self._steady = self._steady, None
        if st is not None:
            st.settled = True
            if st.owed:
                owed = st.owed
                for request in st.reqs:
                    request.num_output_placeholders += owed
                st.owed = 0
            if st.step_indices:
                steps, flushed = st.step_indices, st.flushed
                for request in st.reqs:
                    if request.request_id not in flushed:
                        request.ledger.decode_steps.extend(steps)

    def _steady_snapshot(self, step: _Step) -> _SteadyDecode | None:
        """After a step in which every running request decoded one token: the snapshot that
        lets the next steps do the same via ``_schedule_steady`` (None if some request's
        sampling reads its output history: async scheduling must not plan past its tokens)."""
        reqs = list(step.scheduled)
        if any(r.needs_output_history for r in reqs):
            return None
        ids = list(step.num_scheduled)
        noop_end = self.kv_cache_manager.get_noop_ends()
        grow_at: dict[int, list[int]] = {}
        for i, request in enumerate(reqs):
            k = noop_end[request.request_id] - request.num_computed_tokens + 1
            grow_at.setdefault(max(k, 1), []).append(i)
        return _SteadyDecode(
            epoch=self._running_epoch,
            reqs=reqs,
            req_ids=ids,
            by_id=dict(zip(ids, reqs)),
            num_scheduled=dict.fromkeys(ids, 1),
            stop_ids=frozenset().union(*{r.stop_token_set for r in reqs}),
            grow_at=grow_at,
            gap=min(len(r.prompt_token_ids) + r.max_tokens - r.num_computed_tokens for r in reqs),
            appends=[(r.output_token_ids.append, r.all_token_ids.append) for r in reqs],
        )

    def _schedule_steady(self, st: _SteadyDecode) -> SchedulerOutput | None:
        """The step after a steady-decode step, when it is one again: the same requests, in
        the same order, one decode token each; what the general path would schedule, with
        per-request work cut to a ``num_computed_tokens`` increment (and ``allocate_slots`` for
        the requests whose block tables need it; placeholders and ledgers are settled later). None when the general path must run instead: a request
        joined or left ``running``, the waiting queue could admit, a request's in-flight token
        may end it (async scheduling), or the pool may lack a block for the requests that
        cross a block boundary.

        The snapshot's counts are kept by this path alone: every request in it is running and
        is touched by nothing else (admissions and removals bump ``_running_epoch``)."""
        running = self.running
        if st.epoch != self._running_epoch or len(running) != len(st.reqs):
            return None
        if self._may_admit(len(st.reqs)):
            return None  # admission might take a slot or preempt: the general path decides
        if st.gap <= 1:
            return None  # a request's in-flight token may end it (its max_tokens)
        reqs = st.reqs
        n = len(reqs)
        k = st.steps + 1
        new_block_ids: list[tuple[list[int], ...] | None] = [None] * n
        grow = st.grow_at.get(k)
        if grow:
            kv = self.kv_cache_manager
            if len(grow) * kv.num_groups > kv.num_free_blocks:
                return None  # a decode token needs at most one new block per group
            del st.grow_at[k]
            noop_end = kv.get_noop_ends()
            grow_at = st.grow_at
            for i in sorted(grow) if len(grow) > 1 else grow:  # in running order, as in general
                request = reqs[i]
                blocks = kv.allocate_slots(request, 1)
                assert blocks is not None, "a block counted free could not be allocated"
                if blocks:
                    new_block_ids[i] = block_ids(blocks)
                # Its next call: the step whose token ends past its new no-op end; the very next
                # one when that is not past this one (under async scheduling a block whose last
                # token is still in flight is registered a step late).
                nxt = k + noop_end[request.request_id] - request.num_computed_tokens
                grow_at.setdefault(nxt if nxt > k else k + 1, []).append(i)
        st.steps = k
        st.gap -= 1
        step_index = self._step_index
        num_computed = [r.num_computed_tokens for r in reqs]
        st.owed += 1  # each request samples a token: a placeholder each, settled lazily
        st.step_indices.append(step_index)  # a decode step of each: in the ledgers when settled
        for request in reqs:
            request.num_computed_tokens += 1
        self._num_scheduled_tokens += n
        finished, self.finished_req_ids = self.finished_req_ids, set()
        output = SchedulerOutput(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData(
                list(st.req_ids), new_block_ids, num_computed, []
            ),
            num_scheduled_tokens=dict(st.num_scheduled),
            total_num_scheduled_tokens=n,
            preempted_req_ids=set(),
            finished_req_ids=finished,
            kv_transfers=self.kv_cache_manager.take_transfers(),
            steady_decode=True,
        )
        self._track(output, reqs, [True] * n, st, st.gap)
        return output

    def _schedule_running(self, step: _Step, budget: int) -> int:
        """Schedules the running requests in order (priority: each after the waiting requests
        more urgent than it); returns the budget left. The hot loop: locals only."""
        kv = self.kv_cache_manager
        running = self.running
        priority = self._priority
        chunk_limit = self.chunk_limit
        step_index, now = step.index, step.now
        noop_end = kv.get_noop_ends()
        allocate = kv.allocate_slots
        num_scheduled = step.num_scheduled
        cached = step.cached
        add_req = step.scheduled.append
        add_id, add_blocks = cached.req_ids.append, cached.new_block_ids.append
        add_computed, add_tokens = cached.num_computed_tokens.append, cached.new_token_ids.append
        no_blocks = None  # new_block_ids of every request that gets no block
        spec_on = step.spec_on
        lookahead = self._spec_lookahead if spec_on else 0
        max_model_len = self.max_model_len
        # Priority walks a copy: admissions insert into ``running`` and preemptions remove from
        # it while we walk; fcfs only pops victims off the end of ``running`` (which ends the
        # walk before them), so it walks the list itself.
        for request in running[:] if priority else running:
            if budget <= 0:
                break
            if priority:
                if request.status is not _RUNNING:
                    continue  # preempted earlier in this step
                budget = self._admit_waiting(step, budget, before=request.sort_key)
                if budget <= 0:
                    break
                if request.status is not _RUNNING:
                    continue  # preempted to make room for a more urgent request
            req_id = request.request_id
            num_computed = request.num_computed_tokens
            token_ids = request.all_token_ids
            num_tokens = len(token_ids)
            placeholders = request.num_output_placeholders
            if placeholders:  # async scheduling: a token of it is still in flight
                if _waits_for_in_flight(request, spec_on):
                    continue
                num_tokens += placeholders
            num_spec = look = 0
            if spec_on and not request.needs_output_history:
                if request.spec_token_ids:
                    if num_tokens == num_computed + 1:
                        num_spec = self._num_drafts(request, budget)
                    if not num_spec:
                        request.spec_token_ids = []  # they follow the token this step computes
                look = lookahead
            if (
                num_tokens == num_computed + 1
                and num_computed + look < noop_end[req_id]
                and not num_spec
            ):
                # Decode with room in the block table: the general case below, minus the checks
                # that cannot fire (one token fits any budget > 0 and needs no allocation).
                add_req(request)
                add_id(req_id)
                add_blocks(no_blocks)
                add_computed(num_computed)
                add_tokens(token_ids[num_computed : num_computed + 1])  # [] while in flight
                num_scheduled[req_id] = 1
                request.ledger.decode_steps.append(step_index)
                budget -= 1
                continue
            # Catch up, in chunks, under the budget.
            num_new = num_tokens - num_computed
            if num_new > chunk_limit:
                num_new = chunk_limit
            if num_new > budget:
                num_new = budget
            if num_spec:  # its decode token, then its drafts (_num_drafts kept them in budget)
                num_new += num_spec
            end = num_computed + num_new
            if look:  # the draft model's own writes after the step, when it samples
                look = min(look, max_model_len - end) if end - num_spec >= num_tokens else 0
            if num_computed < end and end + look <= noop_end[req_id]:
                add_blocks(no_blocks)  # its table has room: nothing to allocate
            else:
                new_blocks = allocate(request, num_new, num_lookahead_tokens=look)
                while new_blocks is None:
                    victim = running[-1]
                    self._preempt(victim, step)
                    step.admit = False
                    if victim is request:
                        break
                    new_blocks = allocate(request, num_new, num_lookahead_tokens=look)
                if new_blocks is None:
                    break  # preempted itself: it was the last running request
                add_blocks(block_ids(new_blocks) if new_blocks else no_blocks)
            if end < num_tokens:  # a partial prompt chunk: the rest is spoken for
                step.pending_blocks += kv.blocks_to_grow(end, num_tokens)
            add_req(request)
            add_id(req_id)
            add_computed(num_computed)
            if num_spec:
                add_tokens(token_ids[num_computed : end - num_spec])
                step.spec[req_id] = request.spec_token_ids[:num_spec]
                request.num_spec_in_flight = num_spec
                request.spec_token_ids = []
            else:
                add_tokens(token_ids[num_computed:end])
            num_scheduled[req_id] = num_new
            request.ledger.scheduled(
                step_index, now, num_computed, num_new, request.num_prompt_tokens
            )
            budget -= num_new
        return budget

    def _admit_waiting(self, step: _Step, budget: int, before: tuple | None = None) -> int:
        """Admits waiting requests in queue order while they fit; returns the budget left.

        With ``before`` (priority), stops at the first waiting request not more urgent than that
        sort key. The first request that cannot be admitted blocks the queue for the step.
        """
        waiting = self.waiting
        while step.admit and budget > 0 and waiting:
            request = waiting.peek()
            if before is not None and not request.sort_key < before:
                break
            num_new = self._try_admit(request, budget, step)
            if not num_new:
                step.admit = False
                break
            budget -= num_new
        return budget

    def _try_admit(self, request: Request, budget: int, step: _Step) -> int:
        """Admits the head of the waiting queue if it can run now; returns its tokens (0 = no).

        Admission control (against thrash): the request's whole remaining sequence, not just
        this step's chunk, must fit in the free blocks that nobody else has a claim on (blocks
        that partially prefilled requests still need, and the watermark). Otherwise a prompt
        would be started, starve for blocks mid-way and be preempted, again and again. When
        nothing is running, the watermark and claims are moot, so any admissible request fits
        eventually (add_request rejected what never can).
        """
        if request.request_id in step.preempted:
            return 0  # preempted this very step: not handed its blocks straight back
        running = self.running
        kv = self.kv_cache_manager
        priority = self._priority
        slots_full = len(running) >= self.max_num_running_reqs
        if slots_full and not (priority and running[-1].sort_key > request.sort_key):
            return 0
        if request.lora_name is not None and self.max_loras:  # #33: a step's adapters fit
            adapters = {r.lora_name for r in running if r.lora_name is not None}
            if request.lora_name not in adapters and len(adapters) >= self.max_loras:
                return 0
        hit_blocks, num_hit = kv.get_computed_blocks(request)
        num_tokens = request.num_tokens
        num_new = num_tokens - num_hit
        if self.enable_chunked_prefill or request.num_preemptions > 0:
            num_new = min(num_new, self.chunk_limit, budget)
        elif num_new > budget:
            return 0
        need, evictable_hits = kv.admission_blocks(num_tokens, hit_blocks)

        def available() -> int:
            if not running:
                return kv.num_free_blocks - evictable_hits
            return kv.num_free_blocks - evictable_hits - step.pending_blocks - kv.watermark_blocks

        if need > available():
            # Under priority a more urgent request takes blocks from less urgent running ones,
            # but only if that is enough (no preemption for nothing).
            if not priority:
                return 0
            key = request.sort_key
            reclaimable = sum(kv.num_blocks_held(r.request_id) for r in running if r.sort_key > key)
            if need > available() + reclaimable:
                return 0
            while need > available() and running and running[-1].sort_key > key:
                self._preempt(running[-1], step)
            if need > available():
                return 0  # shared blocks freed less than counted
        if len(running) >= self.max_num_running_reqs:
            self._preempt(running[-1], step)
        new_blocks = None
        look = self._spec_lookahead
        if (
            look
            and step.spec_on
            and num_hit + num_new >= num_tokens  # it samples: the draft model proposes
            and not request.needs_output_history
            and kv.host_pool is None  # (a failed call must not consume host hits)
        ):
            look = min(look, self.max_model_len - num_hit - num_new)
            new_blocks = kv.allocate_slots(
                request,
                num_new,
                num_hit,
                hit_blocks,
                new_request=bool(running),
                num_lookahead_tokens=look,
            )
        if new_blocks is None:  # without lookahead slots its first drafts are only poorer
            new_blocks = kv.allocate_slots(
                request, num_new, num_hit, hit_blocks, new_request=bool(running)
            )
        assert new_blocks is not None, "admission control admitted a request the pool cannot hold"

        self.waiting.pop()
        req_id = request.request_id
        request.status = _RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = step.now
            request.num_cached_tokens = num_hit
        if priority:
            bisect.insort(running, request, key=_sort_key)
        else:
            running.append(request)
        self._running_epoch += 1
        step.new_reqs.append(
            NewRequestData(
                req_id=req_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                eos_token_id=request.eos_token_id,
                block_ids=kv.get_block_ids(req_id),
                num_computed_tokens=num_hit,
                lora_name=request.lora_name,
            )
        )
        step.scheduled.append(request)
        step.num_scheduled[req_id] = num_new
        if num_hit:
            step.prefix_hits.append((request, num_hit))
        ledger = request.ledger
        ledger.admitted(
            step.index,
            step.now,
            num_hit,
            None if kv.host_pool is None else kv.device_hit_tokens(hit_blocks, num_hit),
        )
        ledger.scheduled(step.index, step.now, num_hit, num_new, request.num_prompt_tokens)
        end = num_hit + num_new
        if end < num_tokens:
            step.pending_blocks += kv.blocks_to_grow(end, num_tokens)
        return num_new

    def _preempt(self, victim: Request, step: _Step) -> None:
        """Preemption by recompute of running[-1]."""
        assert victim is self.running[-1]
        assert victim.request_id not in step.num_scheduled, (
            "a request scheduled this step cannot be preempted"
        )
        self.running.pop()
        self._running_epoch += 1
        self._running_removals += 1
        kv = self.kv_cache_manager
        held = kv.group_blocks_held(victim.request_id)
        kv.free(victim, preempted=True)  # offloading: saved to the host
        victim.ledger.preempted(step.index, step.now, victim.num_computed_tokens, held)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        victim.preempted_times.append(step.now)
        self.waiting.add_preempted(victim)
        step.preempted.add(victim.request_id)
        self._num_preemptions += 1

    @staticmethod
    def _update_after_schedule(step: _Step) -> None:
        """The one place ledgers advance: by the prefix-cache hit of each admitted request and by
        the tokens scheduled (vLLM's ``_update_after_schedule``). The runner computes them in
        this step; a request preempted later goes back to 0 in ``_preempt``. A request brought
        to its full length samples a token this step: a placeholder until it lands."""
        for request, num_hit in step.prefix_hits:
            request.num_computed_tokens += num_hit
        samples = step.samples
        spec = step.spec
        for request, num_new in zip(step.scheduled, step.num_scheduled.values()):
            num_computed = request.num_computed_tokens + num_new
            request.num_computed_tokens = num_computed
            if spec and request.request_id in spec:  # the drafts follow its known tokens
                num_computed -= len(spec[request.request_id])
            if num_computed == len(request.all_token_ids) + request.num_output_placeholders:
                request.num_output_placeholders += 1
                samples.append(True)
            else:
                samples.append(False)

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        batched: bool = False,
    ) -> list[EngineCoreOutput] | DecodeTokens:
        """Takes the sampled tokens of a step, checks stop conditions, frees finished requests.

        A request appends tokens only if this step brought its ledger to its length (a partial
        prompt chunk samples nothing). Stop checks per token: EOS (unless ignore_eos) or a
        stop_token_id ends it with "stop", but only once more than min_tokens tokens exist;
        then reaching max_tokens (already capped by max_model_len) ends it with "length".
        Tokens after a stop in the same list are dropped.

        ``batched``: a steady-decode step (``SchedulerOutput.steady_decode``) whose every request
        appended one token that ended nothing, without logprobs, is returned as one
        ``DecodeTokens`` instead of an EngineCoreOutput per request (the engine's path).

        Returns:
          One EngineCoreOutput per request with new tokens, prompt logprobs, or a finish; or a
          DecodeTokens (``batched`` only).
        """
        if batched and scheduler_output.steady_decode:
            news = self._update_steady(scheduler_output, runner_output)
            if news is not None:
                return news
        scheduled, samples, sampled = self._align_runner_output(scheduler_output, runner_output)
        if scheduler_output.scheduled_spec_decode_tokens:
            self._verify_drafts(scheduled, sampled, scheduler_output.scheduled_spec_decode_tokens)
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs_dict or None
        # Without any logprobs, one sampled token that ends nothing takes the lean update.
        lean = logprobs is None and prompt_logprobs is None
        outputs: list[EngineCoreOutput] = []
        emit = outputs.append
        now = time.monotonic()
        finished: list[Request] = []
        update_one = self._update_request
        new_output = object.__new__
        running_status = _RUNNING
        for request, sample, tokens in zip(scheduled, samples, sampled):
            status = request.status
            if sample:  # the step brought it to its length: its placeholder lands
                request.num_output_placeholders -= 1
            else:
                tokens = ()  # a partial prompt chunk: whatever the runner drew is not kept
            if status is not running_status:
                if tokens and status is RequestStatus.PREEMPTED:  # preempted while it ran
                    j = (
                        None
                        if logprobs is None
                        else runner_output.req_id_to_index.get(request.request_id)
                    )
                    self._update_preempted(
                        request, tokens, None if j is None else logprobs[j], now, emit
                    )
                continue  # finished or aborted after it was scheduled
            if lean and len(tokens) == 1:
                token = tokens[0]
                if (
                    len(request.output_token_ids) + 1 < request.max_tokens
                    and token not in request.stop_token_set
                ):
                    request.output_token_ids.append(token)  # append_output_token, inlined
                    request.all_token_ids.append(token)
                    if request.first_token_time is None:
                        request.first_token_time = now
                    # EngineCoreOutput(req_id, tokens, None, None, None, None, num_cached_tokens)
                    # without the dataclass __init__ call; test_scheduler_fast_paths.py
                    # compares it with the general path's output, field by field.
                    out = new_output(EngineCoreOutput)
                    out.req_id = request.request_id
                    out.new_token_ids = tokens  # the runner's list: [token]
                    out.finish_reason = out.stop_reason = out.new_logprobs = (
                        out.new_prompt_logprobs
                    ) = None
                    out.num_cached_tokens = request.num_cached_tokens
                    emit(out)
                    continue
            req_id = request.request_id
            token_logprobs = plp = None
            if logprobs is not None:
                j = runner_output.req_id_to_index.get(req_id)
                token_logprobs = None if j is None else logprobs[j]
            if prompt_logprobs is not None:
                plp = prompt_logprobs.get(req_id)
            out = update_one(request, tokens, token_logprobs, plp, now)
            if out is not None:
                emit(out)
                if out.finish_reason is not None:
                    finished.append(request)
        if finished:  # take them out of running, keeping its order
            self._running_epoch += 1
            self._running_removals += 1
            running = self.running
            if len(finished) <= 8:
                for request in finished:
                    running.remove(request)  # a scan in C: cheaper than a rebuild for a few
            else:
                running[:] = [r for r in running if r.status is running_status]
        if runner_output.draft_token_ids:
            self._take_drafts(runner_output.draft_token_ids)
        return outputs

    def _verify_drafts(
        self, scheduled: list[Request], sampled: list, spec: dict[str, list[int]]
    ) -> None:
        """Speculative decoding, before a step's tokens are appended: each request that carried
        drafts got its accepted drafts plus one token (``len(tokens) - 1`` accepted); its ledger
        goes back over the rejected ones, whose K/V the step wrote at positions its next tokens
        overwrite (its blocks stay in its table). Counts drafts and acceptances (ledger,
        make_stats)."""
        per_pos = self._spec_accepted_per_pos
        for request, tokens in zip(scheduled, sampled):
            drafts = spec.get(request.request_id)
            if drafts is None:
                continue
            request.num_spec_in_flight = 0
            if not tokens:
                continue
            num_draft = len(drafts)
            num_accepted = len(tokens) - 1
            if request.status is _RUNNING:
                request.num_computed_tokens -= num_draft - num_accepted
            request.ledger.speculated(num_draft, num_accepted)
            self._spec_drafts += 1
            self._spec_draft_tokens += num_draft
            self._spec_accepted += num_accepted
            for pos in range(num_accepted):
                per_pos[pos] += 1

    def _take_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Keeps the runner's proposals as each running request's next drafts, unless a later
        token of it is already in flight (they would follow the wrong position)."""
        get = self.requests.get
        for req_id, ids in drafts.items():
            request = get(req_id)
            if (
                request is not None
                and request.status is _RUNNING
                and not request.num_output_placeholders
            ):
                request.spec_token_ids = ids

    def _update_steady(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> DecodeTokens | None:
        """update_from_output of a steady-decode step when no request of it can end: none left
        ``running`` since it was scheduled, none reaches max_tokens, no token is a stop token
        (of any of them), no logprobs. None when that does not hold (the general path runs)."""
        in_flight = self._in_flight
        if not in_flight or in_flight[0][0] is not scheduler_output:
            return None
        _, _, _, st, gap, removals = in_flight[0]
        if st is None or st.settled or gap <= 1 or removals != self._running_removals:
            return None
        if runner_output.logprobs is not None or runner_output.prompt_logprobs_dict:
            return None
        tokens = runner_output.sampled_flat
        if tokens is None or runner_output.req_ids != st.req_ids:
            return None
        if st.stop_ids and not st.stop_ids.isdisjoint(tokens):
            return None
        in_flight.popleft()
        st.owed -= 1  # each request's placeholder lands
        for (add_output, add_token), token in zip(st.appends, tokens):
            add_output(token)
            add_token(token)
        return DecodeTokens(st.req_ids, tokens)

    def _update_preempted(
        self, request: Request, tokens: list[int], logprobs: list | None, now: float, emit
    ) -> None:
        """A token sampled for a request that async scheduling preempted while the token's step
        ran: kept, as the synchronous loop would have appended it before preempting. If it ends
        the request, the request leaves the waiting queue finished."""
        request.status = _RUNNING  # what _update_request's stop checks expect
        out = self._update_request(request, tokens, logprobs, None, now, free=False)
        if request.status is _RUNNING:
            request.status = RequestStatus.PREEMPTED
        else:
            self.waiting.remove(request)
            self._free_request(request, now)
        if out is not None:
            emit(out)

    def _align_runner_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> tuple[list[Request], list[bool], list]:
        """The step's requests (still known or not), whether each samples a token this step, and
        the runner's sampled tokens in the same order (empty for a request it did not return)."""
        num_scheduled = scheduler_output.num_scheduled_tokens
        sampled = runner_output.sampled_token_ids
        in_flight = self._in_flight
        while in_flight and in_flight[0][0] is not scheduler_output:
            if not any(entry[0] is scheduler_output for entry in in_flight):
                break
            in_flight.popleft()  # an older output that was never updated
        if in_flight and in_flight[0][0] is scheduler_output:
            _, scheduled, samples, _, _, _ = in_flight.popleft()  # in num_scheduled order
            aligned = runner_output.req_ids == list(num_scheduled)
        else:  # a caller-built output of a synchronous step: look the requests up
            self._settle()  # placeholder counts are read below
            get = self.requests.get
            scheduled = [r for r in map(get, num_scheduled) if r is not None]
            spec = scheduler_output.scheduled_spec_decode_tokens
            samples = [
                r.num_output_placeholders > 0
                and r.num_computed_tokens - len(spec.get(r.request_id, ()))
                == len(r.all_token_ids) + r.num_output_placeholders - 1
                for r in scheduled
            ]
            aligned = False
        if not aligned:
            index = runner_output.req_id_to_index
            order = [index.get(r.request_id) for r in scheduled]
            sampled = [() if j is None else sampled[j] for j in order]
        return scheduled, samples, sampled

    def _update_request(
        self,
        request: Request,
        tokens: list[int],
        logprobs: list | None,
        plp: list | None,
        now: float,
        free: bool = True,
    ) -> EngineCoreOutput | None:
        """update_from_output for one scheduled, running request (any case): appends ``tokens``
        up to a stop, frees the request if it finished (unless ``free`` is False), and returns
        its news (None if none)."""
        req_id = request.request_id
        if not tokens:  # a partial prompt chunk samples nothing
            return (
                EngineCoreOutput(req_id, [], None, None, None, plp, request.num_cached_tokens)
                if plp
                else None
            )
        new_logprobs = None
        if request.max_tokens == 0:  # prompt-only request: its prefill is done
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            new_tokens: list[int] = []
        else:
            stop_ids = request.stop_token_set
            min_tokens = request.sampling_params.min_tokens
            num_output = len(request.output_token_ids)
            count = 0
            for token in tokens:
                count += 1
                if token in stop_ids and num_output + count > min_tokens:
                    request.status = RequestStatus.FINISHED_STOPPED
                    if token != request.eos_token_id or request.sampling_params.ignore_eos:
                        request.stop_reason = token
                    break
                if num_output + count >= request.max_tokens:
                    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    break
            if not count:
                return (
                    EngineCoreOutput(req_id, [], None, None, None, plp, request.num_cached_tokens)
                    if plp
                    else None
                )
            new_tokens = list(tokens[:count])
            request.append_output_token_ids(new_tokens)
            if request.first_token_time is None:
                request.first_token_time = now
            if logprobs:
                new_logprobs = logprobs[:count]
        if request.status is _RUNNING:
            return EngineCoreOutput(
                req_id, new_tokens, None, None, new_logprobs, plp, request.num_cached_tokens
            )
        if free:
            self._free_request(request, now)
        return EngineCoreOutput(
            req_id,
            new_tokens,
            _FINISH_REASON[request.status],
            request.stop_reason,
            new_logprobs,
            plp,
            request.num_cached_tokens,
        )

    def make_stats(self) -> SchedulerStats:
        """Gauges now and counters since the previous call (which it resets); the fields are the
        scheduler's rows of ``jaxserve.stats_schema``."""
        kv_stats = self.kv_cache_manager.make_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv_stats.usage,
            prefix_cache_queries=kv_stats.prefix_cache.queries,
            prefix_cache_hits=kv_stats.prefix_cache.hits,
            prefix_cache_requests=kv_stats.prefix_cache.requests,
            host_cache_hits=kv_stats.prefix_cache.host_hits,
            host_kv_cache_usage=kv_stats.host_usage,
            kv_offload_stored_tokens=kv_stats.offload_stored_tokens,
            kv_offload_loaded_tokens=kv_stats.offload_loaded_tokens,
            kv_offload_resumed_loaded_tokens=kv_stats.resumed_loaded_tokens,
            kv_offload_resumed_recomputed_tokens=kv_stats.resumed_recomputed_tokens,
            num_preemptions=self._num_preemptions,
            num_scheduled_tokens=self._num_scheduled_tokens,
            num_steps=self._num_steps,
            spec_decode_num_drafts=self._spec_drafts,
            spec_decode_num_draft_tokens=self._spec_draft_tokens,
            spec_decode_num_accepted_tokens=self._spec_accepted,
            spec_decode_num_accepted_tokens_per_pos=tuple(self._spec_accepted_per_pos),
        )
        self._num_preemptions = self._num_scheduled_tokens = self._num_steps = 0
        self._spec_drafts = self._spec_draft_tokens = self._spec_accepted = 0
        self._spec_accepted_per_pos = [0] * self._spec_k
        return stats
