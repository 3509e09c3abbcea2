"""``jaxserve tune``: predict each scheduler setting's latency and throughput for a workload.

    jaxserve tune --workload qa --max-num-batched-tokens-grid 256,512,1024 \\
        --max-num-seqs-grid 16,64 --slo-ttft-p99 2.0 --slo-tpot-p99 0.1 \\
        --output-json tune.json --plot tune.png [engine flags of the target]
    jaxserve tune --trace my_traffic.jsonl --calibration calib.json

The step-time model comes from ``--calibration FILE`` (written by an earlier run's
``--save-calibration``) or, by default, from a short calibration run of the real engine built
from the engine flags (the model, dtype, attention backend, buckets of the target). Each grid
point is replayed through the real scheduler (``jaxserve.tune.simulate``). The recommended
setting is the one with the highest output throughput whose TTFT p99 and TPOT p99 meet the
SLOs (seconds); without SLOs, the highest throughput.

Exit codes: 0 done (a recommendation, or none meets the SLOs: said on stdout and in the
JSON); 2 bad flags or trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from typing import Any

from jaxserve.tune.simulate import Setting, SimResult, simulate
from jaxserve.tune.step_model import StepTimeModel, calibrate_engine, calibration_prompts
from jaxserve.tune.trace import PRESET_NAMES, Trace, load_jsonl_trace, preset_trace
from jaxserve.worker.batch_builder import backend_token_buckets

WORKLOAD_OVERRIDES = (
    "num_prompts",
    "input_len",
    "output_len",
    "long_input_len",
    "long_output_len",
    "long_fraction",
    "request_rate",
    "max_concurrency",
    "num_conversations",
    "turns",
    "system_len",
)
GRID_FLAGS = (
    ("max_num_batched_tokens", int),
    ("max_num_seqs", int),
    ("long_prefill_token_threshold", int),
    ("num_gpu_blocks", int),
    ("enable_prefix_caching", "onoff"),
)


def add_tune_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``tune``: workload, grid, SLO, output and calibration flags, plus the engine flags."""
    from jaxserve.config import EngineArgs

    parser = subparsers.add_parser(
        "tune",
        help="predict latency / throughput per scheduler setting and recommend one",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", choices=PRESET_NAMES, default="mixed", help="a preset load shape")
    w.add_argument("--trace", default=None, help="a JSONL trace instead of a preset")
    w.add_argument("--workload-seed", type=int, default=0, help="seed of prompts and arrivals")
    for name in WORKLOAD_OVERRIDES:
        kind = float if name in ("long_fraction", "request_rate") else int
        w.add_argument(
            "--" + name.replace("_", "-"), type=kind, default=None, help="override the preset's"
        )
    g = parser.add_argument_group("grid (comma-separated; default: the engine flag's value)")
    for name, _ in GRID_FLAGS:
        g.add_argument("--" + name.replace("_", "-") + "-grid", default=None, metavar="LIST")
    s = parser.add_argument_group("SLOs and output")
    s.add_argument("--slo-ttft-p99", type=float, default=None, help="seconds")
    s.add_argument("--slo-tpot-p99", type=float, default=None, help="seconds")
    s.add_argument("--output-json", default=None, help="write every setting's figures here")
    s.add_argument("--plot", default=None, help="write the trade-off plot here (png; matplotlib)")
    c = parser.add_argument_group("step-time model")
    c.add_argument("--calibration", default=None, help="a saved step-time model (JSON)")
    c.add_argument("--save-calibration", default=None, help="save the fitted model (JSON) here")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run_tune)
    return parser


def parse_grid(text: str | None, default: Any, kind: Any, name: str) -> list:
    """``"a,b,c"`` -> typed values (``onoff``: on/off/true/false); None -> ``[default]``.

    Raises:
      ValueError: a value that does not parse (names the flag).
    """
    if text is None:
        return [default]
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        try:
            if kind == "onoff":
                if item not in ("on", "off", "true", "false"):
                    raise ValueError(item)
                out.append(item in ("on", "true"))
            else:
                out.append(kind(item))
        except ValueError:
            raise ValueError(f"{name}_grid: cannot parse {item!r}") from None
    return out


def grid_settings(
    base: Setting,
    grids: dict[str, list],
    token_buckets: tuple[int, ...],
    backend: str | None = None,
) -> list[Setting]:
    """Every combination of the grids over ``base``, each with the buckets its runner would
    compile: the configured ones where they still reach the budget, else the default ladder
    of attention ``backend`` for that budget (``backend_token_buckets``: from one token on
    the CPU's backend, from 16 with the Pallas kernels; ``ModelRunner.backend``). Without a
    backend: the ladder from 16 (the Pallas backends')."""
    names = list(grids)
    out = []
    for values in itertools.product(*(grids[n] for n in names)):
        s = dataclasses.replace(base, **dict(zip(names, values)))
        budget = s.max_num_batched_tokens
        buckets = (
            tuple(token_buckets)
            if token_buckets and max(token_buckets) >= budget
            else backend_token_buckets(backend or "pallas-gpu", (), budget)
        )
        out.append(dataclasses.replace(s, token_buckets=buckets))
    return out


def recommend(
    results: list[dict[str, Any]], slo_ttft_p99: float | None, slo_tpot_p99: float | None
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the best setting meeting the SLOs, or None; the ones that meet them).

    Best = highest output throughput, then lowest TTFT p99. SLOs in seconds; figures in ms.
    """

    def meets(r: dict[str, Any]) -> bool:
        if r["requests"] == 0 or r["rejected"]:
            return False
        if slo_ttft_p99 is not None and (r["ttft_ms_p99"] or 0) > slo_ttft_p99 * 1e3:
            return False
        if slo_tpot_p99 is not None and (r["tpot_ms_p99"] or 0) > slo_tpot_p99 * 1e3:
            return False
        return True

    ok = [r for r in results if meets(r)]
    best = max(ok, key=lambda r: (r["output_throughput"], -(r["ttft_ms_p99"] or 0)), default=None)
    return best, ok


COLUMNS = (
    ("max_num_batched_tokens", "budget"),
    ("max_num_seqs", "seqs"),
    ("long_prefill_token_threshold", "thresh"),
    ("num_gpu_blocks_override", "blocks"),
    ("enable_prefix_caching", "prefix"),
    ("output_throughput", "tok/s"),
    ("ttft_ms_p50", "TTFT50"),
    ("ttft_ms_p99", "TTFT99"),
    ("tpot_ms_p50", "TPOT50"),
    ("tpot_ms_p99", "TPOT99"),
    ("itl_ms_p50", "ITL50"),
    ("itl_ms_p99", "ITL99"),
    ("peak_waiting", "wait"),
    ("preemptions", "preempt"),
    ("peak_kv_usage", "KV"),
    ("prefix_hit_rate", "hit"),
)


def format_table(results: list[dict[str, Any]]) -> str:
    """A fixed-width table of the predicted figures (latencies in ms)."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "on" if v else "off"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1 else f"{v:.1f}"
        return str(v)

    rows = [[h for _, h in COLUMNS]] + [[cell(r[k]) for k, _ in COLUMNS] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def plot_tradeoff(results: list[dict[str, Any]], best: dict[str, Any] | None, path: str) -> None:
    """Output throughput vs TTFT p99 per setting (the recommended one marked), as a png.

    Raises:
      ValueError: matplotlib is not installed (install jaxserve[tune]).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plot: needs matplotlib (pip install 'jaxserve[tune]')") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["ttft_ms_p99"] or 0 for r in results]
    ys = [r["output_throughput"] or 0 for r in results]
    colors = [r["max_num_batched_tokens"] for r in results]
    sc = ax.scatter(xs, ys, c=colors, cmap="viridis")
    fig.colorbar(sc, ax=ax, label="max_num_batched_tokens")
    if best is not None:
        ax.scatter(
            [best["ttft_ms_p99"]],
            [best["output_throughput"]],
            s=200,
            facecolors="none",
            edgecolors="red",
            label="recommended",
        )
        ax.legend()
    ax.set_xlabel("predicted TTFT p99 (ms)")
    ax.set_ylabel("predicted output tokens/s")
    ax.set_title("jaxserve tune: throughput vs tail latency")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def serve_flags(best: dict[str, Any]) -> str:
    """The ``jaxserve serve`` flags of a recommended setting."""
    flags = [
        f"--max-num-batched-tokens {best['max_num_batched_tokens']}",
        f"--max-num-seqs {best['max_num_seqs']}",
        f"--long-prefill-token-threshold {best['long_prefill_token_threshold']}",
        f"--num-gpu-blocks-override {best['num_gpu_blocks_override']}",
        "--enable-prefix-caching"
        if best["enable_prefix_caching"]
        else "--no-enable-prefix-caching",
    ]
    return " ".join(flags)


def calibrate(engine_args: Any) -> tuple[StepTimeModel, Any]:
    """Builds the engine of ``engine_args``, runs the calibration mix, fits the step-time
    model. Returns (model, engine config)."""
    from jaxserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(engine_args)
    cfg = engine.scheduler.scheduler_config
    groups = calibration_prompts(
        engine.runner.token_buckets, cfg.max_num_seqs, cfg.max_model_len, engine.vocab_size
    )
    samples = calibrate_engine(engine, groups)
    model = StepTimeModel.fit(samples, source=f"engine calibration run ({len(samples)} steps)")
    return model, engine.config


def no_recommendation(results: list[dict[str, Any]], max_model_len: int) -> str:
    """Why ``recommend`` found no setting: every one refused requests (what is too long), or
    none meets the SLOs."""
    refused = [r for r in results if r["rejected"]]
    if refused and len(refused) == len(results):
        least = min(r["rejected"] for r in refused)
        total = refused[0]["requests"] + refused[0]["rejected"]
        return (
            f"no recommendation: every setting refused requests (at least {least} of {total}: "
            f"prompt + output tokens over --max-model-len {max_model_len} or the KV pool); "
            "raise --max-model-len or shorten the workload (--long-input-len, "
            "--long-output-len)"
        )
    return "no setting meets the SLOs (or every one that does refused requests); widen the grid"


def target_backend(config: Any) -> str:
    """The attention backend the target's runner resolves (``--attention-backend`` on this
    machine's platform): its token-bucket rules shape the simulated steps."""
    import jax

    from jaxserve.model.attention_backends import resolve_attention_backend

    runner = config.runner
    return resolve_attention_backend(
        runner.attention_backend, jax.devices()[0].platform, interpret=runner.pallas_interpret
    )


def token_source() -> Any:
    """Random prompt tokens from the bundled model's vocabulary (as ``bench serve`` draws them)."""
    from jaxserve.bench.workloads import TokenSource
    from jaxserve.model import default_model_path
    from jaxserve.tokenizer import get_tokenizer

    return TokenSource.from_tokenizer(get_tokenizer(str(default_model_path())))


def build_trace(args: argparse.Namespace, source: Any) -> Trace:
    """The trace of the parsed flags (a JSONL file or a preset with overrides)."""
    if args.trace:
        return load_jsonl_trace(args.trace, source, args.workload_seed)
    overrides = {n: getattr(args, n) for n in WORKLOAD_OVERRIDES}
    return preset_trace(args.workload, source, args.workload_seed, **overrides)


def tune(
    trace: Trace,
    model: StepTimeModel,
    settings: list[Setting],
    slo_ttft_p99: float | None = None,
    slo_tpot_p99: float | None = None,
) -> dict[str, Any]:
    """Replays ``trace`` under every setting; returns the JSON report (``results``,
    ``recommended``, ``meets_slo``, the model and the SLOs)."""
    results = []
    for s in settings:
        result: SimResult = simulate(trace, s, model)
        results.append(result.summary())
    best, ok = recommend(results, slo_ttft_p99, slo_tpot_p99)
    return {
        "workload": trace.describe(),
        "step_time_model": model.to_dict(),
        "slo": {"ttft_p99_s": slo_ttft_p99, "tpot_p99_s": slo_tpot_p99},
        "results": results,
        "recommended": best,
        "num_meeting_slo": len(ok),
    }


def run_tune(args: argparse.Namespace) -> int:
    """The ``tune`` command (see the module docstring for exit codes)."""
    from jaxserve.config import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    source = token_source()
    trace = build_trace(args, source)
    t0 = time.perf_counter()
    if args.calibration:
        model = StepTimeModel.load(args.calibration)
        config = engine_args.create_engine_config(_model_max_len(engine_args))
        num_blocks = engine_args.num_gpu_blocks_override
        if num_blocks is None:
            raise ValueError("num_gpu_blocks_override: give the KV pool size with --calibration")
    else:
        model, config = calibrate(engine_args)
        num_blocks = config.cache.num_gpu_blocks
        print(
            f"calibrated the step-time model in {time.perf_counter() - t0:.1f} s: "
            f"{model.num_samples} steps, median error {model.rel_error_p50:.0%}",
            file=sys.stderr,
        )
    if args.save_calibration:
        model.save(args.save_calibration)
    sched = config.scheduler
    base = Setting(
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs,
        long_prefill_token_threshold=sched.long_prefill_token_threshold,
        num_gpu_blocks=num_blocks,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        block_size=config.cache.block_size,
        max_model_len=sched.max_model_len,
    )
    grids = {
        name: parse_grid(getattr(args, name + "_grid"), getattr(base, name), kind, name)
        for name, kind in GRID_FLAGS
    }
    settings = grid_settings(base, grids, config.runner.token_buckets, target_backend(config))
    report = tune(trace, model, settings, args.slo_ttft_p99, args.slo_tpot_p99)
    print(report["workload"])
    print(format_table(report["results"]))
    best = report["recommended"]
    if best is None:
        print(no_recommendation(report["results"], sched.max_model_len))
    else:
        print(
            f"recommended: {serve_flags(best)}  (predicted {best['output_throughput']:.1f} "
            f"tok/s, TTFT p99 {best['ttft_ms_p99']:.0f} ms, TPOT p99 {best['tpot_ms_p99'] or 0:.1f} ms)"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.output_json}")
    if args.plot:
        plot_tradeoff(report["results"], best, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _model_max_len(engine_args: Any) -> int:
    """The model's max_position_embeddings, read from its config.json (no weights loaded)."""
    from jaxserve.model.arch_config import ModelArchConfig

    path = engine_args.resolved_model_path()
    return ModelArchConfig.from_pretrained(path).max_position_embeddings
