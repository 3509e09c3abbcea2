"""Predicted vs measured: one trace replayed by the tuner and sent to a live server.

``measure`` sends a trace's requests with ``jaxserve bench serve``'s client (same prompts, same
Poisson send times for the trace's rate and seed, same concurrency cap) and returns its result;
``compare`` puts the prediction beside it (output throughput and TTFT p50, with their ratios).
Follow-up turns (``TraceRequest.after``) are not expressible to ``bench serve``; such traces are
refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.benchmarks.workloads import BenchRequest
from jaxserve.tune.simulate import SimResult
from jaxserve.tune.trace import Trace


def bench_requests(trace: Trace) -> list[BenchRequest]:
    """The trace as ``bench serve`` requests (token-id prompts, exact output lengths).

    Raises:
      ValueError: the trace has follow-up turns.
    """
    if any(r.after is not None for r in trace.requests):
        raise ValueError("trace: follow-up turns cannot be replayed by bench serve")
    return [
        BenchRequest(list(r.prompt), len(r.prompt), r.output_len, r.kind) for r in trace.requests
    ]


def measure(trace: Trace, base_url: str, *, num_warmup: int = 1) -> dict[str, Any]:
    """Runs the trace against a live server with the ``bench serve`` client; returns its
    result dict (vLLM's field names: ``output_throughput``, ``median_ttft_ms``, ...)."""
    from jaxserve.benchmarks.serve import ServeBenchConfig, run_serve_benchmark

    config = ServeBenchConfig(
        base_url=base_url,
        request_rate=trace.request_rate,
        max_concurrency=trace.max_concurrency,
        num_warmup=num_warmup,
        seed=trace.seed,
        percentiles=(50, 99),
    )
    requests = bench_requests(trace)
    # Warm-up prompts share no block with the measured ones (reversed), so no hit is planted.
    warmup = [
        dataclasses.replace(r, prompt=r.prompt[::-1], output_len=2) for r in requests[:num_warmup]
    ]
    return run_serve_benchmark(config, requests, warmup)


def compare(name: str, predicted: SimResult, measured: dict[str, Any]) -> dict[str, Any]:
    """One row: predicted and measured output throughput (tok/s) and TTFT p50 (ms), and the
    relative error of each ((predicted - measured) / measured)."""
    p = predicted.summary()
    row = {
        "workload": name,
        "pred_output_throughput": p["output_throughput"],
        "meas_output_throughput": round(measured["output_throughput"], 3),
        "pred_ttft_ms_p50": p["ttft_ms_p50"],
        "meas_ttft_ms_p50": round(measured["median_ttft_ms"], 3),
        "pred_tpot_ms_p50": p["tpot_ms_p50"],
        "meas_tpot_ms_p50": round(measured["median_tpot_ms"], 3),
    }
    for key in ("output_throughput", "ttft_ms_p50", "tpot_ms_p50"):
        pred, meas = row[f"pred_{key}"], row[f"meas_{key}"]
        row[f"err_{key}"] = None if not meas or pred is None else round((pred - meas) / meas, 4)
    return row
