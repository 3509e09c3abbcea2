"""Validates ``jaxserve tune``: predicted vs measured throughput and TTFT for three workloads.

One engine (the bundled model, CPU-sized knobs below) is built and served over HTTP in this
process, its step-time model calibrated through the server (``calibrate_served``: the
calibration mix sent over HTTP, steps timed start to start), then for each workload (qa, long-doc and mixed presets scaled to
CPU sizes, each its own seed so no prompt is shared between them) the tuner's replay predicts
the run and a real ``jaxserve bench serve`` run (a separate process, so the client's stream
parsing does not share the server's GIL; same preset, sizes and seed, hence the same prompts
and send times) measures it on the same engine served over HTTP. The calibration is redone
right before each workload (the shared box's load drifts).
Target: |error| <= 25% on output throughput and on TTFT p50.

Run:  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/validate_tune.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from jaxserve.bench.live_server import BackgroundServer
from jaxserve.config import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.tune.grid import token_source
from jaxserve.tune.simulate import Setting, simulate
from jaxserve.tune.step_model import calibrate_served, calibration_prompts
from jaxserve.tune.trace import preset_trace
from jaxserve.tune.validate import bench_serve_preset, compare

ENGINE = dict(
    dtype="float32",
    attention_backend="xla",
    max_model_len=512,
    num_gpu_blocks_override=128,
    block_size=16,
    max_num_batched_tokens=128,
    max_num_seqs=8,
    long_prefill_token_threshold=0,
    served_model_name="tiny-llama",
)
WORKLOADS = {
    "qa": dict(num_prompts=24, input_len=64, output_len=24, max_concurrency=8),
    "long-doc": dict(num_prompts=6, input_len=384, output_len=32, max_concurrency=2),
    "mixed": dict(
        num_prompts=16,
        input_len=64,
        output_len=24,
        long_input_len=384,
        long_output_len=32,
        long_fraction=0.25,
        request_rate=0.5,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--mixed-rate", type=float, default=None, help="override mixed's req/s")
    args = parser.parse_args()
    engine = LLMEngine.from_engine_args(EngineArgs(**ENGINE))
    cfg = engine.config
    groups = calibration_prompts(
        engine.runner.token_buckets,
        cfg.scheduler.max_num_seqs,
        cfg.scheduler.max_model_len,
        engine.vocab_size,
    )
    server = BackgroundServer(engine)

    def calibrate():
        t0 = time.perf_counter()
        samples = []
        model = calibrate_served(engine, server.url, groups, samples)
        by_shape = {}
        for smp in samples:
            by_shape.setdefault((smp.token_bucket, smp.num_seqs), []).append(smp.seconds * 1e3)
        print(
            "  measured step ms (median) by (token bucket, requests):",
            {k: round(sorted(v)[len(v) // 2], 1) for k, v in sorted(by_shape.items())},
        )
        print(
            f"calibration: {model.num_samples} steps in {time.perf_counter() - t0:.1f} s, "
            f"coef {[f'{c:.3g}' for c in model.coef]}, request latency "
            f"{model.request_latency_s * 1e3:.0f} ms, median fit error {model.rel_error_p50:.0%}, "
            f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )
        return model

    setting = Setting(
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
        max_num_seqs=cfg.scheduler.max_num_seqs,
        long_prefill_token_threshold=cfg.scheduler.long_prefill_token_threshold,
        num_gpu_blocks=cfg.cache.num_gpu_blocks,
        enable_prefix_caching=cfg.cache.enable_prefix_caching,
        block_size=cfg.cache.block_size,
        max_model_len=cfg.scheduler.max_model_len,
        token_buckets=tuple(engine.runner.token_buckets),
    )
    source = token_source()
    rows = []
    with server:
        for k, (name, overrides) in enumerate(WORKLOADS.items()):
            if name not in args.workloads:
                continue
            if name == "mixed" and args.mixed_rate:
                overrides = {**overrides, "request_rate": args.mixed_rate}
            seed = 100 * (k + 1)  # bench serve warms up with seed + 1: no prompt shared
            trace = preset_trace(name, source, seed=seed, **overrides)
            model = calibrate()  # right before the run: the box's load drifts within minutes
            predicted = simulate(trace, setting, model)
            measured = bench_serve_preset(server.url, name, seed, overrides)
            row = compare(name, predicted, measured)
            row["load_average"] = round(os.getloadavg()[0], 1)
            rows.append(row)
            print(json.dumps(row))
    print()
    print(
        "| workload | output tok/s pred / meas (err) | TTFT p50 ms pred / meas (err) | TPOT p50 ms pred / meas (err) | load avg |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        cells = []
        for key in ("output_throughput", "ttft_ms_p50", "tpot_ms_p50"):
            cells.append(
                f"{r['pred_' + key]:.1f} / {r['meas_' + key]:.1f} ({r['err_' + key]:+.0%})"
            )
        print(f"| {r['workload']} | " + " | ".join(cells) + f" | {r['load_average']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": ENGINE, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
