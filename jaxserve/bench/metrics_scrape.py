"""What the server's Prometheus ``/metrics`` says about a benchmark run.

Works with jaxserve (``jaxserve:`` names) and vLLM (``vllm:`` names; older vLLM's
``gpu_cache_usage_perc`` too): a sample's name is taken after its ``prefix:``. Samples of one
name with different labels (several models or engines) are summed, except usage fractions
(``*_perc``), of which the largest is kept.

A run reads ``/metrics`` before and after (counters: ``after - before``) and polls it every
``interval_s`` in between (gauges: their peaks, and a timeline):

* preemptions: growth of ``num_preemptions_total``;
* prefix-cache hit rate: growth of ``prefix_cache_hits_total`` / growth of
  ``prefix_cache_queries_total`` (prompt tokens found / looked up), None with no query;
* peak waiting and running requests (``num_requests_waiting``, ``num_requests_running``) and
  peak KV-cache usage (``kv_cache_usage_perc``, a fraction in [0, 1]);
* speculative decoding (vLLM ``bench serve``'s figures): drafts, draft tokens and accepted
  tokens (growth of ``spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total``), the acceptance rate (accepted / draft tokens), the mean
  acceptance length (1 + accepted / drafts: tokens a step yields per request) and the
  acceptance rate per draft position (``..._num_accepted_tokens_per_pos_total{position}``
  growth / drafts).

Peaks are sampled, so a spike shorter than the interval can be missed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

GAUGES = {
    "waiting": ("num_requests_waiting",),
    "running": ("num_requests_running",),
    "kv_cache_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
}
COUNTERS = {
    "preemptions": "num_preemptions_total",
    "prefix_cache_hits": "prefix_cache_hits_total",
    "prefix_cache_queries": "prefix_cache_queries_total",
    "spec_decode_num_drafts": "spec_decode_num_drafts_total",
    "spec_decode_draft_tokens": "spec_decode_num_draft_tokens_total",
    "spec_decode_accepted_tokens": "spec_decode_num_accepted_tokens_total",
}
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"
"""The one family read per ``position`` label (kept as ``name[position]``)."""


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name (without its ``prefix:``) -> value, from a Prometheus text exposition.

    Raises:
      ValueError: the text is not a valid exposition.
    """
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.split(":", 1)[-1]
            if name == PER_POSITION and "position" in sample.labels:
                name = f"{name}[{sample.labels['position']}]"
            if name.endswith("_perc"):
                out[name] = max(out.get(name, sample.value), sample.value)
            else:
                out[name] = out.get(name, 0.0) + sample.value
    return out


def snapshot(metrics: dict[str, float]) -> dict[str, float | None]:
    """The gauges and counters a benchmark reports (None where the server has no such metric)."""
    out: dict[str, float | None] = {}
    for key, names in GAUGES.items():
        out[key] = next((metrics[n] for n in names if n in metrics), None)
    for key, name in COUNTERS.items():
        out[key] = metrics.get(name)
    pos = 0
    while f"{PER_POSITION}[{pos}]" in metrics:
        out[f"spec_decode_accepted_pos{pos}"] = metrics[f"{PER_POSITION}[{pos}]"]
        pos += 1
    return out


async def fetch_snapshot(
    session: aiohttp.ClientSession, metrics_url: str
) -> dict[str, float | None] | None:
    """The server's snapshot now, or None if ``/metrics`` cannot be read or parsed."""
    try:
        async with session.get(metrics_url) as response:
            if response.status != 200:
                return None
            return snapshot(parse_metrics(await response.text()))
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


class MetricsPoller:
    """Polls ``/metrics`` every ``interval_s`` seconds in a task until ``stop()``.

    Attributes:
      samples: ``(seconds since start, snapshot)`` per successful poll.

    Raises:
      ValueError: ``interval_s`` is not > 0 (named ``metrics_interval``, the CLI flag).
    """

    def __init__(
        self, session: aiohttp.ClientSession, metrics_url: str, interval_s: float = 0.5
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"metrics_interval must be > 0, got {interval_s}")
        self.session = session
        self.metrics_url = metrics_url
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, float | None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0

    def start(self) -> None:
        """Starts polling in an asyncio task (call from a running event loop); sample times
        count from now."""
        self._t0 = time.perf_counter()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            snap = await fetch_snapshot(self.session, self.metrics_url)
            if snap is not None:
                self.samples.append((time.perf_counter() - self._t0, snap))
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        """Cancels the polling task and waits for it; ``samples`` keeps what was gathered."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


def _peak(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _delta(
    before: dict[str, float | None], after: dict[str, float | None], key: str
) -> float | None:
    a, b = after.get(key), before.get(key)
    return None if a is None or b is None else a - b


def run_figures(
    before: dict[str, float | None] | None,
    after: dict[str, float | None] | None,
    samples: list[tuple[float, dict[str, float | None]]],
) -> dict[str, Any]:
    """The server-side figures of a run (None where a metric was unavailable).

    Returns:
      ``preemptions``, ``prefix_cache_hits``, ``prefix_cache_queries``,
      ``prefix_cache_hit_rate`` (fraction), ``peak_waiting``, ``peak_running``,
      ``peak_kv_cache_usage`` (fraction), ``spec_decode`` (``spec_decode_figures``; None
      when no draft was verified or the server has no such metrics), and ``timeline``:
      ``{"t", "waiting", "running", "kv_cache_usage"}`` lists, one entry per poll.
    """
    snaps = [s for _, s in samples] + [s for s in (before, after) if s is not None]
    out: dict[str, Any] = {
        k: None
        for k in (
            "preemptions",
            "prefix_cache_hits",
            "prefix_cache_queries",
            "prefix_cache_hit_rate",
            "spec_decode",
        )
    }
    if before is not None and after is not None:
        for key in ("preemptions", "prefix_cache_hits", "prefix_cache_queries"):
            out[key] = _delta(before, after, key)
        hits, queries = out["prefix_cache_hits"], out["prefix_cache_queries"]
        if hits is not None and queries:
            out["prefix_cache_hit_rate"] = hits / queries
        out["spec_decode"] = spec_decode_figures(before, after)
    out["peak_waiting"] = _peak([s.get("waiting") for s in snaps])
    out["peak_running"] = _peak([s.get("running") for s in snaps])
    out["peak_kv_cache_usage"] = _peak([s.get("kv_cache_usage") for s in snaps])
    out["timeline"] = {
        "t": [t for t, _ in samples],
        **{k: [s.get(k) for _, s in samples] for k in ("waiting", "running", "kv_cache_usage")},
    }
    return out


def spec_decode_figures(
    before: dict[str, float | None], after: dict[str, float | None]
) -> dict[str, Any] | None:
    """Speculative decoding over a run, as vLLM's ``bench serve`` reports it: ``num_drafts``,
    ``draft_tokens``, ``accepted_tokens``, ``acceptance_rate`` (percent of draft tokens
    accepted), ``acceptance_length`` (1 + accepted / drafts: the mean tokens a speculating
    request gains per step) and ``per_position_acceptance_rates`` (fractions, one per draft
    position); None when no draft was verified (or the server does not count them)."""
    drafts = _delta(before, after, "spec_decode_num_drafts")
    tokens = _delta(before, after, "spec_decode_draft_tokens")
    accepted = _delta(before, after, "spec_decode_accepted_tokens")
    if not drafts or not tokens or accepted is None:
        return None
    per_pos = []
    pos = 0
    while f"spec_decode_accepted_pos{pos}" in after:
        key = f"spec_decode_accepted_pos{pos}"
        per_pos.append((after[key] - (before.get(key) or 0.0)) / drafts)
        pos += 1
    return {
        "num_drafts": int(drafts),
        "draft_tokens": int(tokens),
        "accepted_tokens": int(accepted),
        "acceptance_rate": 100.0 * accepted / tokens,
        "acceptance_length": 1.0 + accepted / drafts,
        "per_position_acceptance_rates": per_pos,
    }
