"""One request's life as a record: the events the scheduler already knows, kept as it goes.

Every ``Request`` carries a ``RequestLedger``. The scheduler calls into it at the few places
where something happens to a request:

* ``admitted``: taken from the waiting queue (first time or after a preemption), with the
  prefix-cache hit it got;
* ``scheduled``: a prompt chunk, a recompute chunk or a decode token computed in a step
  (the decode fast path appends the step index to ``decode_steps`` itself: one list append);
* ``preempted``: evicted by recompute, with the tokens whose K/V it threw away and the blocks
  it held in each KV-cache group (a sliding-window group holds only its window's);
* ``speculated``: a step verified draft tokens of it (speculative decoding): how many were
  drafted and how many accepted;
* ``finished``: freed, for any reason (keeps the request's times and counts, so the ledger
  outlives the request and its token lists; the request hands them over in ``close_ledger``).

Cost per request per step is O(1): a list append (decode) or a small tuple (chunk). Memory is
one list slot per decode step and one tuple per chunk or preemption.

Token accounting: tokens computed again after a preemption are *recomputed*, never prefix-cache
hits. At re-admission the prefix cache may hand back blocks the request had computed before it
was preempted; those tokens are *restored*, not hits; only hit tokens beyond everything the
request ever computed count as device hits, and the same for ``host_hit_tokens`` (tokens
loaded from the host KV tier; None when offloading is off).

Times are ``time.monotonic()`` seconds; ``to_dict`` reports them as seconds since arrival and
the arrival as Unix time.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

PREFILL, DECODE, RECOMPUTE = "prefill", "decode", "recompute"


class RequestLedger:
    """The record of one request (see the module docstring).

    Attributes:
      decode_steps: step indices in which it computed one decode token.
      chunks: ``(step, time, start, num_tokens, kind, recomputed)`` per prefill / recompute
        chunk (and multi-token decodes): it covered token positions ``[start, start +
        num_tokens)``, of which the first ``recomputed`` had been computed before a preemption
        (a "recompute" chunk may run on past them into new positions).
      preemptions: ``[step, time, tokens_discarded, resume_step, resume_time,
        tokens_restored, tokens_recomputed, resumed_by, host_tokens, blocks_discarded]`` per
        preemption (resume fields None until resumed). With offloading, ``resumed_by`` is
        "load" or "recompute": the cost model's choice for the ``host_tokens`` tokens found in
        the host tier at the resume (None: none were found). ``blocks_discarded``: the KV blocks
        it held per KV-cache group when preempted (None when not given).
      device_hit_tokens: prompt tokens served from the device prefix cache at admission(s).
      host_hit_tokens: prompt tokens loaded from the host KV tier at admission(s); None when
        offloading is off.
      high_water: most tokens whose K/V it ever had (set at preemption); positions below it
        computed again are recomputed.
      num_drafts, num_draft_tokens, num_accepted_tokens: speculative decoding: steps that
        verified drafts of it, the draft tokens they verified, and those accepted (a step's
        rejected drafts computed K/V that was rolled back).
      request_id .. finish_reason, lora_name: copied from the request by ``finished``.
    """

    __slots__ = (
        "decode_steps",
        "chunks",
        "preemptions",
        "device_hit_tokens",
        "host_hit_tokens",
        "high_water",
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "request_id",
        "arrival_time",
        "first_scheduled_time",
        "first_token_time",
        "finished_time",
        "finish_reason",
        "stop_reason",
        "num_prompt_tokens",
        "num_output_tokens",
        "num_cached_tokens",
        "lora_name",
    )

    def __init__(self) -> None:
        self.decode_steps: list[int] = []
        self.chunks: list[tuple[int, float, int, int, str, int]] = []
        self.preemptions: list[list] = []
        self.device_hit_tokens = 0
        self.host_hit_tokens: int | None = None
        self.high_water = 0
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.request_id = ""
        self.arrival_time = self.first_scheduled_time = self.first_token_time = None
        self.finished_time = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.lora_name: str | None = None

    # ------------------------------------------------------------------ scheduler events

    def admitted(self, step: int, now: float, num_hit: int, num_device: int | None = None) -> None:
        """Taken from the waiting queue with ``num_hit`` tokens (whole blocks) found in the
        prefix cache: the first ``num_device`` on the device, the rest loaded from the host
        tier (``num_device`` None: offloading is off, all on the device). Call ``scheduled``
        for its first chunk after this."""
        hw = self.high_water
        if self.preemptions and self.preemptions[-1][3] is None:
            record = self.preemptions[-1]
            record[3], record[4] = step, now
            record[5] = min(num_hit, hw)
        if num_device is None:
            self.device_hit_tokens += max(0, num_hit - hw)
            return
        self.device_hit_tokens += max(0, num_device - hw)
        self.host_hit_tokens = (self.host_hit_tokens or 0) + max(0, num_hit - max(num_device, hw))

    def scheduled(
        self, step: int, now: float, start: int, num_tokens: int, num_prompt: int
    ) -> None:
        """Computes token positions ``[start, start + num_tokens)`` in step ``step``."""
        hw = self.high_water
        redo = 0
        if start < hw:
            redo = min(start + num_tokens, hw) - start
            self.preemptions[-1][6] += redo
            kind = RECOMPUTE
        elif start < num_prompt:
            kind = PREFILL
        elif num_tokens == 1:
            self.decode_steps.append(step)
            return
        else:
            kind = DECODE
        self.chunks.append((step, now, start, num_tokens, kind, redo))

    def preempted(
        self, step: int, now: float, num_computed: int, group_blocks: list[int] | None = None
    ) -> None:
        """Evicted by recompute in step ``step``, throwing away ``num_computed`` tokens of K/V
        held in ``group_blocks`` blocks per KV-cache group."""
        self.preemptions.append([step, now, num_computed, None, None, 0, 0, None, 0, group_blocks])
        if num_computed > self.high_water:
            self.high_water = num_computed

    def speculated(self, num_draft: int, num_accepted: int) -> None:
        """A step verified ``num_draft`` draft tokens of it and accepted ``num_accepted``."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted

    def resumed_from_host(self, loads: bool, num_tokens: int) -> None:
        """At a resume (before ``admitted``): ``num_tokens`` tokens were found in the host KV
        tier, and the cost model chose to load them (``loads``) or to recompute them."""
        if self.preemptions:
            record = self.preemptions[-1]
            record[7], record[8] = ("load" if loads else "recompute"), num_tokens

    def finished(
        self,
        *,
        request_id: str,
        arrival_time: float,
        first_scheduled_time: float | None,
        first_token_time: float | None,
        finished_time: float | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
        num_prompt_tokens: int,
        num_output_tokens: int,
        num_cached_tokens: int,
        lora_name: str | None = None,
    ) -> None:
        """Keeps the request's times (monotonic seconds), token counts, finish reason and LoRA
        adapter (None: the base model), so the ledger outlives it (``Request.close_ledger``
        calls this when the request is freed; ``num_cached_tokens`` -1, never scheduled, is
        kept as 0)."""
        self.lora_name = lora_name
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.first_scheduled_time = first_scheduled_time
        self.first_token_time = first_token_time
        self.finished_time = finished_time
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = num_output_tokens
        self.num_cached_tokens = max(num_cached_tokens, 0)

    # ------------------------------------------------------------------ reading

    @property
    def num_recomputed_tokens(self) -> int:
        """Tokens computed again after preemptions, all preemptions together."""
        return sum(p[6] for p in self.preemptions)

    def to_dict(self) -> dict[str, Any]:
        """The ledger as JSON-ready data (times in seconds since arrival; None = never)."""
        arrival = self.arrival_time
        wall = time.time() - time.monotonic()

        def rel(t: float | None) -> float | None:
            return None if t is None or arrival is None else round(t - arrival, 6)

        steps = [
            {"step": s, "t_s": rel(t), "kind": kind, "start": start, "tokens": n}
            for s, t, start, n, kind, _ in self.chunks
        ]
        for entry, chunk in zip(steps, self.chunks):
            if chunk[5]:
                entry["recomputed"] = chunk[5]
        steps += [{"step": s, "kind": DECODE, "tokens": 1} for s in self.decode_steps]
        steps.sort(key=lambda e: e["step"])
        n_prefill = sum(c[3] for c in self.chunks if c[4] == PREFILL)
        preemptions = [
            {
                "step": step,
                "t_s": rel(t),
                "tokens_discarded": discarded,
                "resumed_step": resume_step,
                "resumed_t_s": rel(resume_t),
                "tokens_restored_from_cache": restored,
                "tokens_recomputed": recomputed,
                "resumed_by": resumed_by,
                "host_tokens": host_tokens,
                "kv_blocks_discarded": blocks,
            }
            for (
                step,
                t,
                discarded,
                resume_step,
                resume_t,
                restored,
                recomputed,
                resumed_by,
                host_tokens,
                blocks,
            ) in self.preemptions
        ]
        ttft = rel(self.first_token_time)
        return {
            "request_id": self.request_id,
            "lora_name": self.lora_name,
            "arrival_time": None if arrival is None else round(arrival + wall, 6),
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "queued_s": rel(self.first_scheduled_time),
            "first_token_s": ttft,
            "finished_s": rel(self.finished_time),
            "prefix_cache_hit_tokens": {
                "device": self.device_hit_tokens,
                "host": self.host_hit_tokens,
            },
            "num_steps": len(steps),
            "num_prefill_tokens": n_prefill,
            "num_decode_steps": len(self.decode_steps),
            "num_preemptions": len(preemptions),
            "num_recomputed_tokens": self.num_recomputed_tokens,
            "speculative": {
                "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
            },
            "preemptions": preemptions,
            "steps": steps,
        }


def parent_ledger_dict(request_id: str, ledgers: list[RequestLedger]) -> dict[str, Any]:
    """The ledger of a user request: its one sample's ledger, or ``{"request_id", "samples"}``
    with one ledger per sample when it asked for ``n > 1``."""
    if len(ledgers) == 1:
        out = ledgers[0].to_dict()
        out["request_id"] = request_id
        return out
    return {"request_id": request_id, "samples": [led.to_dict() for led in ledgers]}


def response_ledger(
    response_id: str, parts: list[tuple[str, list[RequestLedger]]]
) -> dict[str, Any]:
    """The ledger of an API response made of engine requests ``parts`` = ``[(engine_id,
    ledgers)]`` (one per prompt): the one request's ledger, or ``{"request_id", "prompts"}``."""
    if len(parts) == 1:
        return parent_ledger_dict(*parts[0])
    return {
        "request_id": response_id,
        "prompts": [parent_ledger_dict(rid, ledgers) for rid, ledgers in parts],
    }


class LedgerHistory:
    """The ledgers of the last ``capacity`` finished requests, by request id (a bounded ring).

    Written by the engine thread, read by the server's; each operation is one dict call under a
    lock. ``capacity`` 0 keeps nothing.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"ledger_history must be >= 0, got {capacity}")
        self.capacity = capacity
        self._ring: collections.OrderedDict[str, list[RequestLedger]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ring)

    def add(self, request_id: str, ledgers: list[RequestLedger]) -> None:
        """Keeps a finished request's ledgers, dropping the oldest beyond capacity."""
        if not self.capacity:
            return
        with self._lock:
            ring = self._ring
            ring.pop(request_id, None)
            ring[request_id] = ledgers
            while len(ring) > self.capacity:
                ring.popitem(last=False)

    def get(self, request_id: str) -> dict[str, Any] | None:
        """A finished request's ledger as JSON-ready data, or None when unknown or dropped.

        ``request_id`` is an engine request id, or an API response id (``cmpl-...``) whose
        prompts ran as engine requests ``{request_id}-0``, ``-1``, ... (see response_ledger).
        """
        with self._lock:
            ledgers = self._ring.get(request_id)
            if ledgers is not None:
                return parent_ledger_dict(request_id, ledgers)
            parts = []
            while (ledgers := self._ring.get(f"{request_id}-{len(parts)}")) is not None:
                parts.append((f"{request_id}-{len(parts)}", ledgers))
        return response_ledger(request_id, parts) if parts else None
