"""``jaxserve bench serve``: load-test any OpenAI-compatible server with streamed completions.

What it measures and how follows vLLM's ``vllm bench serve`` (``benchmarks/serve.py``), so the
figures compare: request throughput, output and total token throughput, and mean / median / p99
of TTFT, TPOT, ITL and end-to-end latency (definitions in ``jaxserve.bench.stats``).

A run:

1. ``num_warmup`` requests of the same workload shape (different random prompts, so the measured
   prompts find nothing of theirs in the prefix cache) are sent and awaited; a failed warm-up
   stops the run (``RuntimeError``), as the server is evidently not usable.
2. ``/metrics`` is read (the baseline), and a poller reads it every ``metrics_interval_s``.
3. Request ``i`` is sent at its arrival time (a Poisson process of ``request_rate`` requests/s,
   or all at once for ``inf``), waiting for a free slot when ``max_concurrency`` requests are in
   flight. The run's duration is from its start to the last response.
4. ``/metrics`` is read again: preemptions, prefix-cache hit rate and the sampled peaks of
   waiting requests, running requests and KV-cache usage (``metrics_scrape``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from tqdm import tqdm

from jaxserve.bench.client import completion_payload, send_completion
from jaxserve.bench.metrics_scrape import MetricsPoller, fetch_snapshot, run_figures
from jaxserve.bench.stats import RequestResult, compute_metrics, percentile_key
from jaxserve.bench.workloads import BenchRequest, poisson_arrivals


@dataclasses.dataclass
class ServeBenchConfig:
    """How to drive the server.

    Attributes:
      base_url: server root, e.g. ``http://127.0.0.1:8000``.
      model: model name to send; None: the first model of ``GET /v1/models``.
      endpoint: the completions path.
      request_rate: Poisson arrival rate, requests/s; ``inf``: all at once.
      max_concurrency: most requests in flight; None: no cap.
      num_warmup: warm-up requests before the measured run.
      ignore_eos: send ``ignore_eos`` so every request produces exactly its output length.
      temperature: sampling temperature (0: greedy).
      percentiles: which latency percentiles to report.
      scrape_metrics: read ``/metrics`` before, during and after the run.
      metrics_interval_s: seconds between ``/metrics`` polls.
      api_key: sent as ``Authorization: Bearer``; None: no header.
      timeout_s: per-request total timeout.
      seed: seed of the arrival times.
      extra_body: more fields for every request body.
      progress: report the phases and a progress bar of finished requests on stderr.

    Raises:
      ValueError: a field out of range (names it).
    """

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str = "/v1/completions"
    request_rate: float = math.inf
    max_concurrency: int | None = None
    num_warmup: int = 1
    ignore_eos: bool = True
    temperature: float = 0.0
    percentiles: Sequence[float] = (99,)
    scrape_metrics: bool = True
    metrics_interval_s: float = 0.5
    api_key: str | None = None
    timeout_s: float = 6 * 3600
    seed: int = 0
    extra_body: dict[str, Any] | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(
                f"request_rate must be > 0 (inf: all at once), got {self.request_rate}"
            )
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup must be >= 0, got {self.num_warmup}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not self.metrics_interval_s > 0:
            raise ValueError(f"metrics_interval must be > 0, got {self.metrics_interval_s}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")


async def _first_model(
    session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]
) -> str:
    async with session.get(base_url + "/v1/models", headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"GET /v1/models answered {response.status}; pass --model")
        data = (await response.json()).get("data") or []
    if not data:
        raise RuntimeError("GET /v1/models lists no model; pass --model")
    return data[0]["id"]


async def benchmark_serve(
    config: ServeBenchConfig,
    requests: Sequence[BenchRequest],
    warmup_requests: Sequence[BenchRequest] = (),
) -> dict[str, Any]:
    """Runs the benchmark (see the module docstring) and returns its result.

    Args:
      config: how to drive the server.
      requests: the measured requests, sent in order.
      warmup_requests: the warm-up requests (``config.num_warmup`` of them are used, cycling).

    Returns:
      A JSON-able dict: the config, ``model``, ``compute_metrics``'s fields, ``server`` (the
      ``metrics_scrape.run_figures``, or None without ``/metrics``), and per request
      ``input_lens``, ``output_lens``, ``ttfts``, ``e2els``, ``itls`` (seconds), ``kinds``,
      ``start_times`` (seconds from the start) and ``errors`` ("" when it succeeded).

    Raises:
      ValueError: no requests.
      RuntimeError: the model could not be found, or a warm-up request failed.
    """
    if not requests:
        raise ValueError("num_prompts: the workload has no requests")
    base = config.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = config.model or await _first_model(session, base, headers)
        api_url = base + config.endpoint

        async def one(req: BenchRequest, start: float = 0.0) -> RequestResult:
            payload = completion_payload(
                model,
                req,
                ignore_eos=config.ignore_eos,
                temperature=config.temperature,
                extra_body=config.extra_body,
            )
            return await send_completion(
                session, api_url, payload, req, headers=headers, start_time=start
            )

        semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

        async def limited(req: BenchRequest, start: float = 0.0) -> RequestResult:
            if semaphore is None:
                return await one(req, start)
            async with semaphore:
                return await one(req, start)

        say = _stderr if config.progress else (lambda text: None)
        if config.num_warmup and warmup_requests:
            warm = [warmup_requests[i % len(warmup_requests)] for i in range(config.num_warmup)]
            say(f"bench serve: {model} at {base}: {len(warm)} warm-up request(s)")
            for res in await asyncio.gather(*(limited(r) for r in warm)):
                if not res.success:
                    raise RuntimeError(f"a warm-up request failed: {res.error}")

        metrics_url = base + "/metrics"
        before = await fetch_snapshot(session, metrics_url) if config.scrape_metrics else None
        poller = (
            MetricsPoller(session, metrics_url, config.metrics_interval_s)
            if before is not None
            else None
        )
        arrivals = poisson_arrivals(len(requests), config.request_rate, config.seed)
        t0 = time.perf_counter()
        if poller is not None:
            poller.start()

        say(f"bench serve: {len(requests)} measured requests")
        bar = tqdm(
            total=len(requests), desc="requests", unit="req", file=sys.stderr,
            disable=not config.progress,
        )  # fmt: skip

        async def scheduled(req: BenchRequest, at: float) -> RequestResult:
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                return await limited(req, time.perf_counter() - t0)
            finally:
                bar.update(1)

        try:
            results = await asyncio.gather(*(scheduled(r, a) for r, a in zip(requests, arrivals)))
        finally:
            bar.close()
            if poller is not None:
                await poller.stop()
        duration = time.perf_counter() - t0
        after = await fetch_snapshot(session, metrics_url) if before is not None else None

    out: dict[str, Any] = {
        "base_url": base,
        "endpoint": config.endpoint,
        "model": model,
        "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "max_concurrency": config.max_concurrency,
        "num_warmup": config.num_warmup,
        "ignore_eos": config.ignore_eos,
        "temperature": config.temperature,
        "percentiles": list(config.percentiles),
    }
    out.update(compute_metrics(results, duration, config.percentiles))
    out["server"] = run_figures(before, after, poller.samples) if poller is not None else None
    spec = None if out["server"] is None else out["server"]["spec_decode"]
    if spec is not None:  # vLLM's result keys
        out["spec_decode_acceptance_rate"] = spec["acceptance_rate"]
        out["spec_decode_acceptance_length"] = spec["acceptance_length"]
        out["spec_decode_num_drafts"] = spec["num_drafts"]
        out["spec_decode_draft_tokens"] = spec["draft_tokens"]
        out["spec_decode_accepted_tokens"] = spec["accepted_tokens"]
        out["spec_decode_per_position_acceptance_rates"] = spec["per_position_acceptance_rates"]
    out["input_lens"] = [r.prompt_len for r in results]
    out["output_lens"] = [r.output_tokens for r in results]
    out["ttfts"] = [r.ttft for r in results]
    out["e2els"] = [r.latency for r in results]
    out["itls"] = [r.itl for r in results]
    out["kinds"] = [r.kind for r in results]
    out["start_times"] = [r.start_time for r in results]
    out["errors"] = [r.error for r in results]
    return out


def run_serve_benchmark(
    config: ServeBenchConfig,
    requests: Sequence[BenchRequest],
    warmup_requests: Sequence[BenchRequest] = (),
) -> dict[str, Any]:
    """``benchmark_serve`` from synchronous code; inside a running event loop (a notebook) it
    runs on a fresh loop in a worker thread. Raises like ``benchmark_serve``."""
    coro = benchmark_serve(config, requests, warmup_requests)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- the table ---------------------------------------------------------------------------------


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value:<10}"


def _title(text: str, fill: str = "-") -> str:
    return "{s:{c}^{n}}".format(s=text, n=50, c=fill)


def format_table(result: dict[str, Any]) -> str:
    """The result as vLLM ``bench serve`` prints it, plus a server-metrics section."""
    lines = [
        _title(" Serving Benchmark Result ", "="),
        _row("Successful requests:", result["completed"]),
        _row("Failed requests:", result["failed"]),
        _row(
            "Request rate configured (RPS):",
            result["request_rate"]
            if isinstance(result["request_rate"], str)
            else float(result["request_rate"]),
        ),
        _row(
            "Maximum request concurrency:",
            "none" if result["max_concurrency"] is None else result["max_concurrency"],
        ),
        _row("Benchmark duration (s):", float(result["duration"])),
        _row("Total input tokens:", result["total_input_tokens"]),
        _row("Total generated tokens:", result["total_output_tokens"]),
        _row("Request throughput (req/s):", float(result["request_throughput"])),
        _row("Output token throughput (tok/s):", float(result["output_throughput"])),
        _row("Total token throughput (tok/s):", float(result["total_token_throughput"])),
    ]
    sections = (
        ("ttft", "Time to First Token", "TTFT"),
        ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl", "Inter-token Latency", "ITL"),
        ("e2el", "End-to-end Latency", "E2EL"),
    )
    for key, title, short in sections:
        lines.append(_title(title))
        lines.append(_row(f"Mean {short} (ms):", float(result[f"mean_{key}_ms"])))
        lines.append(_row(f"Median {short} (ms):", float(result[f"median_{key}_ms"])))
        for q in result["percentiles"]:
            pk = percentile_key(q)
            lines.append(_row(f"P{pk[1:]} {short} (ms):", float(result[f"{pk}_{key}_ms"])))
    server = result.get("server")
    lines.append(_title("Server metrics (/metrics)"))
    if server is None:
        lines.append("(not available)")
    else:

        def fmt(v: Any, scale: float = 1.0) -> Any:
            return "n/a" if v is None else float(v) * scale

        def count(v: Any) -> Any:
            return "n/a" if v is None else int(v)

        lines.append(_row("Preemptions:", count(server["preemptions"])))
        lines.append(_row("Peak waiting requests:", count(server["peak_waiting"])))
        lines.append(_row("Peak running requests:", count(server["peak_running"])))
        lines.append(_row("Peak KV-cache usage (%):", fmt(server["peak_kv_cache_usage"], 100.0)))
        lines.append(
            _row("Prefix-cache hit rate (%):", fmt(server["prefix_cache_hit_rate"], 100.0))
        )
        spec = server.get("spec_decode")
        if spec is not None:  # vLLM's section
            lines.append(_title("Speculative Decoding"))
            lines.append(_row("Acceptance rate (%):", float(spec["acceptance_rate"])))
            lines.append(_row("Acceptance length:", float(spec["acceptance_length"])))
            lines.append(_row("Drafts:", spec["num_drafts"]))
            lines.append(_row("Draft tokens:", spec["draft_tokens"]))
            lines.append(_row("Accepted tokens:", spec["accepted_tokens"]))
            if spec["per_position_acceptance_rates"]:
                lines.append("Per-position acceptance (%):")
                for i, rate in enumerate(spec["per_position_acceptance_rates"]):
                    lines.append(_row(f"  Position {i}:", 100.0 * rate))
    lines.append("=" * 50)
    return "\n".join(lines)
