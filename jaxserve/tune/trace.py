"""Workloads as traces: when each request arrives, its prompt tokens and its output length.

A trace comes from a preset or a JSONL file:

* presets ``qa``, ``long-doc``, ``mixed`` are ``jaxserve.bench.workloads.PRESETS`` (the
  same prompts ``jaxserve bench serve`` sends for the same seed and flags); ``multi-turn`` is
  conversations that share one system prompt, each turn's prompt the previous turn's prompt +
  its answer + a new user message (so prefix caching has something to find);
* a JSONL file, one request per line: ``arrival_time`` (s from the start, default 0),
  ``prompt_len`` (tokens) or ``prompt`` (text, tokenized), ``output_len`` (tokens), and
  optionally ``shared_prefix`` (a name; requests naming the same one share its first
  ``prefix_len`` tokens) or ``conversation_id`` (the request is that conversation's next turn).

Prompts are token ids drawn by ``workloads.TokenSource``, so a replay through the scheduler sees
exactly the sharing a real run would. A follow-up turn (``after`` set) is sent only when the
previous turn of its conversation finished (and not before its own arrival time).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

from jaxserve.bench.workloads import (
    PRESETS,
    TokenSource,
    WorkloadSpec,
    make_requests,
    poisson_arrivals,
)

PRESET_NAMES = ("qa", "long-doc", "mixed", "multi-turn")
MULTI_TURN = {
    "num_conversations": 16,
    "turns": 4,
    "system_len": 256,
    "input_len": 64,
    "output_len": 64,
    "request_rate": 2.0,
}


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
      arrival_s: earliest send time, seconds from the start.
      prompt: token ids.
      output_len: output tokens (sent as max_tokens with ignore_eos).
      after: index of the request that must finish first (the previous turn), or None; then
        it is sent at ``max(arrival_s, that finish + think_s)``.
      think_s: seconds between the previous turn's answer and this turn.
      kind: a label ("short", "long", "turn-2", ...).
    """

    arrival_s: float
    prompt: list[int]
    output_len: int
    after: int | None = None
    think_s: float = 0.0
    kind: str = ""


@dataclasses.dataclass(frozen=True)
class Trace:
    """Requests plus how they are sent: ``max_concurrency`` in flight at most (None: no cap).

    ``request_rate`` and ``seed`` are what made the arrival times (``poisson_arrivals``), so
    ``jaxserve bench serve`` with the same values sends the same requests at the same times.
    """

    requests: list[TraceRequest]
    max_concurrency: int | None = None
    name: str = ""
    request_rate: float = math.inf
    seed: int = 0

    def describe(self) -> str:
        """One line: name, count, mean prompt / output tokens, load."""
        n = len(self.requests)
        p = sum(len(r.prompt) for r in self.requests) / max(n, 1)
        o = sum(r.output_len for r in self.requests) / max(n, 1)
        load = f"concurrency {self.max_concurrency}" if self.max_concurrency else "open loop"
        return f"{self.name}: {n} requests, mean {p:.0f} prompt / {o:.0f} output tokens, {load}"


def preset_trace(name: str, source: TokenSource, seed: int = 0, **overrides: Any) -> Trace:
    """The trace of a preset; ``overrides`` replace its values (``num_prompts``, ``input_len``,
    ``output_len``, ``long_input_len``, ``long_output_len``, ``long_fraction``,
    ``request_rate``, ``max_concurrency``; multi-turn: ``num_conversations``, ``turns``,
    ``system_len``, ``input_len``, ``output_len``, ``request_rate``).

    Raises:
      ValueError: an unknown preset or override (named).
    """
    if name not in PRESET_NAMES:
        raise ValueError(f"workload must be one of {', '.join(PRESET_NAMES)}, got {name!r}")
    if name == "multi-turn":
        return _multi_turn(source, seed, **overrides)
    values = {**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}}
    rate = values.pop("request_rate", math.inf)
    concurrency = values.pop("max_concurrency", None)
    kind = values.pop("workload")
    fields = {f.name for f in dataclasses.fields(WorkloadSpec)}
    unknown = set(values) - fields
    if unknown:
        raise ValueError(f"unknown workload setting(s) for {name}: {', '.join(sorted(unknown))}")
    spec = WorkloadSpec(kind=kind, seed=seed, **values)
    reqs = make_requests(spec, source)
    times = poisson_arrivals(len(reqs), rate, seed)
    return Trace(
        [TraceRequest(t, list(r.prompt), r.output_len, kind=r.kind) for t, r in zip(times, reqs)],
        concurrency,
        name,
        rate,
        seed,
    )


def _multi_turn(source: TokenSource, seed: int, **overrides: Any) -> Trace:
    values = {**MULTI_TURN, **{k: v for k, v in overrides.items() if v is not None}}
    concurrency = values.pop("max_concurrency", None)
    unknown = set(values) - set(MULTI_TURN)
    if unknown:
        raise ValueError(f"unknown multi-turn setting(s): {', '.join(sorted(unknown))}")
    rng = np.random.default_rng([seed, 7])
    system = source.sample_ids(rng, int(values["system_len"]))
    starts = poisson_arrivals(int(values["num_conversations"]), values["request_rate"], seed)
    reqs: list[TraceRequest] = []
    for start in starts:  # each follow-up turn 0.5 s after its predecessor's answer
        history = list(system)
        for k in range(int(values["turns"])):
            history = history + source.sample_ids(rng, int(values["input_len"]))
            after = None if k == 0 else len(reqs) - 1
            reqs.append(
                TraceRequest(
                    start, list(history), int(values["output_len"]), after, 0.5, f"turn-{k + 1}"
                )
            )
            history = history + source.sample_ids(rng, int(values["output_len"]))
    return Trace(reqs, concurrency, "multi-turn")


def load_jsonl_trace(path: str, source: TokenSource, seed: int = 0) -> Trace:
    """Reads a JSONL trace (see the module docstring).

    Raises:
      ValueError: an unreadable file or a bad line (names the line and the field).
    """
    rng = np.random.default_rng([seed, 11])
    prefixes: dict[str, list[int]] = {}
    last_turn: dict[str, tuple[int, list[int]]] = {}
    reqs: list[TraceRequest] = []
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ValueError(f"trace: cannot read {path}: {exc}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
            arrival = float(row.get("arrival_time", 0.0))
            out_len = int(row["output_len"])
            if "prompt" in row:
                if source.tokenizer is None:
                    raise ValueError("prompt: text prompts need a tokenizer")
                own = list(source.tokenizer.encode(str(row["prompt"])))
            else:
                own = source.sample_ids(rng, int(row["prompt_len"]))
            if out_len < 1 or not own or arrival < 0 or not math.isfinite(arrival):
                raise ValueError("output_len and prompt must be >= 1, arrival_time >= 0")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"trace {path} line {n}: {exc}") from None
        after = None
        prompt = own
        if row.get("conversation_id") is not None:
            conv = str(row["conversation_id"])
            if conv in last_turn:
                after, history = last_turn[conv]
                prompt = history + own
        elif row.get("shared_prefix") is not None:
            name = str(row["shared_prefix"])
            plen = int(row.get("prefix_len", 0))
            if name not in prefixes:
                prefixes[name] = source.sample_ids(rng, plen)
            prompt = prefixes[name] + own
        idx = len(reqs)
        reqs.append(TraceRequest(arrival, prompt, out_len, after=after))
        if row.get("conversation_id") is not None:
            answer = source.sample_ids(rng, out_len)
            last_turn[str(row["conversation_id"])] = (idx, prompt + answer)
    if not reqs:
        raise ValueError(f"trace {path}: no requests")
    return Trace(reqs, None, path)
