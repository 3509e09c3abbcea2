"""Scheduler output -> fixed-shape padded step inputs (numpy; StepInputs is a jax pytree).

The runner keeps a persistent ``InputBatch``: one row per running request holding its token ids
so far, its block-table row, its prompt length and its sampling params. Rows are updated, not
rebuilt (vLLM V1's ``gpu_input_batch.py``): new requests take a free row, scheduled ones append
new block ids and the step's token ids, finished and preempted ones give their row back.

Each step is then gathered from the rows with vectorized numpy (no loop over tokens) and padded
to a token bucket ``T`` and its sequence bucket ``S`` (``seq_bucket``), so the jitted step
compiles once per token bucket. Padding never changes results: padding tokens have slot -1 (they
write nowhere) and belong to no sequence; padding sequences have zero query and context length;
their sampled tokens are dropped on the host.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.worker.step_inputs import StepInputs
from pallas_kernels.bucketing import next_power_of_2

if TYPE_CHECKING:
    from jaxserve.core.sched_output import NewRequestData, SchedulerOutput
    from jaxserve.sampling_params import SamplingParams

MIN_TOKEN_BUCKET = 16
MAX_TOKEN_BUCKETS = 16


def default_token_buckets(
    max_num_batched_tokens: int,
    min_bucket: int = MIN_TOKEN_BUCKET,
    max_buckets: int = MAX_TOKEN_BUCKETS,
) -> tuple[int, ...]:
    """Powers of two from ``min_bucket`` below the budget, then the budget itself; at most
    ``max_buckets`` (the largest ones are kept).

    >>> default_token_buckets(8192)
    (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    >>> default_token_buckets(512, min_bucket=1)
    (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    """
    buckets = []
    b = min_bucket
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    buckets.append(int(max_num_batched_tokens))
    return tuple(buckets[-max_buckets:])


def resolve_token_buckets(
    configured: tuple[int, ...],
    max_num_batched_tokens: int,
    *,
    multiple: int = 1,
    min_bucket: int = MIN_TOKEN_BUCKET,
) -> tuple[int, ...]:
    """The configured buckets (``RunnerConfig.token_buckets``) or the default ones.

    ``multiple``: every bucket must be a multiple of it (the attention backend's rule,
    ``jaxserve.model.attention.token_bucket_multiple``: 8 for the TPU kernel); the default
    buckets round the budget's own bucket up to one. ``min_bucket``: the default ladder's
    first bucket (``jaxserve.model.attention.min_token_bucket``: 1 on the CPU's backend).

    Raises:
      ValueError: the largest configured bucket is below max_num_batched_tokens (a full step
        would fit no bucket), more than ``MAX_TOKEN_BUCKETS`` are given, or one is not a
        multiple of ``multiple``.
    """
    if not configured:
        buckets = default_token_buckets(max_num_batched_tokens, min_bucket)
        return tuple(sorted({-(-b // multiple) * multiple for b in buckets}))
    odd = [b for b in configured if b % multiple]
    if odd:
        raise ValueError(
            f"token_buckets must be multiples of {multiple} for this attention backend (the "
            f"TPU kernel's query tile), got {tuple(configured)}"
        )
    if max(configured) < max_num_batched_tokens:
        raise ValueError(
            f"token_buckets must reach max_num_batched_tokens ({max_num_batched_tokens}), "
            f"got {tuple(configured)}"
        )
    if len(configured) > MAX_TOKEN_BUCKETS:
        raise ValueError(
            f"token_buckets may hold at most {MAX_TOKEN_BUCKETS} sizes, got {len(configured)}"
        )
    return tuple(int(b) for b in configured)


def backend_token_buckets(
    backend: str, configured: tuple[int, ...], max_num_batched_tokens: int
) -> tuple[int, ...]:
    """``resolve_token_buckets`` under the rules of attention ``backend`` (one of
    ``jaxserve.model.attention.ATTENTION_BACKENDS``): its bucket multiple and its default
    ladder's first bucket. The runner, the memory plan and ``jaxserve tune``'s simulator all
    take their buckets from here, so the three agree.

    Raises:
      ValueError: as ``resolve_token_buckets``.
    """
    from jaxserve.model.attention import min_token_bucket, token_bucket_multiple

    return resolve_token_buckets(
        tuple(configured),
        max_num_batched_tokens,
        multiple=token_bucket_multiple(backend),
        min_bucket=min_token_bucket(backend),
    )


def seq_bucket(token_bucket: int, max_num_seqs: int) -> int:
    """Sequence bucket S of a token bucket T: ``next_power_of_2(min(T, max_num_seqs))``.

    Every sequence of a step has at least one token, so a step of <= T tokens has <= min(T,
    max_num_seqs) sequences; one S per T keeps one compile per token bucket.
    """
    return next_power_of_2(min(token_bucket, max_num_seqs))


def pick_bucket(buckets: tuple[int, ...], num_tokens: int) -> int:
    """Smallest bucket >= num_tokens.

    Raises:
      AssertionError: no bucket is large enough (the scheduler exceeded its token budget).
    """
    i = bisect.bisect_left(buckets, num_tokens)
    assert i < len(buckets), f"{num_tokens} tokens exceed the largest bucket {buckets[-1]}"
    return buckets[i]


@dataclasses.dataclass
class StepBatch:
    """One step: padded inputs plus the host-side bookkeeping to read its results.

    Attributes:
      inputs: the padded arrays.
      req_ids: ``[num_reqs]`` request ids in step order (sequence i of the step is req_ids[i]).
      rows: ``[num_reqs]`` int, their InputBatch rows.
      num_scheduled: ``[num_reqs]`` int, tokens computed per request this step.
      start_positions: ``[num_reqs]`` int, first position computed (num_computed_tokens).
      sample_mask: ``[num_reqs]`` bool, True where the step reaches the request's known length
        (its sampled token is kept); False for a partial prefill chunk (token discarded).
      token_bucket, seq_bucket: T and S.
      num_tokens: real tokens (sum of num_scheduled).
      prompt_logprob_targets: ``[T]`` int32 or None. When a request in the step asked for
        prompt logprobs: for step token j at prompt position p < prompt_len - 1 of such a
        request, the prompt token at p + 1 (whose logprob the logits at j give); -1 elsewhere.
      num_spec: ``[num_reqs]`` int, draft tokens per request (the last ones of its
        ``num_scheduled``: speculative decoding), or None when the step carries none.
    """

    inputs: StepInputs
    req_ids: list[str]
    rows: np.ndarray
    num_scheduled: np.ndarray
    start_positions: np.ndarray
    sample_mask: np.ndarray
    token_bucket: int
    seq_bucket: int
    num_tokens: int
    prompt_logprob_targets: np.ndarray | None = None
    num_spec: np.ndarray | None = None

    @property
    def num_reqs(self) -> int:
        """Real (unpadded) sequences of the step, len(req_ids)."""
        return len(self.req_ids)


class InputBatch:
    """Persistent per-request rows (vLLM V1's ``InputBatch``), numpy.

    Args:
      max_num_reqs: rows (the scheduler's max_num_seqs: a row per running request).
      max_model_len: longest sequence, tokens.
      block_size: tokens per KV block.
      num_groups: KV-cache groups (a block table each; ``jaxserve/core/kv_cache_groups.py``).

    Attributes:
      token_ids: ``[max_num_reqs, max_model_len]`` int32, prompt + output tokens known so far.
      num_tokens: ``[max_num_reqs]`` int32, how many of them are known.
      num_prompt_tokens: ``[max_num_reqs]`` int32.
      block_table: ``[num_groups, max_num_reqs, max_blocks_per_req]`` int32, padded with the
        null block 0 (append-only: a sliding-window group's freed blocks stay, outside every
        query's window).
      num_blocks: ``[max_num_reqs]`` int32, block ids held per row (in each group's table).
      params: per row, the request's SamplingParams (None for a free row).
      eos_token_ids: per row, the EOS id or None.
      req_id_to_row: request id -> row.
    """

    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, num_groups: int = 1
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_groups = num_groups
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_reqs, np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int32)
        self.block_table = np.zeros((num_groups, max_num_reqs, self.max_blocks_per_req), np.int32)
        self.num_blocks = np.zeros(max_num_reqs, np.int32)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.eos_token_ids: list[int | None] = [None] * max_num_reqs
        self.row_req_ids: list[str | None] = [None] * max_num_reqs
        # Bumped each time a row is handed out: a step's results still in flight are written
        # back (ModelRunner.collect) only to rows that did not change hands meanwhile.
        self.row_epoch = np.zeros(max_num_reqs, np.int64)
        self.req_id_to_row: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() hands out the lowest row
        self.row_changes = 0  # bumped whenever a row is given or taken back

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.req_id_to_row

    def add_request(self, new: NewRequestData) -> int:
        """Takes a free row for a new (or resumed) request; returns the row.

        Raises:
          AssertionError: the request already has a row, no row is free, or it is longer than
            max_model_len or its block table longer than a row.
        """
        assert new.req_id not in self.req_id_to_row, f"request {new.req_id} already has a row"
        assert self._free_rows, f"no free row (max_num_reqs={self.max_num_reqs})"
        row = self._free_rows.pop()
        self.row_epoch[row] += 1
        n_prompt, n_out = len(new.prompt_token_ids), len(new.output_token_ids)
        n = n_prompt + n_out
        assert n <= self.max_model_len, (
            f"request {new.req_id} has {n} tokens > {self.max_model_len}"
        )
        self.token_ids[row, :n_prompt] = new.prompt_token_ids
        self.token_ids[row, n_prompt:n] = new.output_token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = n_prompt
        self.num_blocks[row] = 0
        self.block_table[:, row] = 0
        self.append_block_ids(row, new.block_ids)
        self.params[row] = new.sampling_params
        self.eos_token_ids[row] = new.eos_token_id
        self.row_req_ids[row] = new.req_id
        self.req_id_to_row[new.req_id] = row
        self.row_changes += 1
        return row

    def remove_request(self, req_id: str) -> None:
        """Gives the request's row back; unknown ids are ignored (e.g. a request finished
        before it was ever scheduled)."""
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        self.params[row] = None
        self.eos_token_ids[row] = None
        self.row_req_ids[row] = None
        self.num_tokens[row] = 0
        self._free_rows.append(row)
        self.row_changes += 1

    def append_block_ids(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        """Appends block ids to the row's block tables, one list per group (all of one length).

        Raises:
          AssertionError: not one list per group, lists of different lengths, or a table
            longer than a row.
        """
        assert len(block_ids) == self.num_groups, (
            f"{len(block_ids)} tables, {self.num_groups} groups"
        )
        n = len(block_ids[0])
        if not n:
            return
        start = int(self.num_blocks[row])
        end = start + n
        assert end <= self.max_blocks_per_req, f"block table of row {row} overflows ({end} blocks)"
        for g, ids in enumerate(block_ids):
            assert len(ids) == n, f"groups' new blocks differ in number: {block_ids}"
            self.block_table[g, row, start:end] = ids
        self.num_blocks[row] = end

    def write_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        """Writes the step's token ids at ``[start, start + len)`` and extends the known length."""
        end = start + len(token_ids)
        assert end <= self.max_model_len, f"row {row} overflows max_model_len ({end} tokens)"
        if len(token_ids) == 1:
            self.token_ids[row, start] = token_ids[0]
        else:
            self.token_ids[row, start:end] = token_ids
        if end > self.num_tokens[row]:
            self.num_tokens[row] = end


@dataclasses.dataclass(slots=True, eq=False)
class _SteadyRun:
    """What ``BatchBuilder.build_steady`` keeps over a run of steady-decode steps: the latest
    batch, where each field of its n sequences lives in the packed buffer, and per ``k %
    block_size`` the sequences whose position ``k`` steps into the run is a block's first."""

    last: StepBatch
    positions: slice
    context_lens: slice
    slots: list[slice]  # per KV-cache group
    input_ids: slice
    prev_index: slice
    first_at: list[np.ndarray]
    max_start: int  # largest start position of the run's first batch
    steps: int = 0
    prev_identity: bool = False  # prev_index[:n] already holds 0..n-1


def _is_one(token_ids: list[int]) -> bool:
    return len(token_ids) == 1


class BatchBuilder:
    """Applies scheduler outputs to the InputBatch and builds padded StepBatches.

    Args:
      input_batch: the persistent rows.
      token_buckets: ascending padded step sizes (see ``resolve_token_buckets``).
      max_num_seqs: the scheduler's max_num_seqs (sets the sequence buckets).
    """

    def __init__(
        self, input_batch: InputBatch, token_buckets: tuple[int, ...], max_num_seqs: int
    ) -> None:
        self.batch = input_batch
        self.token_buckets = tuple(token_buckets)
        self.max_num_seqs = max_num_seqs
        self.max_seq_bucket = seq_bucket(self.token_buckets[-1], max_num_seqs)
        self._no_prev = np.zeros(self.max_seq_bucket, np.int32)  # prev_tokens when none is pending
        self._last_rows: tuple[int, list[str], np.ndarray] | None = None
        # Cached requests (indices into the step's cached req_ids) whose block tables grew in
        # the latest update_states.
        self._grown: list[int] = []
        self._run: _SteadyRun | None = None  # the run of steady steps build_steady is on

    def update_states(self, sched: SchedulerOutput) -> None:
        """Drops finished/preempted rows, adds new ones, appends new block ids and the step's
        token ids (the scheduler's ``new_token_ids``, so the rows never drift from its ledger).

        The cached requests' tokens are written with one numpy assignment when each has at most
        one (decode; in flight under async scheduling: none); block ids only where some came.
        Draft tokens (``scheduled_spec_decode_tokens``) are written after a row's known tokens
        without counting as known: the step reads them as inputs, its results overwrite them."""
        self._update_rows(sched)
        spec = sched.scheduled_spec_decode_tokens
        if spec:
            batch = self.batch
            for req_id, drafts in spec.items():
                row = batch.req_id_to_row[req_id]
                start = int(batch.num_tokens[row])
                assert start + len(drafts) <= batch.max_model_len, "drafts overflow max_model_len"
                batch.token_ids[row, start : start + len(drafts)] = drafts

    def _update_rows(self, sched: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in sched.finished_req_ids:
            batch.remove_request(req_id)
        for req_id in sched.preempted_req_ids:
            batch.remove_request(req_id)
        for new in sched.scheduled_new_reqs:
            batch.add_request(new)
        cached = sched.scheduled_cached_reqs
        req_ids = cached.req_ids
        self._grown = []
        if not req_ids:
            return
        to_row = batch.req_id_to_row
        self._grown = grown = list(itertools.compress(range(len(req_ids)), cached.new_block_ids))
        for i in grown:
            batch.append_block_ids(to_row[req_ids[i]], cached.new_block_ids[i])
        new_tokens = cached.new_token_ids
        if not new_tokens:
            return
        num_new = sum(map(len, new_tokens))
        if num_new == 0:
            return
        if num_new == len(req_ids) and all(map(_is_one, new_tokens)):
            rows = self._rows(req_ids)
            start = np.array(cached.num_computed_tokens, np.int64)
            assert start.max() < batch.max_model_len, "a row overflows max_model_len"
            batch.token_ids[rows, start] = [ids[0] for ids in new_tokens]
            np.maximum(batch.num_tokens[rows], start + 1, out=start)
            batch.num_tokens[rows] = start
            return
        for i, req_id in enumerate(req_ids):
            if new_tokens[i]:
                batch.write_tokens(to_row[req_id], cached.num_computed_tokens[i], new_tokens[i])

    def _rows(self, req_ids: list[str]) -> np.ndarray:
        """int64 ``[len(req_ids)]`` rows of the requests; the previous answer is reused while
        the ids are the same and no row changed hands (steady decode)."""
        batch = self.batch
        last = self._last_rows
        if last is not None and last[0] == batch.row_changes and last[1] == req_ids:
            return last[2]
        to_row = batch.req_id_to_row
        rows = np.fromiter(map(to_row.__getitem__, req_ids), np.int64, len(req_ids))
        self._last_rows = (batch.row_changes, list(req_ids), rows)
        return rows

    def build(
        self,
        sched: SchedulerOutput,
        prev_index: dict[str, int] | None = None,
        prev_tokens: np.ndarray | None = None,
    ) -> StepBatch:
        """The padded inputs of the step ``sched`` describes (call ``update_states`` first).

        Sequences are in the order of ``sched.num_scheduled_tokens``. ``prev_index`` and
        ``prev_tokens``: see ``build_from_arrays``.
        """
        req_ids = list(sched.num_scheduled_tokens)
        num_reqs = len(req_ids)
        assert num_reqs <= self.max_num_seqs, (
            f"{num_reqs} sequences > max_num_seqs {self.max_num_seqs}"
        )
        rows = self._rows(req_ids)
        n_sched = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, num_reqs)
        n_spec = None
        spec = sched.scheduled_spec_decode_tokens
        if spec:
            n_spec = np.fromiter((len(spec.get(r, ())) for r in req_ids), np.int64, num_reqs)
        new_reqs = sched.scheduled_new_reqs
        cached = sched.scheduled_cached_reqs
        if not new_reqs and cached.req_ids == req_ids:  # steady decode: one order
            start = np.array(cached.num_computed_tokens, np.int64)
        else:
            order = {r: i for i, r in enumerate(req_ids)}
            start = np.full(num_reqs, -1, np.int64)
            if new_reqs:
                start[[order[n.req_id] for n in new_reqs]] = [
                    n.num_computed_tokens for n in new_reqs
                ]
            if cached.req_ids:
                start[[order[r] for r in cached.req_ids]] = cached.num_computed_tokens
            assert np.all(start >= 0), "a scheduled request is neither new nor cached"
        return self.build_from_arrays(
            req_ids, rows, start, n_sched, prev_index, prev_tokens, n_spec=n_spec
        )

    def build_steady(
        self, sched: SchedulerOutput, last: StepBatch | None, prev_tokens: np.ndarray | None
    ) -> StepBatch | None:
        """``build`` of a steady-decode step (``SchedulerOutput.steady_decode``) from the
        previous step's batch ``last``: the same requests in the same rows and order, one token
        each at the next position, so only positions, context lengths, slots, input ids,
        ``prev_index`` and the block-table rows that grew change (in a copy of ``last``'s packed
        buffer: ``last`` may still be in flight). None when ``last`` does not match (the
        caller builds in full). Call ``update_states`` first.

        Async scheduling: a token not known yet is the one ``last`` samples for the same
        request, at the same sequence index (``prev_index`` i -> i).

        What stays the same over a run of such steps is kept in ``_SteadyRun`` (where each field
        lives in the packed buffer, which rows reach a block's first position at which step), so
        a step costs about ten numpy operations.
        """
        cached = sched.scheduled_cached_reqs
        req_ids = cached.req_ids
        n = len(req_ids)
        run = self._run
        if run is None or run.last is not last:
            run = self._start_run(sched, last)
            if run is None:
                return None
        elif sched.scheduled_new_reqs or sched.total_num_scheduled_tokens != n:
            return None
        if self._rows(req_ids) is not last.rows or last.req_ids != req_ids:
            return None  # other requests, or a row changed hands
        start = last.start_positions + 1
        if cached.num_computed_tokens != start.tolist():
            return None
        k = run.steps + 1
        assert run.max_start + k < self.batch.max_model_len, "a row overflows max_model_len"
        batch = self.batch
        rows = last.rows
        packed = last.inputs.packed.copy()
        packed[run.positions] += 1  # positions, context lengths and slots, one on
        packed[run.context_lens] += 1
        for slots in run.slots:
            packed[slots] += 1
        first = run.first_at[k % batch.block_size]  # at a block's first position: a new block's
        if len(first):
            bs = batch.block_size
            new_slots = batch.block_table[:, rows[first], start[first] // bs] * bs  # [G, n]
            for slots, group_slots in zip(run.slots, new_slots):
                packed[slots.start + first] = group_slots
        pending = start >= batch.num_tokens[rows]  # its token is the one ``last`` samples
        if pending.all():
            if not run.prev_identity:  # input ids are not read
                packed[run.prev_index] = np.arange(n)
                run.prev_identity = True
        else:
            packed[run.input_ids] = batch.token_ids[rows, start]
            packed[run.prev_index] = np.where(pending, np.arange(n), -1) if pending.any() else -1
            run.prev_identity = False
        prev = self._no_prev if prev_tokens is None else prev_tokens
        inputs = StepInputs(packed, prev, last.inputs.layout)
        if self._grown:
            grown = np.asarray(self._grown)
            inputs.block_tables[:, grown] = batch.block_table[:, rows[grown]]
        step = StepBatch(
            inputs=inputs,
            req_ids=req_ids,
            rows=rows,
            num_scheduled=last.num_scheduled,
            start_positions=start,
            sample_mask=last.sample_mask,  # every one samples: its token ends its known ones
            token_bucket=last.token_bucket,
            seq_bucket=last.seq_bucket,
            num_tokens=n,
        )
        run.last, run.steps = step, k
        return step

    def _start_run(self, sched: SchedulerOutput, last: StepBatch | None) -> _SteadyRun | None:
        """A new run of steady steps from ``last`` (a full build), if it is one decode token per
        request, each sampled (else None)."""
        self._run = None
        n = len(sched.scheduled_cached_reqs.req_ids)
        if (
            last is None
            or sched.scheduled_new_reqs
            or last.num_tokens != n
            or sched.total_num_scheduled_tokens != n
            or last.prompt_logprob_targets is not None
            or not last.sample_mask.all()
        ):
            return None
        off = StepInputs.offsets(last.inputs.layout)
        at = {f: slice(o, o + n) for f, (o, _, _) in off.items()}
        _, _, (num_groups, t) = off["slot_mapping"]  # one slot row of T per group
        slots = [
            slice(at["slot_mapping"].start + g * t, at["slot_mapping"].stop + g * t)
            for g in range(num_groups)
        ]
        bs = self.batch.block_size
        # the rows whose position k steps after last's is a block's first: (start + k) % bs == 0
        residue = last.start_positions % bs
        first_at = [np.flatnonzero(residue == (-k) % bs) for k in range(bs)]
        self._run = _SteadyRun(
            last=last,
            positions=at["positions"],
            context_lens=at["context_lens"],
            slots=slots,
            input_ids=at["input_ids"],
            prev_index=at["prev_index"],
            first_at=first_at,
            max_start=int(last.start_positions.max()),
        )
        return self._run

    def build_from_arrays(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        start: np.ndarray,
        n_sched: np.ndarray,
        prev_index: dict[str, int] | None = None,
        prev_tokens: np.ndarray | None = None,
        *,
        n_spec: np.ndarray | None = None,
    ) -> StepBatch:
        """``build`` on explicit arrays: ``rows``, ``start`` (num_computed_tokens) and
        ``n_sched`` (tokens this step), each integer ``[num_reqs]``, in ``req_ids`` order.
        ``n_spec``: integer ``[num_reqs]``, the draft tokens among each request's ``n_sched``
        (written after its known tokens by ``update_states``), or None.

        Async scheduling: a request may be scheduled one token past its known tokens, the token
        the step in flight samples for it. ``prev_index`` maps such a request to its sequence
        index in that step, whose sampled tokens ``prev_tokens`` (``[S_max]`` int32, a device
        array) holds; the jitted step reads the token from there.

        Raises:
          AssertionError: a request is scheduled past its known tokens (by more than the one
            token in flight), or no token bucket holds ``n_sched.sum()`` tokens.
        """
        batch = self.batch
        num_reqs = len(req_ids)
        total = int(n_sched.sum())
        T = pick_bucket(self.token_buckets, total)
        S = seq_bucket(T, self.max_num_seqs)
        bs = batch.block_size
        end = start + n_sched
        known = batch.num_tokens[rows]
        end_known = end if n_spec is None else end - n_spec  # where its sampled tokens go
        pending = end_known > known  # the last token is the one the step in flight samples
        prev_idx = np.full(T, -1, np.int32)
        if pending.any():
            assert prev_index is not None and np.all(end_known[pending] == known[pending] + 1), (
                "scheduled past the known tokens of a request"
            )
            seqs = np.nonzero(pending)[0]
            last = np.cumsum(n_sched) - 1 if n_spec is None else np.cumsum(n_sched) - 1 - n_spec
            prev_idx[last[seqs]] = [prev_index[req_ids[i]] for i in seqs]

        cu = np.cumsum(n_sched)
        seq_of_tok = np.repeat(np.arange(num_reqs), n_sched)  # [total]
        positions = np.arange(total) - np.repeat(cu - n_sched, n_sched) + start[seq_of_tok]
        row_of_tok = rows[seq_of_tok]
        block_ids = batch.block_table[:, row_of_tok, positions // bs]  # [G, total]

        input_ids = np.zeros(T, np.int32)
        input_ids[:total] = batch.token_ids[row_of_tok, positions]  # pending ones: from prev_idx
        pos_pad = np.zeros(T, np.int32)
        pos_pad[:total] = positions
        slot_mapping = np.full((batch.num_groups, T), -1, np.int32)
        slot_mapping[:, :total] = block_ids * bs + positions % bs
        block_tables = np.zeros((batch.num_groups, S, batch.max_blocks_per_req), np.int32)
        block_tables[:, :num_reqs] = batch.block_table[:, rows]
        context_lens = np.zeros(S, np.int32)
        context_lens[:num_reqs] = end
        query_start_loc = np.full(S + 1, total, np.int32)
        query_start_loc[0] = 0
        query_start_loc[1 : num_reqs + 1] = cu
        logits_indices = np.zeros(S, np.int32)
        logits_indices[:num_reqs] = cu - 1

        targets = None
        prompt_lens = batch.num_prompt_tokens[rows]
        want = np.fromiter(
            (batch.params[r].prompt_logprobs is not None for r in rows), bool, num_reqs
        )
        want &= start < prompt_lens - 1
        if want.any():
            # logits at prompt position p score the prompt token at p + 1
            scored = want[seq_of_tok] & (positions < prompt_lens[seq_of_tok] - 1)
            targets = np.full(T, -1, np.int32)
            nxt = np.minimum(positions + 1, batch.max_model_len - 1)
            targets[:total] = np.where(scored, batch.token_ids[row_of_tok, nxt], -1)

        inputs = StepInputs.from_arrays(
            input_ids=input_ids,
            positions=pos_pad,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=context_lens,
            query_start_loc=query_start_loc,
            num_seqs=np.asarray(num_reqs, np.int32),
            logits_indices=logits_indices,
            prev_index=prev_idx,
            prev_tokens=self._no_prev if prev_tokens is None else prev_tokens,
        )
        return StepBatch(
            inputs=inputs,
            req_ids=req_ids,
            rows=rows,
            num_scheduled=n_sched,
            start_positions=start,
            sample_mask=end_known >= known,
            token_bucket=T,
            seq_bucket=S,
            num_tokens=total,
            prompt_logprob_targets=targets,
            num_spec=n_spec,
        )
