"""Replays a trace through the real ``Scheduler`` and ``KVCacheManager`` on a virtual clock.

No scheduling logic lives here: each simulated step calls ``Scheduler.schedule()``, asks the
step-time model how long the engine would take for that ``SchedulerOutput`` (its padded
shapes, requests and context), advances the clock by it, and hands ``update_from_output`` one
sampled token per request whose ledger reached its length (never EOS: the trace's output
lengths are exact, as with ``ignore_eos``). Requests enter ``add_request`` when the clock
passes their send time (their arrival, a free concurrency slot (``max_concurrency``) and, for
a follow-up turn, its predecessor's finish plus think time) plus the model's
``request_latency_s`` (the client-to-engine hand-over a served calibration measured).

Per request it records send time, first-token time and every token time, and per step the
waiting depth, KV usage and preemptions, from which ``SimResult`` gives what ``jaxserve bench
serve`` reports (throughput, TTFT / TPOT / ITL percentiles) plus the scheduler's view (peak
waiting, preemptions, peak KV usage, prefix-cache hit rate).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

import numpy as np

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.request import Request
from jaxserve.core.runner_output import ModelRunnerOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams
from jaxserve.tune.step_model import Shapes, StepTimeModel
from jaxserve.tune.trace import Trace

SAMPLED_TOKEN = 1  # any non-EOS id: the replay never stops early


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of the tuning grid (vLLM's knob names).

    Attributes:
      max_num_batched_tokens, max_num_seqs, long_prefill_token_threshold: scheduler knobs.
      num_gpu_blocks: KV pool size in blocks, the null block included.
      enable_prefix_caching: prefix caching on or off.
      block_size: tokens per KV block.
      max_model_len: longest prompt + output.
      token_buckets: the runner's padded step sizes (empty: its default for the budget).
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    long_prefill_token_threshold: int
    num_gpu_blocks: int
    enable_prefix_caching: bool = True
    block_size: int = 16
    max_model_len: int = 2048
    token_buckets: tuple[int, ...] = ()

    def knobs(self) -> dict[str, Any]:
        """The tunable knobs as a dict (flag names with underscores)."""
        return {
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "long_prefill_token_threshold": self.long_prefill_token_threshold,
            "num_gpu_blocks_override": self.num_gpu_blocks,
            "enable_prefix_caching": self.enable_prefix_caching,
        }

    def scheduler(self) -> Scheduler:
        """A fresh real scheduler (and KV-cache manager) with these knobs.

        Raises:
          ValueError: a knob out of range (named by the config classes).
        """
        sched_cfg = SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_model_len=self.max_model_len,
        )
        cache_cfg = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks,
        )
        return Scheduler(sched_cfg, cache_cfg, num_gpu_blocks=self.num_gpu_blocks)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


@dataclasses.dataclass
class SimResult:
    """Predicted figures of one setting (seconds; throughput per second of the whole run).

    ``rejected`` counts requests the scheduler refused (longer than the KV pool or
    max_model_len); they are left out of every other figure.
    """

    setting: Setting
    duration_s: float
    num_requests: int
    rejected: int
    output_tokens: int
    ttft_s: list[float]
    tpot_s: list[float]
    itl_s: list[float]
    peak_waiting: int
    peak_running: int
    preemptions: int
    peak_kv_usage: float
    prefix_hit_rate: float | None
    num_steps: int

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures (latencies in ms)."""

        def ms(values: list[float], q: float) -> float | None:
            v = _pct(values, q)
            return None if v is None else round(v * 1e3, 3)

        d = self.duration_s
        return {
            **self.setting.knobs(),
            "requests": self.num_requests,
            "rejected": self.rejected,
            "request_throughput": round(self.num_requests / d, 4) if d > 0 else None,
            "output_throughput": round(self.output_tokens / d, 3) if d > 0 else None,
            "ttft_ms_p50": ms(self.ttft_s, 50),
            "ttft_ms_p99": ms(self.ttft_s, 99),
            "tpot_ms_p50": ms(self.tpot_s, 50),
            "tpot_ms_p99": ms(self.tpot_s, 99),
            "itl_ms_p50": ms(self.itl_s, 50),
            "itl_ms_p99": ms(self.itl_s, 99),
            "peak_waiting": self.peak_waiting,
            "peak_running": self.peak_running,
            "preemptions": self.preemptions,
            "peak_kv_usage": round(self.peak_kv_usage, 4),
            "prefix_hit_rate": None
            if self.prefix_hit_rate is None
            else round(self.prefix_hit_rate, 4),
            "duration_s": round(d, 3),
            "steps": self.num_steps,
        }


def _next_event(ready: list, arriving: list, slot_free: bool) -> float | None:
    """The next time something can enter the engine: a send (if a slot is free) or a hand-over."""
    times = [arriving[0][0]] if arriving else []
    if ready and slot_free:
        times.append(ready[0][0])
    return min(times) if times else None


def simulate(
    trace: Trace, setting: Setting, model: StepTimeModel, *, max_steps: int = 2_000_000
) -> SimResult:
    """Replays ``trace`` under ``setting`` with step times from ``model``.

    Raises:
      RuntimeError: the replay made no progress for ``max_steps`` steps (a scheduler bug).
    """
    sched = setting.scheduler()
    shapes = Shapes(setting.max_num_batched_tokens, setting.max_num_seqs, setting.token_buckets)
    reqs = trace.requests
    n = len(reqs)
    followers: dict[int, list[int]] = {}
    ready: list[tuple[float, int]] = []  # (send time, index): requests whose predecessors are done
    for i, r in enumerate(reqs):
        if r.after is None:
            ready.append((r.arrival_s, i))
        else:
            followers.setdefault(r.after, []).append(i)
    heapq.heapify(ready)
    arriving: list[tuple[float, int]] = []  # (time it reaches the engine, index): sent
    latency = model.request_latency_s
    limit = trace.max_concurrency or n
    in_flight = 0
    by_id: dict[str, int] = {}
    sent = [0.0] * n
    first = [None] * n
    last = [0.0] * n
    ntok = [0] * n
    itl: list[float] = []
    done = rejected = 0
    clock = 0.0
    peak_waiting = peak_running = preemptions = steps = 0
    peak_kv = 0.0
    kv = sched.kv_cache_manager

    def finish(i: int, now: float) -> None:
        nonlocal in_flight, done
        in_flight -= 1
        done += 1
        for j in followers.pop(i, ()):
            heapq.heappush(ready, (max(reqs[j].arrival_s, now + reqs[j].think_s), j))

    while done < n:
        while ready and ready[0][0] <= clock and in_flight < limit:
            _, i = heapq.heappop(ready)
            in_flight += 1
            sent[i] = clock
            heapq.heappush(arriving, (clock + latency, i))
        while arriving and arriving[0][0] <= clock:
            _, i = heapq.heappop(arriving)
            r = reqs[i]
            rid = f"t{i}"
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
            try:
                sched.add_request(Request(rid, r.prompt, params, arrival_time=clock))
            except ValueError:
                rejected += 1
                finish(i, clock)
                continue
            by_id[rid] = i
        if not sched.has_unfinished_requests():
            nxt = _next_event(ready, arriving, in_flight < limit)
            if nxt is None:
                if done < n:
                    raise RuntimeError("replay stalled: requests wait for unfinished ones")
                break
            clock = max(clock, nxt)
            continue
        out = sched.schedule()
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"replay made no progress in {max_steps} steps")
        num_tokens = out.total_num_scheduled_tokens
        preemptions += len(out.preempted_req_ids)
        running, waiting = sched.get_request_counts()
        peak_waiting = max(peak_waiting, waiting)
        peak_running = max(peak_running, running)
        peak_kv = max(peak_kv, kv.usage)
        if num_tokens == 0:
            # Nothing fits now (e.g. every request waits on KV): wait for the next arrival.
            nxt = _next_event(ready, arriving, in_flight < limit)
            if nxt is not None:
                clock = max(clock, nxt)
                continue
            raise RuntimeError(
                "replay stalled: the scheduler scheduled nothing and nothing arrives"
            )
        requests = sched.requests
        ctx = 0
        sampled = []
        ids = list(out.num_scheduled_tokens)
        for rid in ids:
            req = requests[rid]
            ctx += req.num_computed_tokens
            sampled.append([SAMPLED_TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        tb, sb = shapes.of(num_tokens)
        clock += model.predict(tb, sb, len(ids), ctx)
        result = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: k for k, r in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        for o in sched.update_from_output(out, result):
            i = by_id[o.req_id]
            if o.new_token_ids:
                if first[i] is None:
                    first[i] = clock
                else:
                    itl.append(clock - last[i])
                last[i] = clock
                ntok[i] += len(o.new_token_ids)
            if o.finish_reason is not None:
                finish(i, clock)
    stats = kv.make_stats().prefix_cache  # counted since the scheduler was built
    hits, queries = stats.hits, stats.queries
    served = [i for i in range(n) if first[i] is not None]
    ttft = [first[i] - sent[i] for i in served]
    tpot = [(last[i] - first[i]) / (ntok[i] - 1) for i in served if ntok[i] > 1]
    return SimResult(
        setting=setting,
        duration_s=clock,
        num_requests=len(served),
        rejected=rejected,
        output_tokens=sum(ntok),
        ttft_s=ttft,
        tpot_s=tpot,
        itl_s=itl,
        peak_waiting=peak_waiting,
        peak_running=peak_running,
        preemptions=preemptions,
        peak_kv_usage=peak_kv,
        prefix_hit_rate=hits / queries if queries else None,
        num_steps=steps,
    )
