"""``jaxserve bench``: load tests with vLLM's figures, and the helpers the notebooks use.

The installed side of benchmarking (``jaxserve bench serve`` / ``bench throughput`` run from any
directory); the repository's ``benchmarks/`` holds the development benchmarks (kernels, scheduler,
engine) and their recorded figures, and imports this package where it needs a workload or a client.

Modules (each imported on first use of one of its names below):

* ``workloads``: random, shared-prefix and mixed long/short prompt sets; the ``qa``,
  ``long-doc`` and ``mixed`` load-shape presets; Poisson arrivals.
* ``client``, ``serve``: ``jaxserve bench serve``, streamed completions against any
  OpenAI-compatible server (TTFT, TPOT, ITL, end-to-end latency, throughputs).
* ``metrics_scrape``: preemptions, peak waiting depth, peak KV usage and the prefix-cache hit
  rate of a run, from the server's ``/metrics``.
* ``stats``: the latency statistics (vLLM's definitions).
* ``throughput``: ``jaxserve bench throughput``, offline through ``LLM.generate``.
* ``timeline``: stepping an ``LLMEngine`` and recording scheduler / KV-cache state per step;
  engine variants with other scheduler knobs around one warmed-up runner.
* ``live_server``: serving an in-process engine over HTTP from a background thread.
* ``commands``: the ``bench serve`` / ``bench throughput`` parsers and what they run.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "BenchRequest": "workloads",
    "WorkloadSpec": "workloads",
    "TokenSource": "workloads",
    "make_requests": "workloads",
    "poisson_arrivals": "workloads",
    "PRESETS": "workloads",
    "ServeBenchConfig": "serve",
    "benchmark_serve": "serve",
    "run_serve_benchmark": "serve",
    "format_table": "serve",
    "RequestResult": "stats",
    "compute_metrics": "stats",
    "summarize": "stats",
    "run_throughput": "throughput",
    "format_throughput": "throughput",
    "run_timeline": "timeline",
    "engine_variant": "timeline",
    "Timeline": "timeline",
    "BackgroundServer": "live_server",
    "DEMO_ENGINE_ARGS": "demo_config",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
