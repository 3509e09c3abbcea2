"""The engine's figures in one table, from which every stats type and metric family is built.

Each row of :data:`STATS` is one figure: its name, whether it is a gauge (the state now), a
counter (counted per step) or an engine time total, who measures it (the scheduler or the
engine), and the Prometheus family it feeds, if any. From the table come:

* :class:`SchedulerStats`: the scheduler's rows, filled by ``Scheduler.make_stats()`` once per
  step (gauges now; counters since the previous call);
* :class:`EngineStats`: what ``LLMEngine.get_stats()`` returns: every row the engine carries,
  with the latest step's value, plus ``<name>_total`` (the running sum since start) for each
  counter, plus the engine's time totals in seconds;
* the step families of ``jaxserve/metrics.py``: a gauge per gauge row with a metric name, set
  from the field; a counter per counter row with one, grown from its ``_total`` field. The row's
  ``doc`` is the family's HELP text.

A new counter is one row here and the line that counts it (in ``Scheduler.make_stats`` or
``LLMEngine._update_stats``); the engine's copy, its total and its metric family follow.
Pure Python, no jax.
"""

from __future__ import annotations

import dataclasses

GAUGE = "gauge"
"""The state now (the engine reads the scheduler's gauges again in ``get_stats``)."""
COUNTER = "counter"
"""Counted per step; EngineStats also keeps ``<name>_total``, the running sum since start."""
SECONDS = "seconds"
"""Engine time, seconds, a running total only (float)."""

SCHEDULER = "scheduler"
"""Measured by ``Scheduler.make_stats`` (with the KV-cache manager's figures)."""
ENGINE = "engine"
"""Measured by ``LLMEngine`` after the scheduler's update (output processor, step timing)."""


@dataclasses.dataclass(frozen=True)
class Stat:
    """One figure of the engine.

    Attributes:
      name: the field name in SchedulerStats / EngineStats.
      kind: GAUGE, COUNTER or SECONDS.
      source: SCHEDULER or ENGINE.
      doc: what it measures, with units; the HELP text of its metric family.
      metric: the Prometheus family it feeds, without the namespace (``None``: not exported).
      engine: False for a scheduler figure that stays in SchedulerStats (read by the
        scheduler's tests), not carried into EngineStats.
      type: ``int``, ``float``, or ``tuple`` (a counter per position, exported with a
        ``position`` label; totals add position by position, ``add_counts``).
    """

    name: str
    kind: str
    source: str
    doc: str
    metric: str | None = None
    engine: bool = True
    type: type = int


STATS: tuple[Stat, ...] = (
    # Exported, in the order of the exposition.
    Stat(
        "num_running_reqs",
        GAUGE,
        SCHEDULER,
        "Requests holding KV blocks (in the running batch).",
        "num_requests_running",
    ),
    Stat(
        "num_waiting_reqs",
        GAUGE,
        SCHEDULER,
        "Requests waiting to be scheduled (preempted included).",
        "num_requests_waiting",
    ),
    # Used blocks / usable blocks, in [0, 1]; cached blocks no request holds count as free.
    Stat(
        "kv_cache_usage",
        GAUGE,
        SCHEDULER,
        "KV-cache usage, fraction of blocks in use (1 = full).",
        "kv_cache_usage_perc",
        type=float,
    ),
    Stat(
        "num_preemptions",
        COUNTER,
        SCHEDULER,
        "Preemptions (recompute) of running requests.",
        "num_preemptions",
    ),
    # Only a request's first admission is looked up, not its recompute after a preemption.
    Stat(
        "prefix_cache_queries",
        COUNTER,
        SCHEDULER,
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queries",
    ),
    Stat(
        "prefix_cache_hits",
        COUNTER,
        SCHEDULER,
        "Prompt tokens found in the prefix cache.",
        "prefix_cache_hits",
    ),
    Stat(
        "host_cache_hits",
        COUNTER,
        SCHEDULER,
        "Of the prefix-cache hits, prompt tokens found in the host KV tier (offloading).",
        "host_prefix_cache_hits",
    ),
    Stat(
        "kv_offload_stored_tokens",
        COUNTER,
        SCHEDULER,
        "Tokens of KV copied from the device to the host tier.",
        "kv_offload_stored_tokens",
    ),
    Stat(
        "kv_offload_loaded_tokens",
        COUNTER,
        SCHEDULER,
        "Tokens of KV copied from the host tier back to the device.",
        "kv_offload_loaded_tokens",
    ),
    # The resumed requests' host hits, loaded or recomputed by the start-up cost probe's choice.
    Stat(
        "kv_offload_resumed_loaded_tokens",
        COUNTER,
        SCHEDULER,
        "Host-tier tokens of resumed preempted requests loaded back (cheaper than recompute).",
        "kv_offload_resumed_loaded_tokens",
    ),
    Stat(
        "kv_offload_resumed_recomputed_tokens",
        COUNTER,
        SCHEDULER,
        "Host-tier tokens of resumed preempted requests recomputed (cheaper than a load).",
        "kv_offload_resumed_recomputed_tokens",
    ),
    Stat(
        "host_kv_cache_usage",
        GAUGE,
        SCHEDULER,
        "Host KV tier usage, fraction of host blocks holding a block (0 when off).",
        "host_kv_cache_usage_perc",
        type=float,
    ),
    # Prompts of requests that produced their first token (or finished prompt-only) this step.
    Stat(
        "num_prompt_tokens",
        COUNTER,
        ENGINE,
        "Prompt tokens of requests that started generating.",
        "prompt_tokens",
    ),
    Stat("num_generation_tokens", COUNTER, ENGINE, "Generated tokens.", "generation_tokens"),
    # Speculative decoding (vLLM's families): a draft is one request's drafts in one step.
    Stat(
        "spec_decode_num_drafts",
        COUNTER,
        SCHEDULER,
        "Speculative decoding: drafts verified (one request's draft tokens in one step).",
        "spec_decode_num_drafts",
    ),
    Stat(
        "spec_decode_num_draft_tokens",
        COUNTER,
        SCHEDULER,
        "Speculative decoding: draft tokens verified.",
        "spec_decode_num_draft_tokens",
    ),
    Stat(
        "spec_decode_num_accepted_tokens",
        COUNTER,
        SCHEDULER,
        "Speculative decoding: draft tokens accepted.",
        "spec_decode_num_accepted_tokens",
    ),
    # One count per draft position (0 = the first draft token); exported with a position label.
    Stat(
        "spec_decode_num_accepted_tokens_per_pos",
        COUNTER,
        SCHEDULER,
        "Speculative decoding: draft tokens accepted, by position in the draft.",
        "spec_decode_num_accepted_tokens_per_pos",
        type=tuple,
    ),
    # Not exported.
    Stat(
        "prefix_cache_requests",
        COUNTER,
        SCHEDULER,
        "Requests looked up in the prefix cache (first admissions).",
        engine=False,
    ),
    Stat("num_scheduled_tokens", COUNTER, SCHEDULER, "Tokens scheduled."),
    Stat("num_steps", COUNTER, SCHEDULER, "Steps (schedule() calls)."),
    Stat("num_finished_reqs", COUNTER, ENGINE, "Parent requests that finished."),
    Stat("schedule_s", SECONDS, ENGINE, "Seconds in the scheduler.", type=float),
    Stat(
        "runner_host_s",
        SECONDS,
        ENGINE,
        "Seconds of the runner's host work: row updates, batch build, sampling metadata, launch.",
        type=float,
    ),
    Stat(
        "runner_launch_s",
        SECONDS,
        ENGINE,
        "Of runner_host_s, seconds of the launch: argument transfer and dispatch of the jitted "
        "calls.",
        type=float,
    ),
    Stat(
        "host_cpu_s",
        SECONDS,
        ENGINE,
        "Thread CPU seconds of the host work (schedule, runner host without its launches, "
        "output); load on other cores does not inflate it.",
        type=float,
    ),
    Stat(
        "runner_device_s",
        SECONDS,
        ENGINE,
        "Seconds from dispatch until the tokens are on the host.",
        type=float,
    ),
    Stat(
        "output_s",
        SECONDS,
        ENGINE,
        "Seconds of the output: runner output, scheduler update, detokenization, RequestOutputs.",
        type=float,
    ),
)
"""Every figure; a name appears once."""

EXPORTED: tuple[Stat, ...] = tuple(s for s in STATS if s.metric is not None)
"""The rows with a Prometheus family, in the exposition's order."""

SCHEDULER_TO_ENGINE: tuple[str, ...] = tuple(
    s.name for s in STATS if s.source == SCHEDULER and s.engine
)
"""SchedulerStats fields the engine copies into EngineStats after each step."""

COUNTER_TOTALS: tuple[tuple[str, str], ...] = tuple(
    (s.name, s.name + "_total") for s in STATS if s.kind == COUNTER and s.engine
)
"""(counter, its running total) of every EngineStats counter."""


def add_counts(a: int | tuple, b: int | tuple) -> int | tuple:
    """``a + b`` for a counter: ints add; per-position tuples add position by position (the
    shorter one padded with zeros)."""
    if isinstance(a, tuple):
        n = max(len(a), len(b))
        return tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n))
    return a + b


def _dataclass(
    name: str, summary: str, fields: list[tuple[str, type, str]], *, zero_defaults: bool
) -> type:
    """A dataclass of ``fields`` = ``[(name, type, doc)]`` whose docstring lists them; each field
    defaults to zero when ``zero_defaults``, else is required."""
    specs = [
        (n, t, dataclasses.field(default=t())) if zero_defaults else (n, t) for n, t, _ in fields
    ]
    cls = dataclasses.make_dataclass(name, specs, module=__name__)
    cls.__doc__ = "\n".join([summary, "", "Attributes:"] + [f"  {n}: {d}" for n, _, d in fields])
    return cls


_TYPES = {s.name: s.type for s in STATS}
_WHEN = {GAUGE: "gauge, now", COUNTER: "counter, this step", SECONDS: "running total"}


def _fields(stats: tuple[Stat, ...] | list[Stat]) -> list[tuple[str, type, str]]:
    return [(s.name, s.type, f"{s.doc} ({_WHEN[s.kind]})") for s in stats]


SchedulerStats = _dataclass(
    "SchedulerStats",
    "Scheduler and KV-cache figures of one step (``Scheduler.make_stats``): gauges now, "
    "counters since the previous call. Every field is required, so a new scheduler row that "
    "``make_stats`` does not fill fails at once.",
    _fields([s for s in STATS if s.source == SCHEDULER]),
    zero_defaults=False,
)

EngineStats = _dataclass(
    "EngineStats",
    "What the metrics layer reads after each step (``LLMEngine.get_stats``): the gauges now, "
    "each counter's latest step and its ``_total`` since start, the engine's time totals.",
    _fields([s for s in STATS if s.kind != SECONDS and s.engine])
    + [
        (total, _TYPES[name], f"running sum of ``{name}`` since start")
        for name, total in COUNTER_TOTALS
    ]
    + _fields([s for s in STATS if s.kind == SECONDS]),
    zero_defaults=True,
)
