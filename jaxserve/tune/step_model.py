"""How long one engine step takes, as a function of what the scheduler put in it.

A step's wall time (schedule + runner + output processing) is modelled as

    t = c_base + c_token * T + c_seq_bucket * S + c_seq * num_seqs + c_ctx * context_tokens

where ``T`` is the padded token bucket the runner compiles for (``pick_bucket`` over the
configured buckets), ``S`` its sequence bucket (``seq_bucket``), ``num_seqs`` the requests in
the step and ``context_tokens`` the K/V positions they read. The padded shapes carry the
device cost of the jitted step; ``num_seqs`` the host's per-request cost (batch building,
sampling metadata, scheduler update, detokenization); ``context_tokens`` the attention reads
of a kernel whose cost follows the context (the Pallas kernel; the CPU reference attends over
the whole padded table, so its fit puts ~0 there). Coefficients are non-negative least squares
over measured steps. A calibration at one ``max_num_seqs`` sees one sequence bucket per token
bucket (all equal once T >= max_num_seqs): the base cost absorbs it, so predictions for other
``max_num_seqs`` values miss the device cost of a bigger S (small next to the per-request host
cost on CPU; calibrate at the largest max_num_seqs of the grid to be safe).

Sources of measurements:

* ``calibrate_engine``: a short run of the real engine (runner included) on a synthetic mix
  that visits every token bucket and a range of batch sizes, timing each ``step()``;
* ``calibrate_served``: the same mix sent over HTTP to a server around an engine in this
  process (``BackgroundServer``), timing step start to step start while the engine stays
  busy, so the server's own cost (event loop, streaming, detokenization, the GIL) is in the
  model: what ``jaxserve bench serve`` will see;
* ``StepTimeModel.load`` of a JSON written by ``save`` (``jaxserve tune --calibration FILE``).

Times are seconds.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxserve.worker.batch_builder import pick_bucket, resolve_token_buckets, seq_bucket

FEATURES = ("base", "token_bucket", "seq_bucket", "num_seqs", "context_tokens")


@dataclasses.dataclass(frozen=True)
class StepSample:
    """One measured step: tokens scheduled, requests, context read, padded shapes, wall time."""

    num_tokens: int
    num_seqs: int
    context_tokens: int
    token_bucket: int
    seq_bucket: int
    seconds: float


def features(token_bucket: int, seq_bucket_: int, num_seqs: int, context_tokens: int) -> list:
    """The model's feature row (see FEATURES) for one step."""
    return [1.0, float(token_bucket), float(seq_bucket_), float(num_seqs), float(context_tokens)]


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (Lawson-Hanson, scipy's)."""
    from scipy.optimize import nnls  # scipy comes with jax

    coef, _ = nnls(a, b)
    return coef


@dataclasses.dataclass
class StepTimeModel:
    """Predicts a step's seconds (see the module docstring).

    Attributes:
      coef: one non-negative coefficient per FEATURES entry (seconds per unit).
      source: where the measurements came from (for reports).
      num_samples: steps the fit used.
      rel_error_p50: median |predicted - measured| / measured over those steps.
      request_latency_s: a request's time from the client's send to the engine's queue (HTTP,
        parsing, the hand-over to the engine thread); measured by ``calibrate_served`` as the
        median client TTFT minus the median engine TTFT; 0 for an offline engine.
    """

    coef: tuple[float, ...]
    source: str = ""
    num_samples: int = 0
    rel_error_p50: float = 0.0
    request_latency_s: float = 0.0

    @classmethod
    def fit(cls, samples: Sequence[StepSample], source: str = "") -> StepTimeModel:
        """Fits the coefficients to measured steps.

        Raises:
          ValueError: fewer than len(FEATURES) samples.
        """
        if len(samples) < len(FEATURES):
            raise ValueError(f"calibration: need >= {len(FEATURES)} steps, got {len(samples)}")
        # Steps of the same shape and batch size are one point: the median of their times (and
        # contexts), so the point is the typical step and not one another process slowed down
        # or one that ran on an idle machine (on a shared CPU both happen, 5-10x apart).
        groups: dict[tuple[int, int, int], list[StepSample]] = {}
        for s in samples:
            key = (s.token_bucket, s.seq_bucket, s.num_seqs)
            groups.setdefault(key, []).append(s)
        rows, times, counts = [], [], []
        for group in groups.values():
            rows.append(
                features(
                    group[0].token_bucket,
                    group[0].seq_bucket,
                    group[0].num_seqs,
                    int(np.median([s.context_tokens for s in group])),
                )
            )
            times.append(float(np.median([s.seconds for s in group])))
            counts.append(len(group))
        a, b = np.array(rows), np.array(times)
        # A feature that never varies (e.g. the sequence bucket, fixed by max_num_seqs, in a
        # calibration at one max_num_seqs) cannot be told from the base cost: the base takes it.
        a[:, 1:][:, np.ptp(a[:, 1:], axis=0) == 0] = 0.0
        # Absolute error (what adds up to a run's duration), points weighted by sqrt(steps).
        # A relative-error fit was tried: rare shapes caught on an idle moment (5-10x faster
        # than typical on a shared CPU) pulled every coefficient down (runs predicted ~2x short).
        w = np.sqrt(np.array(counts, dtype=float))
        coef = _nnls(a * w[:, None], b * w)
        every = np.array(
            [features(s.token_bucket, s.seq_bucket, s.num_seqs, s.context_tokens) for s in samples]
        )
        measured = np.array([s.seconds for s in samples])
        pred = every @ coef
        err = float(np.median(np.abs(pred - measured) / np.maximum(measured, 1e-9)))
        return cls(tuple(float(c) for c in coef), source, len(samples), err)

    def predict(self, token_bucket: int, seq_bucket_: int, num_seqs: int, ctx: int) -> float:
        """Seconds of one step with these shapes and contents."""
        c = self.coef
        return c[0] + c[1] * token_bucket + c[2] * seq_bucket_ + c[3] * num_seqs + c[4] * ctx

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``load`` reads it back)."""
        return {
            "features": list(FEATURES),
            "coef_s": list(self.coef),
            "source": self.source,
            "num_samples": self.num_samples,
            "rel_error_p50": self.rel_error_p50,
            "request_latency_s": self.request_latency_s,
        }

    def save(self, path: str) -> None:
        """Writes ``to_dict`` as JSON."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> StepTimeModel:
        """Reads a model written by ``save``.

        Raises:
          ValueError: not such a file (names the path and what is wrong).
        """
        try:
            with open(path) as f:
                data = json.load(f)
            coef = tuple(float(x) for x in data["coef_s"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"calibration: cannot read a step-time model from {path}: {exc}"
            ) from None
        if len(coef) != len(FEATURES) or any(c < 0 for c in coef):
            raise ValueError(f"calibration: {path} needs {len(FEATURES)} non-negative coef_s")
        return cls(
            coef,
            data.get("source", path),
            int(data.get("num_samples", 0)),
            float(data.get("rel_error_p50", 0.0)),
            max(0.0, float(data.get("request_latency_s", 0.0))),
        )


class Shapes:
    """The padded shapes a runner of this configuration compiles (one source: batch_builder).

    Args:
      max_num_batched_tokens, max_num_seqs: the scheduler's knobs.
      token_buckets: the runner's buckets (empty: ``resolve_token_buckets``' default ladder
        for the budget, from 16 tokens, that of the Pallas backends; ``jaxserve tune`` passes
        its target backend's own, ``backend_token_buckets``).
    """

    def __init__(
        self, max_num_batched_tokens: int, max_num_seqs: int, token_buckets: tuple[int, ...] = ()
    ) -> None:
        self.buckets = resolve_token_buckets(tuple(token_buckets), max_num_batched_tokens)
        self.max_num_seqs = max_num_seqs
        self._seq = {t: seq_bucket(t, max_num_seqs) for t in self.buckets}

    def of(self, num_tokens: int) -> tuple[int, int]:
        """(token bucket, sequence bucket) of a step of ``num_tokens`` tokens."""
        t = pick_bucket(self.buckets, num_tokens)
        return t, self._seq[t]


def calibration_prompts(
    token_buckets: Sequence[int], max_num_seqs: int, max_model_len: int, vocab: int, seed: int = 0
) -> list[list[tuple[list[int], int]]]:
    """Groups of (prompt ids, output tokens) whose steps visit every token bucket and batch
    sizes from 1 to max_num_seqs: a lone prompt of each bucket's size, then waves of 1, 2, 4,
    ... concurrent requests with long-ish outputs decoding together (one group each), then a
    few requests decoding over half-max_model_len contexts."""
    rng = np.random.default_rng(seed)
    groups: list[list[tuple[list[int], int]]] = []
    for t in token_buckets:
        n = max(1, min(t, max_model_len - 4))
        groups.append([(rng.integers(1, vocab, n).tolist(), 2)])
    n = 1
    while True:
        groups.append([(rng.integers(1, vocab, 24).tolist(), 24) for _ in range(n)])
        if n >= max_num_seqs:
            break
        n = min(2 * n, max_num_seqs)
    # Decodes over long contexts, so the context cost is told apart from the token cost.
    long = max(1, min(max_model_len // 2, max_model_len - 20))
    groups.append(
        [(rng.integers(1, vocab, long).tolist(), 16) for _ in range(min(4, max_num_seqs))]
    )
    return groups


def calibrate_engine(
    engine: Any, groups: Sequence[Sequence[tuple[list[int], int]]]
) -> list[StepSample]:
    """Runs groups of (prompt ids, output tokens) through an idle ``LLMEngine``, a group once
    the previous one finished, and times each step. Returns one StepSample per step."""
    from jaxserve.sampling_params import SamplingParams

    sched = engine.scheduler
    cfg = sched.scheduler_config
    shapes = Shapes(cfg.max_num_batched_tokens, cfg.max_num_seqs, engine.runner.token_buckets)
    runner = engine.runner
    real_execute = runner.dispatch  # every step goes through it, async scheduling or not
    seen: list[tuple[int, int, int]] = []

    def execute(out, *args, **kwargs):
        ctx = 0
        for rid, n in out.num_scheduled_tokens.items():
            ctx += sched.requests[rid].num_computed_tokens if rid in sched.requests else n
        seen.append((out.total_num_scheduled_tokens, len(out.num_scheduled_tokens), ctx))
        return real_execute(out, *args, **kwargs)

    samples: list[StepSample] = []
    runner.dispatch = execute
    try:
        k = 0
        for group in groups:
            for ids, n in group:
                params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)
                engine.add_request(f"calib-{k}", ids, params, final_only=True)
                k += 1
            while engine.has_unfinished_requests():
                seen.clear()
                t0 = time.perf_counter()
                engine.step()
                dt = time.perf_counter() - t0
                if seen and seen[0][0] > 0:
                    tokens, seqs, ctx = seen[0]
                    tb, sb = shapes.of(tokens)
                    samples.append(StepSample(tokens, seqs, ctx, tb, sb, dt))
    finally:
        runner.dispatch = real_execute
    return samples


class StepRecorder:
    """Records a StepSample per busy engine step while installed (``with StepRecorder(e):``).

    A step's seconds are from its start to the next step's start, counted only when the
    engine still had work after it (so the loop went straight on): the engine step plus
    everything the serving loop does between steps.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        cfg = engine.scheduler.scheduler_config
        self.shapes = Shapes(
            cfg.max_num_batched_tokens, cfg.max_num_seqs, engine.runner.token_buckets
        )
        self.samples: list[StepSample] = []
        self.engine_ttfts: list[float] = []  # first token - arrival at the engine, seconds
        self._pending: tuple[int, int, int, float] | None = None
        self._seen: list[tuple[int, int, int]] = []

    def __enter__(self) -> StepRecorder:
        engine, runner = self.engine, self.engine.runner
        self._step, self._execute = engine.step, runner.dispatch
        sched = engine.scheduler

        def execute(out, *args, **kwargs):
            ctx = 0
            for rid, n in out.num_scheduled_tokens.items():
                req = sched.requests.get(rid)
                ctx += req.num_computed_tokens if req is not None else n
            self._seen.append((out.total_num_scheduled_tokens, len(out.num_scheduled_tokens), ctx))
            return self._execute(out, *args, **kwargs)

        def step():
            now = time.perf_counter()
            if self._pending is not None:
                tokens, seqs, ctx, t0 = self._pending
                tb, sb = self.shapes.of(tokens)
                self.samples.append(StepSample(tokens, seqs, ctx, tb, sb, now - t0))
            self._pending = None
            self._seen.clear()
            outputs = self._step()
            for o in outputs:
                m = o.metrics
                if o.finished and m is not None and m.first_token_time is not None:
                    self.engine_ttfts.append(m.first_token_time - m.arrival_time)
            if self._seen and self._seen[0][0] > 0 and engine.has_unfinished_requests():
                self._pending = (*self._seen[0], now)
            return outputs

        engine.step, runner.dispatch = step, execute
        return self

    def __exit__(self, *exc: Any) -> None:
        self.engine.step, self.engine.runner.dispatch = self._step, self._execute


def calibrate_served(
    engine: Any,
    base_url: str,
    groups: Sequence[Sequence[tuple[list[int], int]]],
    samples_out: list[StepSample] | None = None,
) -> StepTimeModel:
    """Sends groups of (prompt ids, output tokens) to the server at ``base_url`` that serves
    ``engine`` (in this process), a group once the previous one finished, records the steps
    (see StepRecorder) and fits the model, with ``request_latency_s`` from the client's and
    the engine's TTFTs. ``samples_out``, if given, receives the raw StepSamples."""
    from jaxserve.bench.serve import ServeBenchConfig, run_serve_benchmark
    from jaxserve.bench.workloads import BenchRequest

    config = ServeBenchConfig(base_url=base_url, num_warmup=0, scrape_metrics=False)
    client_ttfts: list[float] = []
    with StepRecorder(engine) as recorder:
        for group in groups:
            requests = [BenchRequest(ids, len(ids), n) for ids, n in group]
            result = run_serve_benchmark(config, requests)
            client_ttfts += [t for t, e in zip(result["ttfts"], result["errors"]) if not e]
    if samples_out is not None:
        samples_out.extend(recorder.samples)
    model = StepTimeModel.fit(recorder.samples, f"served calibration at {base_url}")
    if client_ttfts and recorder.engine_ttfts:
        gap = float(np.median(client_ttfts) - np.median(recorder.engine_ttfts))
        model = dataclasses.replace(model, request_latency_s=max(0.0, gap))
    return model
