"""The ``jaxserve bench`` subcommand: ``bench serve`` (a running server) and ``bench throughput`` (offline).

    jaxserve bench serve --base-url http://127.0.0.1:8000 --workload random --input-len 128 \\
        --output-len 128 --num-prompts 200 --request-rate 8 --result-file run.json
    jaxserve bench serve --preset qa                      # a named load shape (workloads.PRESETS)
    jaxserve bench throughput --attention-backend xla --workload shared-prefix \\
        --prefix-len 64 --num-prefixes 2 --input-len 16 --output-len 16 --num-prompts 32

Workload and load flags left out take the preset's value, else the defaults below. ``bench
serve`` imports neither jax nor the engine; it can drive any OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
from typing import Any

from jaxserve.bench.workloads import (
    PRESETS,
    PROMPT_FORMATS,
    WORKLOADS,
    TokenSource,
    WorkloadSpec,
    make_requests,
)

# `bench serve --help`: plain text (the module docstring is reST).
SERVE_DESCRIPTION = """\
Load-test a running OpenAI-compatible server (ours or vLLM) with streamed completions and
report vLLM bench serve's figures, plus the server's /metrics. Start a server first
(jaxserve serve). Examples:

  jaxserve bench serve --base-url http://127.0.0.1:8000 --workload random --input-len 128 \\
      --output-len 128 --num-prompts 200 --request-rate 8 --result-file run.json
  jaxserve bench serve --preset qa

Workload and load flags left out take the preset's value, else their defaults."""

DEFAULTS: dict[str, Any] = {
    "workload": "random",
    "num_prompts": 100,
    "input_len": 128,
    "output_len": 128,
    "range_ratio": 0.0,
    "prefix_len": 0,
    "num_prefixes": 1,
    "long_input_len": 2048,
    "long_output_len": 512,
    "long_fraction": 0.1,
    "request_rate": math.inf,
    "max_concurrency": None,
}


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``bench`` with its ``serve`` and ``throughput`` subcommands."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark a server (serve) or the offline engine (throughput)",
        description="Benchmarks with vLLM's figures (bench serve / bench throughput).",
    )
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    serve = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server with streamed completions",
        description=SERVE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    serve.add_argument(
        "--model", default=None, help="model name to send (default: the server's first model)"
    )
    serve.add_argument("--endpoint", default="/v1/completions", help="completions path")
    serve.add_argument(
        "--tokenizer",
        default=None,
        help="model directory whose tokenizer gives the vocabulary for random prompts "
        "(default: the bundled checkpoint's)",
    )
    serve.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="draw token ids from [0, VOCAB_SIZE) instead of a tokenizer's vocabulary (ids only)",
    )
    serve.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrival rate, requests/s (default inf: all at once)",
    )
    serve.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight (default: no cap)",
    )
    serve.add_argument(
        "--percentiles", default="99", help="comma-separated latency percentiles to report"
    )
    serve.add_argument(
        "--metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="scrape the server's /metrics before, during and after the run",
    )
    serve.add_argument(
        "--metrics-interval", type=float, default=0.5, help="seconds between /metrics polls"
    )
    serve.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    serve.add_argument(
        "--timeout", type=float, default=6 * 3600, help="per-request timeout, seconds"
    )
    serve.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    serve.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="phases and a progress bar of finished requests on stderr",
    )
    _add_workload_args(serve)
    serve.set_defaults(func=run_bench_serve)

    throughput = sub.add_parser(
        "throughput",
        help="offline throughput through LLM.generate",
        description="Offline throughput (vLLM bench throughput): all requests queued at "
        "once; engine flags as for `jaxserve serve` (--seed also seeds the "
        "prompts).",
    )
    from jaxserve.config import EngineArgs

    EngineArgs.add_cli_args(throughput)
    _add_workload_args(throughput)
    throughput.set_defaults(func=run_bench_throughput)
    return parser


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a named load shape: qa (short, high concurrency), long-doc, mixed",
    )
    g.add_argument(
        "--workload", choices=WORKLOADS, default=None, help="prompt set (default random)"
    )
    g.add_argument("--num-prompts", type=int, default=None, help="measured requests (default 100)")
    g.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="prompt tokens; for shared-prefix the unique tokens after the prefix (default 128)",
    )
    g.add_argument(
        "--output-len", type=int, default=None, help="output tokens per request (default 128)"
    )
    g.add_argument(
        "--range-ratio",
        type=float,
        default=None,
        help="draw lengths from [len*(1-r), len*(1+r)] (default 0: fixed)",
    )
    g.add_argument(
        "--prefix-len", type=int, default=None, help="shared prefix tokens (shared-prefix)"
    )
    g.add_argument(
        "--num-prefixes",
        type=int,
        default=None,
        help="distinct prefixes (shared-prefix, default 1)",
    )
    g.add_argument(
        "--long-input-len",
        type=int,
        default=None,
        help="long requests' prompt tokens (mixed, 2048)",
    )
    g.add_argument(
        "--long-output-len",
        type=int,
        default=None,
        help="long requests' output tokens (mixed, 512)",
    )
    g.add_argument(
        "--long-fraction", type=float, default=None, help="share of long requests (mixed, 0.1)"
    )
    g.add_argument(
        "--prompt-format",
        choices=PROMPT_FORMATS,
        default="ids",
        help="ids: token-id prompts (exact lengths); text: random words",
    )
    g.add_argument(
        "--num-warmup", type=int, default=1, help="warm-up requests before the measured run"
    )
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly --output-len tokens per request",
    )
    g.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    g.add_argument("--result-file", default=None, help="write the result as JSON here")


def resolve(args: argparse.Namespace, name: str) -> Any:
    """A workload/load flag's value: given on the command line, else the preset's, else the default."""
    value = getattr(args, name, None)
    if value is not None:
        return value
    preset = PRESETS.get(getattr(args, "preset", None) or "", {})
    return preset.get(name, DEFAULTS[name])


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The WorkloadSpec of the parsed flags. Raises ValueError naming a bad field."""
    names = (
        "num_prompts",
        "input_len",
        "output_len",
        "range_ratio",
        "prefix_len",
        "num_prefixes",
        "long_input_len",
        "long_output_len",
        "long_fraction",
    )
    return WorkloadSpec(
        kind=resolve(args, "workload"),
        prompt_format=args.prompt_format,
        seed=args.seed,
        **{n: resolve(args, n) for n in names},
    )


def _token_source(args: argparse.Namespace) -> TokenSource:
    if args.vocab_size is not None and args.prompt_format == "ids" and args.tokenizer is None:
        return TokenSource(args.vocab_size)
    from jaxserve.model import default_model_path
    from jaxserve.tokenizer import get_tokenizer

    return TokenSource.from_tokenizer(get_tokenizer(args.tokenizer or default_model_path()))


def _write(path: str | None, result: dict[str, Any], spec: WorkloadSpec) -> None:
    if path:
        result = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "workload": dataclasses.asdict(spec),
            **result,
        }
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")


def run_bench_serve(args: argparse.Namespace) -> int:
    """The ``bench serve`` command; returns 0, 1 if a request failed, 2 on bad flags."""
    from jaxserve.bench.serve import ServeBenchConfig, format_table, run_serve_benchmark

    try:
        spec = workload_spec(args)
        percentiles = tuple(float(p) for p in args.percentiles.split(","))
        config = ServeBenchConfig(
            base_url=args.base_url,
            model=args.model,
            endpoint=args.endpoint,
            request_rate=resolve(args, "request_rate"),
            max_concurrency=resolve(args, "max_concurrency"),
            num_warmup=args.num_warmup,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            percentiles=percentiles,
            scrape_metrics=args.metrics,
            metrics_interval_s=args.metrics_interval,
            api_key=args.api_key,
            timeout_s=args.timeout,
            seed=args.seed,
            progress=args.progress,
        )
        source = _token_source(args)
        requests = make_requests(spec, source)
        warmup = make_requests(
            dataclasses.replace(spec, num_prompts=max(1, args.num_warmup), seed=spec.seed + 1),
            source,
        )
    except ValueError as e:
        print(f"jaxserve bench serve: error: {e}", file=sys.stderr)
        return 2
    import aiohttp

    try:
        result = run_serve_benchmark(config, requests, warmup)
    except aiohttp.ClientConnectionError as e:
        print(
            f"jaxserve bench serve: error: no server answers at {args.base_url} ({e}); "
            "start one (jaxserve serve) or pass --base-url",
            file=sys.stderr,
        )
        return 2
    except (RuntimeError, aiohttp.ClientError) as e:  # a refused model, a failed warm-up
        print(f"jaxserve bench serve: error: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    _write(args.result_file, result, spec)
    return 1 if result["failed"] else 0


def run_bench_throughput(args: argparse.Namespace) -> int:
    """The ``bench throughput`` command; returns 0, or 2 on bad flags or a refused request."""
    from jaxserve.bench.throughput import format_throughput, run_throughput
    from jaxserve.config import EngineArgs
    from jaxserve.engine.llm import LLM

    try:
        spec = workload_spec(args)
        engine_args = EngineArgs.from_cli_args(args)
        llm = LLM(**{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(EngineArgs)})
        tokenizer = llm.get_tokenizer()
        source = (
            TokenSource.from_tokenizer(tokenizer)
            if tokenizer is not None
            else TokenSource(llm.llm_engine.vocab_size)
        )
        requests = make_requests(spec, source)
        warmup = (
            make_requests(
                dataclasses.replace(spec, num_prompts=args.num_warmup, seed=spec.seed + 1), source
            )
            if args.num_warmup
            else []
        )
        result = run_throughput(
            llm,
            requests,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            warmup_requests=warmup,
            use_tqdm=True,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_throughput(result))
    _write(args.result_file, result, spec)
    return 0
