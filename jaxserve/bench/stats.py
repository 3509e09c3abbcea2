"""Latency statistics of a benchmark run, computed as vLLM's ``bench serve`` computes them.

Per request (client clock, seconds):

* TTFT: request sent -> first streamed chunk carrying a choice.
* ITL: every gap between consecutive chunks carrying a choice (one entry per gap; a chunk that
  carries several tokens is one gap).
* E2E latency: request sent -> last chunk carrying a choice.
* TPOT: ``(e2e - TTFT) / (output_tokens - 1)``, only for requests with more than one output
  token.

Across requests: mean, median, standard deviation and percentiles (``numpy.percentile``,
linear interpolation) in milliseconds, every ITL gap of every request pooled; throughputs over
the benchmark's wall time: completed requests/s, output tokens/s, (input + output) tokens/s.
Statistics of an empty list are 0, as in vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass
class RequestResult:
    """What one benchmark request measured.

    Attributes:
      success: the server answered 200 and the stream ended normally.
      prompt_len: prompt tokens (the server's usage when given, else the request's count).
      output_tokens: output tokens (the server's usage when given, else chunks carrying text).
      ttft: seconds to the first chunk carrying a choice.
      latency: seconds to the last chunk carrying a choice (end-to-end).
      itl: seconds between consecutive chunks carrying a choice.
      start_time: seconds from the benchmark start to sending the request.
      error: what went wrong, when not ``success``.
      kind: the BenchRequest's kind label.
    """

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    start_time: float = 0.0
    error: str = ""
    kind: str = ""

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first, or None with fewer than 2 output tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def summarize(values_s: Sequence[float], percentiles: Sequence[float] = (99,)) -> dict[str, float]:
    """``{"mean", "median", "std", "p<q>" ...}`` of ``values_s`` (seconds) in milliseconds.

    Percentile keys drop a trailing ``.0`` (``p99``, ``p99.9``). Empty input gives zeros.

    Raises:
      ValueError: a percentile outside [0, 100].
    """
    for q in percentiles:
        if not 0 <= q <= 100:
            raise ValueError(f"percentiles must be in [0, 100], got {q}")
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    empty = arr.size == 0
    out = {
        "mean": 0.0 if empty else float(arr.mean()),
        "median": 0.0 if empty else float(np.median(arr)),
        "std": 0.0 if empty else float(arr.std()),
    }
    for q in percentiles:
        out[percentile_key(q)] = 0.0 if empty else float(np.percentile(arr, q))
    return out


def percentile_key(q: float) -> str:
    """``p99`` for 99, ``p99.9`` for 99.9."""
    return f"p{float(q):g}"


METRICS = ("ttft", "tpot", "itl", "e2el")
"""The latency metrics, named as in vLLM's result JSON (``mean_ttft_ms``, ``p99_itl_ms``, ...)."""


def compute_metrics(
    results: Sequence[RequestResult], duration_s: float, percentiles: Sequence[float] = (99,)
) -> dict[str, Any]:
    """Throughputs and latency statistics of a run (vLLM ``bench serve``'s field names).

    Args:
      results: one per request sent (failed ones count only in ``failed``).
      duration_s: the run's wall time, first send to last response.
      percentiles: which percentiles to report.

    Returns:
      ``completed``, ``failed``, ``duration``, ``total_input_tokens``, ``total_output_tokens``,
      ``request_throughput`` (req/s), ``output_throughput`` and ``total_token_throughput``
      (tok/s), and for each of ttft, tpot, itl, e2el: ``mean_<m>_ms``, ``median_<m>_ms``,
      ``std_<m>_ms``, ``p<q>_<m>_ms``.

    Raises:
      ValueError: duration_s <= 0.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.success]
    series: dict[str, list[float]] = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    for name in METRICS:
        for stat, value in summarize(series[name], percentiles).items():
            out[f"{stat}_{name}_ms"] = value
    return out
