"""Step an ``LLMEngine`` directly and record what the scheduler and KV cache do, step by step.

For the notebooks and quick experiments: ``run_timeline(engine, requests)`` adds each request at
its arrival time (seconds from the start; default all at once), steps the engine until all are
done, and records after every step the engine's gauges (``LLMEngine.get_stats()``: running and
waiting requests, KV-cache usage) and counters (preemptions, scheduled tokens), and per request
the host time of every step that gave it tokens. Times are ``time.perf_counter()`` seconds from
the start of the run, so TTFT, TPOT, ITL and end-to-end latency mean what they mean in
``jaxserve.bench.stats`` (add -> first token, gaps between token-producing steps), without
HTTP in between.

``engine_variant(engine, **knobs)`` builds a new engine with other scheduler knobs (token
budget, max seqs, chunked-prefill threshold, prefix caching, a smaller KV pool) around the same
warmed-up model runner, so trying a knob costs no compile (the same idea as the engine tests'
shared runner).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from jaxserve.bench.stats import RequestResult, compute_metrics
from jaxserve.bench.workloads import BenchRequest

SCHEDULER_KNOBS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "long_prefill_token_threshold",
    "enable_chunked_prefill",
    "policy",
    "max_waiting_requests",
)
CACHE_KNOBS = ("enable_prefix_caching", "watermark")


@dataclasses.dataclass
class StepRecord:
    """The engine after one step.

    Attributes:
      t: seconds from the start of the run to the end of this step.
      num_running, num_waiting: requests running / waiting (preempted included) after it.
      kv_cache_usage: used KV blocks / usable blocks, in [0, 1].
      preemptions: preemptions since the start of the run (cumulative).
      num_scheduled_tokens: tokens this step computed (prefill chunks + decodes).
      num_finished: requests finished since the start of the run (cumulative).
    """

    t: float
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    preemptions: int
    num_scheduled_tokens: int
    num_finished: int


@dataclasses.dataclass
class RequestTimes:
    """One request's life, in seconds from the start of the run.

    Attributes:
      arrival: when it was added.
      token_times: end of each step that gave it output tokens.
      finished: when it finished, or None.
      prompt_len, output_tokens: token counts.
      kind: the BenchRequest's label.
    """

    arrival: float
    prompt_len: int
    kind: str = ""
    token_times: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    finished: float | None = None

    def as_result(self) -> RequestResult:
        """This request as a ``stats.RequestResult`` (ITL: gaps between its token-producing steps)."""
        if not self.token_times or self.finished is None:
            return RequestResult(prompt_len=self.prompt_len, kind=self.kind, error="did not finish")
        times = self.token_times
        return RequestResult(
            success=True,
            prompt_len=self.prompt_len,
            output_tokens=self.output_tokens,
            ttft=times[0] - self.arrival,
            latency=times[-1] - self.arrival,
            itl=[b - a for a, b in zip(times, times[1:])],
            start_time=self.arrival,
            kind=self.kind,
        )


@dataclasses.dataclass
class Timeline:
    """A recorded run: ``steps`` (one StepRecord per engine step) and ``requests`` (in input order)."""

    steps: list[StepRecord]
    requests: list[RequestTimes]
    duration: float

    def metrics(self, percentiles: Sequence[float] = (99,)) -> dict[str, Any]:
        """Throughputs and TTFT / TPOT / ITL / E2E statistics (``stats.compute_metrics``)."""
        return compute_metrics([r.as_result() for r in self.requests], self.duration, percentiles)

    def columns(self) -> dict[str, list[float]]:
        """The step records as columns (``{"t": [...], "num_running": [...], ...}``) for plotting."""
        return {
            f.name: [getattr(s, f.name) for s in self.steps] for f in dataclasses.fields(StepRecord)
        }


def run_timeline(
    engine: Any,
    requests: Sequence[BenchRequest],
    *,
    arrival_times: Sequence[float] | None = None,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    max_steps: int = 100_000,
) -> Timeline:
    """Runs ``requests`` through ``engine`` step by step and records the timeline.

    Args:
      engine: an idle ``LLMEngine`` (or a ``jaxserve.LLM``, whose engine is used).
      requests: what to run (``output_len`` is each request's ``max_tokens``).
      arrival_times: seconds from the start at which each request is added; None: all at 0.
      ignore_eos: every request produces exactly its ``output_len`` tokens.
      temperature: sampling temperature (0: greedy).
      max_steps: give up after this many steps.

    Raises:
      ValueError: the engine has unfinished requests, arrival_times has the wrong length, or
        the engine refused a request (e.g. larger than the KV pool; names the request).
      RuntimeError: not done after ``max_steps`` steps.
    """
    from jaxserve.sampling_params import SamplingParams

    engine = getattr(engine, "llm_engine", engine)
    if engine.has_unfinished_requests():
        raise ValueError("engine: it has unfinished requests; run_timeline needs an idle engine")
    arrivals = list(arrival_times) if arrival_times is not None else [0.0] * len(requests)
    if len(arrivals) != len(requests):
        raise ValueError(f"arrival_times: {len(arrivals)} times for {len(requests)} requests")
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    times: list[RequestTimes | None] = [None] * len(requests)
    base = engine.get_stats()
    steps: list[StepRecord] = []
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            i = order[nxt]
            req = requests[i]
            params = SamplingParams(
                max_tokens=req.output_len, ignore_eos=ignore_eos, temperature=temperature
            )
            try:
                engine.add_request(f"timeline-{i}", req.prompt, params)
            except ValueError as e:
                engine.abort_request(
                    [f"timeline-{j}" for j in range(len(requests)) if times[j] is not None]
                )
                raise ValueError(f"requests[{i}]: {e}") from e
            times[i] = RequestTimes(
                arrival=time.perf_counter() - t0, prompt_len=req.prompt_len, kind=req.kind
            )
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[order[nxt]] - (time.perf_counter() - t0)))
            continue
        if len(steps) >= max_steps:
            engine.abort_request(
                [f"timeline-{j}" for j in range(len(requests)) if times[j] is not None]
            )
            raise RuntimeError(f"max_steps: the run did not finish in {max_steps} steps")
        outputs = engine.step()
        t = time.perf_counter() - t0
        for out in outputs:
            rec = times[int(out.request_id.rsplit("-", 1)[1])]
            assert rec is not None
            if any(c.delta_token_ids for c in out.outputs):
                rec.token_times.append(t)
            rec.output_tokens = sum(len(c.token_ids) for c in out.outputs)
            if out.finished:
                rec.finished = t
        st = engine.get_stats()
        steps.append(
            StepRecord(
                t=t,
                num_running=st.num_running_reqs,
                num_waiting=st.num_waiting_reqs,
                kv_cache_usage=st.kv_cache_usage,
                preemptions=st.num_preemptions_total - base.num_preemptions_total,
                num_scheduled_tokens=st.num_scheduled_tokens,
                num_finished=st.num_finished_reqs_total - base.num_finished_reqs_total,
            )
        )
    return Timeline(
        steps=steps, requests=[r for r in times if r is not None], duration=time.perf_counter() - t0
    )


def engine_variant(engine: Any, *, num_gpu_blocks: int | None = None, **knobs: Any) -> Any:
    """A new ``LLMEngine`` with other scheduler / cache knobs around ``engine``'s warmed-up runner.

    The new engine starts with an empty scheduler and prefix cache; do not use the old one
    afterwards (both would drive the same runner).

    Args:
      engine: an idle ``LLMEngine`` or ``jaxserve.LLM``.
      num_gpu_blocks: KV blocks the new scheduler may use (at most the runner's pool; a small
        pool forces preemptions without reallocating or recompiling anything).
      **knobs: SchedulerConfig fields (``max_num_batched_tokens``, ``max_num_seqs``,
        ``long_prefill_token_threshold``, ``enable_chunked_prefill``, ``policy``,
        ``max_waiting_requests``) and CacheConfig fields (``enable_prefix_caching``,
        ``watermark``).

    Raises:
      ValueError: an unknown knob (named), a value out of range (named), the engine has
        unfinished requests, or a knob the runner was not compiled for: a token budget above
        its largest token bucket, more seqs than its ``max_num_seqs``, more blocks than its pool.
    """
    from jaxserve.engine.llm_engine import LLMEngine

    engine = getattr(engine, "llm_engine", engine)
    unknown = sorted(set(knobs) - set(SCHEDULER_KNOBS) - set(CACHE_KNOBS))
    if unknown:
        raise ValueError(
            f"unknown knob(s) {', '.join(unknown)}; allowed: num_gpu_blocks, "
            f"{', '.join(SCHEDULER_KNOBS + CACHE_KNOBS)}"
        )
    if engine.has_unfinished_requests():
        raise ValueError("engine: it has unfinished requests; finish or abort them first")
    runner = engine.runner
    config = engine.engine_config
    budget = knobs.get("max_num_batched_tokens", config.scheduler.max_num_batched_tokens)
    if budget > runner.token_buckets[-1]:
        raise ValueError(
            f"max_num_batched_tokens ({budget}) exceeds the runner's largest token bucket "
            f"({runner.token_buckets[-1]})"
        )
    seqs = knobs.get("max_num_seqs", config.scheduler.max_num_seqs)
    if seqs > runner.max_num_seqs:
        raise ValueError(
            f"max_num_seqs ({seqs}) exceeds the runner's max_num_seqs ({runner.max_num_seqs})"
        )
    cache = {k: v for k, v in knobs.items() if k in CACHE_KNOBS}
    if num_gpu_blocks is not None:
        pool = (
            runner.kv_spec.num_blocks if runner.kv_spec is not None else config.cache.num_gpu_blocks
        )
        if not 2 <= num_gpu_blocks <= pool:
            raise ValueError(
                f"num_gpu_blocks must be in [2, {pool}] (the runner's pool), got {num_gpu_blocks}"
            )
        cache["num_gpu_blocks"] = num_gpu_blocks
    config = dataclasses.replace(
        config,
        scheduler=dataclasses.replace(
            config.scheduler, **{k: v for k, v in knobs.items() if k in SCHEDULER_KNOBS}
        ),
        cache=dataclasses.replace(config.cache, **cache),
    )
    runner.reset_requests()
    return LLMEngine(config, runner, engine.arch, engine.tokenizer, engine.generation_config)
