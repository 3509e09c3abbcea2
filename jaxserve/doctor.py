"""``jaxserve doctor --base-url URL``: five pre-production checks against a live server.

A client of the server only (the ``bench serve`` client and ``/metrics`` scrape; metric names
under ``jaxserve:`` or ``vllm:``, so it works against vLLM too). Each check ends PASS, WARN or
FAIL with its evidence and the knob to turn:

1. load: a load test shaped like real traffic (a JSONL trace, or by default a mix of short
   and long requests under Poisson arrivals plus multi-turn conversations), checked against
   the SLOs (``--slo-ttft-p99``, ``--slo-tpot-p99``, seconds) and for failed requests;
2. dashboard: the signals a dashboard needs exist and read sensibly: P99 latency (TTFT
   histogram; its p99 estimate is set beside the client's), waiting-queue depth, KV usage,
   prefix-cache hits and queries;
3. preemptions: near 0 during the load test (PASS 0, WARN up to 1 per 100 requests, else FAIL);
4. prefix caching: hit rate on a multi-turn workload sharing one system prompt, against what
   whole-block sharing allows (FAIL at 0: caching off; WARN under half of it);
5. long prompt: one ``--long-prompt-len`` prompt sent while short requests decode: its TTFT
   against the TTFT SLO and the short requests' TPOT against the TPOT SLO (what
   ``long_prefill_token_threshold`` trades).

It talks while it runs (stderr, unless ``--no-progress``): two probe requests first (a short
and a long prompt, one after the other) measure TTFT and TPOT, from which it prints the plan and
an estimate of each phase's time; then each phase's start, a progress bar of finished
requests, and its time. The traffic flags' defaults suit a GPU server; ``--quick``
swaps in small ones sized for a CPU (13 s against the bundled model; benchmarks/RESULTS.md).

Exit code 0 when no check FAILs, 1 otherwise, 2 on bad flags or an unreachable server.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from jaxserve.bench.client import completion_payload, send_completion
from jaxserve.bench.metrics_scrape import MetricsPoller, fetch_snapshot, run_figures
from jaxserve.bench.stats import RequestResult, compute_metrics
from jaxserve.bench.workloads import BenchRequest, TokenSource
from jaxserve.tune.trace import Trace, TraceRequest, load_jsonl_trace, preset_trace

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
NAMESPACES = ("jaxserve", "vllm")
SIGNALS = {
    "p99 latency": ("time_to_first_token_seconds_bucket", "e2e_request_latency_seconds_bucket"),
    "waiting-queue depth": ("num_requests_waiting",),
    "KV usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prefix-cache hits": ("prefix_cache_hits_total",),
    "prefix-cache queries": ("prefix_cache_queries_total",),
}


@dataclasses.dataclass
class Check:
    """One check's outcome: ``status`` PASS / WARN / FAIL, ``evidence`` (figures), ``knob``
    (what to turn when it is not a PASS)."""

    name: str
    status: str
    evidence: dict[str, Any]
    knob: str = ""

    def line(self) -> str:
        """``[STATUS] name: evidence (knob)`` on one line."""
        ev = ", ".join(f"{k}={_fmt(v)}" for k, v in self.evidence.items())
        knob = f"\n         -> {self.knob}" if self.knob and self.status != PASS else ""
        return f"[{self.status}] {self.name}: {ev}{knob}"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ---- the server ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Server:
    """What the doctor knows of the server: URL, model, max_model_len, metric namespace."""

    base_url: str
    model: str
    max_model_len: int | None
    headers: dict[str, str]

    async def metrics_text(self, session: aiohttp.ClientSession) -> str | None:
        """The raw ``/metrics`` exposition, or None."""
        try:
            async with session.get(self.base_url + "/metrics", headers=self.headers) as r:
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None


def metric_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name without its namespace -> [(labels, value)] (names of any namespace)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name.split(":", 1)[-1], []).append((dict(s.labels), s.value))
    return out


def histogram_quantile(
    before: list[tuple[dict[str, str], float]], after: list[tuple[dict[str, str], float]], q: float
) -> float | None:
    """The q-quantile (0-1) of a histogram's observations between two scrapes (Prometheus'
    linear interpolation within the bucket), or None without observations."""

    def cumulative(samples):
        out: dict[float, float] = {}
        for labels, v in samples:
            le = float(labels.get("le", "nan"))
            out[le] = out.get(le, 0.0) + v
        return out

    b, a = cumulative(before), cumulative(after)
    bounds = sorted(a)
    counts = [a[le] - b.get(le, 0.0) for le in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in zip(bounds, counts):
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / max(c - prev_c, 1e-12))
        prev_le, prev_c = le, c
    return prev_le


# ---- sending a trace ----------------------------------------------------------------------------


async def run_trace(
    server: Server, trace: Trace, *, poll_s: float = 0.5, progress: str | None = None
) -> tuple[list[RequestResult], dict[str, Any], str | None, str | None, float]:
    """Sends a trace (arrival times, concurrency cap, follow-up turns after their predecessor
    plus think time) with the ``bench serve`` client.

    Args:
      server: the server.
      trace: the requests.
      poll_s: seconds between ``/metrics`` polls.
      progress: the label of a progress bar of finished requests on stderr (with the server's
        running and waiting requests from ``/metrics``); None: no bar.

    Returns:
      (results in trace order, ``run_figures`` of the run, /metrics text before, after,
      duration in seconds).
    """
    reqs = trace.requests
    done = [asyncio.Event() for _ in reqs]
    finished_at = [0.0] * len(reqs)
    cap = asyncio.Semaphore(trace.max_concurrency or len(reqs))
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        api = server.base_url + "/v1/completions"
        before_text = await server.metrics_text(session)
        before = await fetch_snapshot(session, server.base_url + "/metrics")
        poller = MetricsPoller(session, server.base_url + "/metrics", poll_s)
        t0 = time.perf_counter()
        poller.start()
        bar = tqdm(
            total=len(reqs), desc=progress, unit="req", file=sys.stderr, disable=progress is None
        )

        async def one(i: int, r: TraceRequest) -> RequestResult:
            if r.after is not None:
                await done[r.after].wait()
                at = max(r.arrival_s, finished_at[r.after] + r.think_s)
            else:
                at = r.arrival_s
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            bench = BenchRequest(r.prompt, len(r.prompt), r.output_len, r.kind)
            try:
                async with cap:
                    payload = completion_payload(server.model, bench)
                    return await send_completion(
                        session,
                        api,
                        payload,
                        bench,
                        headers=server.headers,
                        start_time=time.perf_counter() - t0,
                    )
            finally:
                finished_at[i] = time.perf_counter() - t0
                done[i].set()
                bar.update(1)

        async def server_state() -> None:  # the bar shows the server at work between finishes
            while True:
                await asyncio.sleep(1.0)
                if poller.samples:
                    snap = poller.samples[-1][1]
                    bar.set_postfix(running=snap.get("running"), waiting=snap.get("waiting"))

        state = asyncio.create_task(server_state()) if progress is not None else None
        try:
            results = await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
        finally:
            if state is not None:
                state.cancel()
            bar.close()
            await poller.stop()
        duration = time.perf_counter() - t0
        after = await fetch_snapshot(session, server.base_url + "/metrics")
        after_text = await server.metrics_text(session)
    figures = run_figures(before, after, poller.samples) if before is not None else {}
    return list(results), figures, before_text, after_text, duration


# ---- the five checks ----------------------------------------------------------------------------


def check_load(results, duration, slo_ttft, slo_tpot) -> tuple[Check, dict[str, Any]]:
    """Check 1 from the load test's client-side figures."""
    m = compute_metrics(results, max(duration, 1e-9), (50, 99))
    ev = {
        "requests": len(results),
        "failed": m["failed"],
        "output_tok_s": round(m["output_throughput"], 2),
        "ttft_p50_s": round(m["p50_ttft_ms"] / 1e3, 4),
        "ttft_p99_s": round(m["p99_ttft_ms"] / 1e3, 4),
        "tpot_p99_s": round(m["p99_tpot_ms"] / 1e3, 4),
    }
    status, knob = PASS, ""
    if m["failed"]:
        status = FAIL
        errors = sorted({r.error[:120] for r in results if not r.success})
        ev["first_error"] = errors[0]
        knob = "failed requests: check max_model_len, max_waiting_requests and the server log"
    elif slo_ttft is not None and ev["ttft_p99_s"] > slo_ttft:
        status = FAIL
        knob = (
            "TTFT p99 over the SLO: raise max_num_batched_tokens (more prefill per step) or "
            "lower max_num_seqs; `jaxserve tune` on this trace predicts each setting"
        )
    elif slo_tpot is not None and ev["tpot_p99_s"] > slo_tpot:
        status = FAIL
        knob = (
            "TPOT p99 over the SLO: lower long_prefill_token_threshold / max_num_batched_tokens "
            "(smaller steps) or max_num_seqs"
        )
    elif slo_ttft is None or slo_tpot is None:
        status = WARN
        knob = "no SLO given: pass --slo-ttft-p99 and --slo-tpot-p99 to judge the latencies"
    return Check("1 load test shaped like real traffic", status, ev, knob), m


def check_dashboard(before_text, after_text, client_ttft_p99_s, figures) -> Check:
    """Check 2: the dashboard's signals exist and read sensibly."""
    if after_text is None:
        return Check(
            "2 dashboard signals",
            FAIL,
            {"metrics": "GET /metrics failed"},
            "expose Prometheus /metrics (jaxserve and vLLM do by default)",
        )
    after = metric_samples(after_text)
    before = metric_samples(before_text or "")
    namespace = next((ns for ns in NAMESPACES if f"{ns}:" in after_text), "?")
    missing = [label for label, names in SIGNALS.items() if not any(n in after for n in names)]
    ev: dict[str, Any] = {"namespace": namespace}
    name = "time_to_first_token_seconds_bucket"
    if name in after:
        p99 = histogram_quantile(before.get(name, []), after[name], 0.99)
        ev["server_ttft_p99_s"] = None if p99 is None else round(p99, 4)
        ev["client_ttft_p99_s"] = round(client_ttft_p99_s, 4)
    ev["peak_waiting"] = figures.get("peak_waiting")
    ev["peak_kv_usage"] = figures.get("peak_kv_cache_usage")
    ev["hit_rate"] = figures.get("prefix_cache_hit_rate")
    if missing:
        ev["missing"] = missing
        return Check(
            "2 dashboard signals",
            FAIL,
            ev,
            "the server does not export " + ", ".join(missing) + "; upgrade it or add them",
        )
    p99 = ev.get("server_ttft_p99_s")
    if p99 is None or ev["peak_kv_usage"] is None:
        return Check(
            "2 dashboard signals",
            WARN,
            ev,
            "the signals exist but did not move during the load test; check the scrape",
        )
    return Check("2 dashboard signals", PASS, ev)


def check_preemptions(figures: dict[str, Any], num_requests: int) -> Check:
    """Check 3: preemptions during the load test."""
    n = figures.get("preemptions")
    ev = {
        "preemptions": n,
        "requests": num_requests,
        "peak_kv_usage": figures.get("peak_kv_cache_usage"),
    }
    knob = (
        "preemptions under normal traffic: lower max_num_batched_tokens / max_num_seqs, or give "
        "the KV cache more memory (gpu_memory_utilization, num_gpu_blocks_override)"
    )
    if n is None:
        return Check("3 preemptions near 0", WARN, ev, "no num_preemptions metric to read")
    if n == 0:
        return Check("3 preemptions near 0", PASS, ev)
    status = WARN if n <= max(1, num_requests // 100) else FAIL
    return Check("3 preemptions near 0", status, ev, knob)


def shareable_fraction(trace: Trace, block_size: int) -> float:
    """Prompt tokens that whole-block prefix caching can serve from earlier prompts of the
    trace (longest common prefix with any earlier prompt, in whole blocks, never the last
    token), over all prompt tokens."""
    seen: list[list[int]] = []
    shared = total = 0
    for r in trace.requests:
        p = r.prompt
        best = 0
        for q in seen:
            n = 0
            for a, b in zip(p, q):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        shared += min(best, len(p) - 1) // block_size * block_size
        total += len(p)
        seen.append(p)
    return shared / total if total else 0.0


def check_prefix_caching(figures, trace: Trace, block_size: int, enabled: str | None) -> Check:
    """Check 4: hit rate on the multi-turn workload vs what whole-block sharing allows."""
    rate = figures.get("prefix_cache_hit_rate")
    expected = shareable_fraction(trace, block_size)
    ev = {
        "hit_rate": None if rate is None else round(rate, 4),
        "shareable": round(expected, 4),
        "queries": figures.get("prefix_cache_queries"),
        "enable_prefix_caching": enabled,
    }
    knob = "turn on --enable-prefix-caching"
    if not figures.get("prefix_cache_queries") or not rate:
        return Check("4 prefix caching on, hit rate measured", FAIL, ev, knob)
    if rate < 0.5 * expected:
        return Check(
            "4 prefix caching on, hit rate measured",
            WARN,
            ev,
            "hit rate under half of what the workload shares: the KV pool may evict shared "
            "blocks (raise gpu_memory_utilization / num_gpu_blocks_override), or prompts differ "
            "early (put shared text first)",
        )
    return Check("4 prefix caching on, hit rate measured", PASS, ev)


def check_long_prompt(results: Sequence[RequestResult], slo_ttft, slo_tpot) -> Check:
    """Check 5: the long prompt's TTFT and the concurrent short requests' TPOT."""
    long = [r for r in results if r.kind == "long"]
    short = [r for r in results if r.kind == "short" and r.success and r.tpot is not None]
    ev: dict[str, Any] = {}
    if not long or not long[0].success:
        ev["error"] = long[0].error[:120] if long else "no long request"
        return Check(
            "5 long-prompt TTFT",
            FAIL,
            ev,
            "the long prompt failed: is --long-prompt-len within max_model_len?",
        )
    ev["long_prompt_tokens"] = long[0].prompt_len
    ev["long_ttft_s"] = round(long[0].ttft, 4)
    tpot_max = max((r.tpot for r in short), default=None)
    ev["short_tpot_max_s"] = None if tpot_max is None else round(tpot_max, 4)
    if slo_ttft is not None and long[0].ttft > slo_ttft:
        return Check(
            "5 long-prompt TTFT",
            FAIL,
            ev,
            "long-prompt TTFT over the SLO: raise long_prefill_token_threshold and "
            "max_num_batched_tokens (bigger prefill chunks)",
        )
    if slo_tpot is not None and tpot_max is not None and tpot_max > slo_tpot:
        return Check(
            "5 long-prompt TTFT",
            WARN,
            ev,
            "short requests stall while the long prompt prefills: lower "
            "long_prefill_token_threshold (smaller chunks share steps with decodes)",
        )
    if slo_ttft is None:
        return Check("5 long-prompt TTFT", WARN, ev, "no --slo-ttft-p99 to judge it against")
    return Check("5 long-prompt TTFT", PASS, ev)


# ---- the command --------------------------------------------------------------------------------


def long_prompt_trace(
    source: TokenSource, long_len: int, short_len: int, out_len: int, n_short: int, seed: int
) -> Trace:
    """``n_short`` short requests at t=0 and one long prompt right after (t=0.2 s)."""
    rng = np.random.default_rng([seed, 5])
    reqs = [
        TraceRequest(0.0, source.sample_ids(rng, short_len), out_len, kind="short")
        for _ in range(n_short)
    ]
    reqs.append(TraceRequest(0.2, source.sample_ids(rng, long_len), 4, kind="long"))
    return Trace(reqs, None, "long prompt")


def combine(traces: Sequence[Trace], name: str) -> Trace:
    """One trace of several (follow-up indices shifted; no concurrency cap)."""
    reqs: list[TraceRequest] = []
    for t in traces:
        off = len(reqs)
        for r in t.requests:
            after = None if r.after is None else r.after + off
            reqs.append(dataclasses.replace(r, after=after))
    return Trace(reqs, None, name)


async def _server(base_url: str, api_key: str | None) -> Server:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = base_url.rstrip("/")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.get(base + "/v1/models", headers=headers) as r:
                if r.status != 200:
                    raise ValueError(f"base_url: GET /v1/models answered {r.status}")
                data = (await r.json()).get("data") or []
    except aiohttp.ClientError as exc:
        raise ValueError(f"base_url: cannot reach {base}: {exc}") from None
    if not data:
        raise ValueError("base_url: the server lists no model")
    return Server(base, data[0]["id"], data[0].get("max_model_len"), headers)


def _cache_info(text: str | None) -> tuple[int, str | None]:
    """(block_size, enable_prefix_caching label) from ``cache_config_info`` (16, None if absent)."""
    if not text:
        return 16, None
    for labels, _ in metric_samples(text).get("cache_config_info", []):
        return int(labels.get("block_size", 16)), labels.get("enable_prefix_caching")
    return 16, None


# ---- the plan and its time ---------------------------------------------------------------------

# Traffic flag -> (default, --quick value, help). The defaults size a GPU server's check-up; the
# --quick values a CPU's (13 s against the bundled model on a shared 2-core box).
TRAFFIC: dict[str, tuple[Any, Any, str]] = {
    "num_prompts": (60, 8, "load-test requests besides the conversations"),
    "input_len": (128, 32, "prompt tokens of a short request and of each turn"),
    "output_len": (64, 16, "output tokens of a short request and of each turn"),
    "long_input_len": (2048, 256, "prompt tokens of a long request (cut to max_model_len)"),
    "long_output_len": (64, 16, "output tokens of a long request"),
    "long_fraction": (0.1, 0.25, "share of long requests in the load test"),
    "request_rate": (4.0, 8.0, "requests/s (Poisson arrivals) and conversation starts/s"),
    "num_conversations": (8, 3, "multi-turn conversations (load test, and check 4's own)"),
    "turns": (3, 2, "turns per conversation (fewer when they would pass max_model_len)"),
    "system_len": (256, 64, "shared system prompt tokens of the conversations"),
}


def resolve_traffic(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of the parsed ``doctor`` flags with each traffic flag left out set to its
    default, or to its ``--quick`` value with ``--quick``."""
    out = argparse.Namespace(**vars(args))
    quick = bool(getattr(args, "quick", False))
    for name, (default, quick_value, _) in TRAFFIC.items():
        if getattr(out, name, None) is None:
            setattr(out, name, quick_value if quick else default)
    return out


@dataclasses.dataclass(frozen=True)
class Speed:
    """The server's speed, from probe requests: a request's TTFT is about ``ttft_s +
    prefill_s_per_token x prompt tokens``, and each later token takes ``tpot_s`` (seconds)."""

    ttft_s: float
    prefill_s_per_token: float
    tpot_s: float

    def latency(self, prompt_len: int, output_len: int) -> float:
        """Seconds one request of these sizes takes alone."""
        ttft = self.ttft_s + self.prefill_s_per_token * prompt_len
        return ttft + max(output_len - 1, 0) * self.tpot_s


def speed_from_probes(short: RequestResult, long: RequestResult) -> Speed:
    """The line through the two probes' TTFTs (by prompt length) and the short one's TPOT.

    Raises:
      ValueError: a probe failed (its error).
    """
    for r in (short, long):
        if not r.success:
            raise ValueError(r.error)
    per_token = 0.0
    if long.prompt_len > short.prompt_len:
        per_token = max(0.0, (long.ttft - short.ttft) / (long.prompt_len - short.prompt_len))
    fixed = max(0.0, short.ttft - per_token * short.prompt_len)
    tpot = float(np.mean(short.itl)) if short.itl else 0.0
    return Speed(fixed, per_token, tpot)


def estimate_trace_s(trace: Trace, speed: Speed) -> float:
    """Seconds a trace should take on a server of ``speed``.

    Each request is sent at its arrival (a follow-up turn after its predecessor's answer plus
    its think time) and takes its probed latency, as if alone; the estimate is the last finish,
    or, when more than that, the work itself: every prompt token's prefill (compute that
    batching does not hide) plus every output token's TPOT shared among the requests in flight
    on average (measured TPOT x planned tokens / concurrency). A concurrency cap stretches it
    to at least the sum of latencies over the cap. Prefix-cache hits and a TPOT that grows with
    the batch are not modelled.
    """
    reqs = trace.requests
    if not reqs:
        return 0.0
    finish: list[float] = []
    latencies: list[float] = []
    for r in reqs:  # a follow-up turn comes after its predecessor in the list
        start = r.arrival_s
        if r.after is not None:
            start = max(start, finish[r.after] + r.think_s)
        latencies.append(speed.latency(len(r.prompt), r.output_len))
        finish.append(start + latencies[-1])
    makespan = max(finish)
    if trace.max_concurrency:
        makespan = max(makespan, sum(latencies) / trace.max_concurrency)
    in_flight = max(1.0, sum(latencies) / makespan)
    work = sum(len(r.prompt) for r in reqs) * speed.prefill_s_per_token
    work += sum(r.output_len for r in reqs) * speed.tpot_s / in_flight
    return max(makespan, work)


async def probe_speed(server: Server, source: TokenSource, args: argparse.Namespace) -> Speed:
    """Two requests, one after the other: ``input_len`` prompt tokens with up to 16 output
    tokens (TTFT, TPOT), then a ``long_input_len`` prompt (cut to max_model_len) with 1.

    Raises:
      ValueError: a probe request failed.
    """
    rng = np.random.default_rng([args.seed, 9])
    limit = server.max_model_len or 10**9
    short_len = min(args.input_len, limit - 17)
    long_len = min(max(args.long_input_len, short_len), limit - 2)
    probes = [
        TraceRequest(0.0, source.sample_ids(rng, short_len), min(max(args.output_len, 2), 16)),
        TraceRequest(0.0, source.sample_ids(rng, long_len), 1),
    ]
    results = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        for r in probes:
            bench = BenchRequest(r.prompt, len(r.prompt), r.output_len, "probe")
            results.append(
                await send_completion(
                    session,
                    server.base_url + "/v1/completions",
                    completion_payload(server.model, bench),
                    bench,
                    headers=server.headers,
                )
            )
    return speed_from_probes(*results)


def _say(text: str) -> None:
    print(f"doctor: {text}", file=sys.stderr, flush=True)


def _quiet(text: str) -> None:
    pass


def plan(args: argparse.Namespace, source: TokenSource, limit: int) -> list[tuple[str, Trace]]:
    """The three phases' (label, trace): the load test (checks 1-3), the multi-turn workload
    (check 4) and the long prompt among short requests (check 5). ``args``: resolved flags."""
    long_in = min(args.long_input_len, limit - args.long_output_len - 1)
    if args.trace:
        load = load_jsonl_trace(args.trace, source, args.seed)
    else:
        mixed = preset_trace(
            "mixed",
            source,
            args.seed,
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            long_input_len=long_in,
            long_output_len=args.long_output_len,
            long_fraction=args.long_fraction,
            request_rate=args.request_rate,
        )
        conv = _conversations(args, source, limit, args.seed + 1)
        load = combine([mixed, conv], "mixed + multi-turn")
    conv = _conversations(args, source, limit, args.seed + 2)
    long_len = min(args.long_prompt_len or long_in, limit - 5)
    probe = long_prompt_trace(source, long_len, args.input_len, args.output_len, 4, args.seed + 3)
    return [
        ("load test (checks 1-3)", load),
        ("multi-turn prefix caching (check 4)", conv),
        ("long prompt (check 5)", probe),
    ]


async def diagnose(args: argparse.Namespace, source: TokenSource) -> list[Check]:
    """Runs the five checks (load test first; then multi-turn; then the long prompt), saying
    on stderr what it does and how long it should take unless ``args.progress`` is False."""
    args = resolve_traffic(args)
    progress = getattr(args, "progress", True)
    say = _say if progress else _quiet
    t_start = time.perf_counter()
    server = await _server(args.base_url, args.api_key)
    limit = server.max_model_len or 10**9
    say(f"{server.model} at {server.base_url} (max_model_len {server.max_model_len})")
    phases = plan(args, source, limit)
    estimates: list[float | None] = [None] * len(phases)
    if progress:
        say("probing the server's speed (a short and a long prompt)")
        try:
            speed = await probe_speed(server, source, args)
        except ValueError as exc:
            say(f"a probe request failed ({exc}); no time estimate")
        else:
            estimates = [estimate_trace_s(trace, speed) for _, trace in phases]
            total = sum(estimates)
            say(
                f"probe: TTFT {speed.ttft_s:.3f} s + {speed.prefill_s_per_token * 1e3:.3f} ms per "
                f"prompt token, TPOT {speed.tpot_s:.4f} s; estimated run time about "
                f"{_duration(total)}"
                + (
                    " (--quick: a smaller run sized for CPUs)"
                    if total > 60 and not args.quick
                    else ""
                )
            )
    runs = []
    for i, (label, trace) in enumerate(phases, 1):
        est = estimates[i - 1]
        about = f", about {_duration(est)}" if est is not None else ""
        say(f"[{i}/{len(phases)}] {label}: {len(trace.requests)} requests{about}")
        t = time.perf_counter()
        runs.append(await run_trace(server, trace, progress=label if progress else None))
        say(f"[{i}/{len(phases)}] {label}: done in {time.perf_counter() - t:.1f} s")
    (results, figures, before_text, after_text, duration), conv_run, long_run = runs
    c1, m = check_load(results, duration, args.slo_ttft_p99, args.slo_tpot_p99)
    c2 = check_dashboard(before_text, after_text, m["p99_ttft_ms"] / 1e3, figures)
    c3 = check_preemptions(figures, len(results))
    block_size, enabled = _cache_info(after_text)
    c4 = check_prefix_caching(conv_run[1], phases[1][1], block_size, enabled)
    c5 = check_long_prompt(long_run[0], args.slo_ttft_p99, args.slo_tpot_p99)
    total_est = f" (estimated {_duration(sum(estimates))})" if None not in estimates else ""
    say(f"finished in {_duration(time.perf_counter() - t_start)}{total_est}")
    return [c1, c2, c3, c4, c5]


def _duration(seconds: float) -> str:
    """``42 s`` or ``7.3 min``."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _conversations(args, source, limit: int, seed: int) -> Trace:
    turns = args.turns
    while turns > 1 and args.system_len + turns * (args.input_len + args.output_len) >= limit:
        turns -= 1
    return preset_trace(
        "multi-turn",
        source,
        seed,
        num_conversations=args.num_conversations,
        turns=turns,
        system_len=args.system_len,
        input_len=args.input_len,
        output_len=args.output_len,
        request_rate=args.request_rate,
    )


def add_doctor_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``doctor`` with its traffic, SLO and output flags (``--help`` shows each default,
    and each traffic flag's ``--quick`` value)."""
    p = subparsers.add_parser(
        "doctor",
        help="run the five pre-production checks against a live server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root URL (default: %(default)s)",
    )
    p.add_argument(
        "--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: none)"
    )
    p.add_argument(
        "--trace",
        default=None,
        help="JSONL trace of the real traffic for check 1 (default: the traffic flags below)",
    )
    p.add_argument(
        "--slo-ttft-p99",
        type=float,
        default=None,
        help="TTFT SLO, seconds (default: none, and checks 1 and 5 WARN)",
    )
    p.add_argument(
        "--slo-tpot-p99",
        type=float,
        default=None,
        help="TPOT SLO, seconds (default: none, and check 1 WARNs)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the time estimate (two probe requests first), phases and a progress bar of "
        "finished requests on stderr (default: on)",
    )
    g = p.add_argument_group(
        "traffic (when no --trace)", "--quick: small traffic sized for a CPU server"
    )
    g.add_argument(
        "--quick",
        action="store_true",
        help="each traffic flag left out takes its --quick value (shown below) instead of its "
        "default (default: off)",
    )
    for name, (default, quick, text) in TRAFFIC.items():
        g.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=None,
            help=f"{text} (default: {default}; --quick: {quick})",
        )
    g.add_argument(
        "--long-prompt-len",
        type=int,
        default=None,
        help="check 5's prompt, tokens (default: --long-input-len)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="seed of the prompts and arrival times (default: 0)"
    )
    p.set_defaults(func=run_doctor)
    return p


def run_checks(args: argparse.Namespace) -> list[Check]:
    """``diagnose`` from synchronous code (in a running event loop, e.g. a notebook, on a fresh
    loop in a worker thread). ``args``: the parsed ``doctor`` flags."""
    from jaxserve.tune.grid import token_source

    coro = diagnose(args, token_source())
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def run_doctor(args: argparse.Namespace) -> int:
    """The ``doctor`` command: prints the checks (or JSON); 0 if none FAILs, else 1."""
    checks = run_checks(args)
    worst = FAIL if any(c.status == FAIL for c in checks) else PASS
    if args.json:
        print(
            json.dumps(
                {
                    "base_url": args.base_url,
                    "result": worst,
                    "checks": [dataclasses.asdict(c) for c in checks],
                },
                indent=1,
            )
        )
    else:
        for c in checks:
            print(c.line())
        print(f"doctor: {'some checks FAIL' if worst == FAIL else 'no check fails'}")
    sys.stdout.flush()
    return 1 if worst == FAIL else 0
