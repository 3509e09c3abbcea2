"""Offline throughput: output tokens/s of ``LLMEngine`` on fixed-length random prompts, with the
step time split into host work (scheduler; runner row updates + batch build + sampling
metadata; runner output + scheduler update + RequestOutputs) and device work (dispatch until the
step's tokens are on the host). Like vLLM's ``benchmarks/benchmark_throughput.py`` (random
dataset, ``ignore_eos``, every prompt queued at once).

CPU, the bundled checkpoint:
  .venv/bin/python benchmarks/bench_offline.py --num-prompts 64 --input-len 128 --output-len 64 \\
      --max-num-seqs 64 --max-num-batched-tokens 1024 --dtype float32

GPU, dummy weights at Llama-3.1-8B / Llama-3.2-1B shapes (presets of jaxserve.model.presets):
  python benchmarks/bench_offline.py --model llama-3.1-8b --load-format dummy --dtype bfloat16 \\
      --num-prompts 1000 --input-len 1000 --output-len 1000 --time-limit-s 300

Tensor parallel (``--tensor-parallel-size N``); on CPU, simulated devices measure what the
collectives and the per-shard attention cost, not a speed-up (they share the same cores):
  XLA_FLAGS=--xla_force_host_platform_device_count=4 .venv/bin/python benchmarks/bench_offline.py \
      --tensor-parallel-size 4 --num-prompts 32 --input-len 128 --output-len 64 --max-num-seqs 32 \
      --max-num-batched-tokens 512 --dtype float32

``--time-limit-s`` stops the run (aborting what is left) and reports the figures so far, so a
short GPU slot always yields numbers; progress lines are printed every ``--report-every-s``. The
last line is a JSON summary (also written to ``--json-out`` when given).

Host cost of a steady decode step (#16): the summary's ``steady_decode`` gives per-step
medians over the steps where every running request decodes one token, at the most requests
the run reaches (``--num-prompts`` <= ``--max-num-seqs`` keeps all of them running); host =
schedule + runner host (launch excluded, it is printed apart) + output. ``--stream`` makes each
request stream (an output per step, detokenized, as the server's requests do) instead of
``final_only``; with ``--output-kind delta`` those outputs hold only what is new (the server's
streams, #34) instead of the whole text and token list so far. At 256 running requests:
  .venv/bin/python benchmarks/bench_offline.py --num-prompts 256 --input-len 32 --output-len 256 \
      --max-num-seqs 256 --max-num-batched-tokens 2048 --token-buckets 256,2048 --dtype float32

``--compare-sync R`` runs the workload 2R times on one runner, alternating the synchronous loop
and async scheduling, and prints the medians and the share of host time hidden under device time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxserve.config import EngineArgs  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument(
        "--output-len", type=int, default=64, help="output tokens per request (ignore_eos)"
    )
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="draw each request's prompt and output lengths uniformly from [len * (1 - r), "
        "len * (1 + r)] (vLLM's flag; 0 = every request alike, so requests finish together)",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument(
        "--time-limit-s", type=float, default=0.0, help="stop after this long (0 = no limit)"
    )
    parser.add_argument("--report-every-s", type=float, default=10.0)
    parser.add_argument("--json-out", default="", help="also write the JSON summary here")
    parser.add_argument(
        "--stream",
        action="store_true",
        help="stream every request (an output per step, detokenized, like the server) "
        "instead of final_only",
    )
    parser.add_argument(
        "--output-kind",
        choices=["cumulative", "delta"],
        default="cumulative",
        help="with --stream: what each output holds (RequestOutputKind; the server's streams "
        "use delta)",
    )
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument(
        "--compare-sync",
        type=int,
        default=0,
        metavar="R",
        help="run the workload 2R times on one runner, alternating the synchronous loop and "
        "async scheduling, and print each run, the medians and the share of host time hidden",
    )
    args = parser.parse_args(argv)
    if not 0.0 <= args.random_range_ratio < 1.0:
        parser.error("--random-range-ratio must be in [0, 1)")
    if args.max_model_len is None:
        args.max_model_len = sum(
            _len_range(n, args.random_range_ratio)[1] for n in (args.input_len, args.output_len)
        )
    return args


def _len_range(n: int, ratio: float) -> tuple[int, int]:
    """[lo, hi] of a length drawn around ``n`` (``--random-range-ratio``), at least 1."""
    return max(1, int(n * (1 - ratio))), max(1, int(n * (1 + ratio)))


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("absl", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import jax

    from jaxserve.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    startup_s = time.perf_counter() - t0
    runner = engine.runner
    print(
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), attention {runner.backend}, "
        f"dtype {runner.dtype.name}, tensor parallel {runner.mesh.size}, "
        f"KV {engine.config.cache.num_gpu_blocks} blocks "
        f"({runner.kv_spec.num_tokens} tokens), buckets {runner.token_buckets}",
        flush=True,
    )
    print(
        f"start-up {startup_s:.1f} s (compile/warm-up {runner.compile_seconds:.1f} s)", flush=True
    )

    if args.compare_sync:
        return compare_sync(engine, args, startup_s)
    return run_workload(engine, args, startup_s)


def run_workload(engine, args: argparse.Namespace, startup_s: float) -> dict:
    """Queues the random prompts, steps the engine until they finish (or the time limit) and
    prints/returns the JSON summary."""
    import jax
    import numpy as np

    from jaxserve.sampling_params import RequestOutputKind, SamplingParams

    runner = engine.runner
    rng = np.random.default_rng(args.bench_seed)
    vocab = engine.vocab_size
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.output_len,
        ignore_eos=True,
        seed=None,
        output_kind=RequestOutputKind[args.output_kind.upper()],
    )
    in_lo, in_hi = _len_range(args.input_len, args.random_range_ratio)
    out_lo, out_hi = _len_range(args.output_len, args.random_range_ratio)
    for i in range(args.num_prompts):
        prompt = rng.integers(3, vocab, size=int(rng.integers(in_lo, in_hi + 1))).tolist()
        if args.random_range_ratio:
            params = params.clone(max_tokens=int(rng.integers(out_lo, out_hi + 1)))
        engine.add_request(str(i), prompt, params, final_only=not args.stream)

    stats0 = engine.get_stats()
    start = time.perf_counter()
    last_report = start
    window_t, window_tokens = start, 0
    finished = 0
    timed_out = False
    decode_steps: list[tuple] = []  # per-step time deltas of steady decode steps
    prev = stats0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        cur = engine.get_stats()
        if cur.num_waiting_reqs == 0 and cur.num_scheduled_tokens == cur.num_running_reqs > 0:
            decode_steps.append(
                (cur.num_running_reqs, *(getattr(cur, k) - getattr(prev, k) for k in _TIMES))
            )
        prev = cur
        finished += sum(1 for o in outputs if o.finished)
        now = time.perf_counter()
        if now - last_report >= args.report_every_s:
            st = engine.get_stats()
            gen = st.num_generation_tokens_total - stats0.num_generation_tokens_total
            rate = (gen - window_tokens) / (now - window_t)
            print(
                f"[{now - start:7.1f} s] finished {finished}/{args.num_prompts}, output tokens {gen}, "
                f"{gen / (now - start):.1f} tok/s overall, {rate:.1f} tok/s last {now - window_t:.0f} s, "
                f"running {st.num_running_reqs}, waiting {st.num_waiting_reqs}, "
                f"KV {100 * st.kv_cache_usage:.0f}%",
                flush=True,
            )
            last_report, window_t, window_tokens = now, now, gen
        if args.time_limit_s and now - start >= args.time_limit_s:
            timed_out = True
            engine.abort_request([str(i) for i in range(args.num_prompts)])
            break
    elapsed = time.perf_counter() - start
    st = engine.get_stats()
    steps = st.num_steps_total - stats0.num_steps_total
    gen = st.num_generation_tokens_total - stats0.num_generation_tokens_total
    prompt_tokens = st.num_scheduled_tokens_total - stats0.num_scheduled_tokens_total - gen
    per_step = lambda name: 1e3 * (getattr(st, name) - getattr(stats0, name)) / max(steps, 1)  # noqa: E731
    summary = {
        "model": engine.config.model.served_model_name,
        "device": jax.devices()[0].device_kind,
        "backend": runner.backend,
        "dtype": runner.dtype.name,
        "tensor_parallel_size": runner.mesh.size,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "random_range_ratio": args.random_range_ratio,
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
        "finished_requests": finished,
        "timed_out": timed_out,
        "elapsed_s": round(elapsed, 3),
        "output_tokens": gen,
        "output_tok_per_s": round(gen / elapsed, 1),
        "total_tok_per_s": round((gen + prompt_tokens) / elapsed, 1),
        "steps": steps,
        "startup_s": round(startup_s, 1),
        "compile_s": round(runner.compile_seconds, 1),
        "ms_per_step": {
            "schedule": round(per_step("schedule_s"), 3),
            "runner_host": round(per_step("runner_host_s"), 3),
            "device": round(per_step("runner_device_s"), 3),
            "output": round(per_step("output_s"), 3),
            "wall": round(1e3 * elapsed / max(steps, 1), 3),
        },
        "steady_decode": steady_decode(decode_steps),
        "compiles_after_warmup": runner.compile_counts(),
        "async_scheduling": engine.async_scheduling,
    }
    ms = summary["ms_per_step"]
    print(
        f"\n{'(time limit hit) ' if timed_out else ''}{finished}/{args.num_prompts} requests in {elapsed:.1f} s: "
        f"{summary['output_tok_per_s']} output tok/s, {summary['total_tok_per_s']} total tok/s over {steps} steps"
    )
    print(
        f"per step: schedule {ms['schedule']} ms, runner host {ms['runner_host']} ms, device {ms['device']} ms, "
        f"output {ms['output']} ms, wall {ms['wall']} ms"
    )
    sd = summary["steady_decode"]
    if sd:
        print(
            f"steady decode ({sd['steps']} steps at {sd['running']} running, medians): host "
            f"{sd['host_ms']} ms per step = schedule {sd['schedule_ms']} + runner host "
            f"{sd['runner_host_ms']} + output {sd['output_ms']} (thread CPU {sd['host_cpu_ms']} ms); launch {sd['launch_ms']} ms, "
            f"device wait {sd['device_ms']} ms"
        )
    line = json.dumps(summary)
    print(line, flush=True)
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(line + "\n")
    return summary


_TIMES = (
    "schedule_s",
    "runner_host_s",
    "runner_launch_s",
    "runner_device_s",
    "output_s",
    "host_cpu_s",
)


def steady_decode(steps: list[tuple]) -> dict:
    """Per-step medians (ms) over the decode steps at the largest running count seen.

    ``steps``: ``(running, schedule_s, runner_host_s, runner_launch_s, runner_device_s,
    output_s, host_cpu_s)`` deltas of steps where every running request decoded one token (in async mode
    the times are those of the step call: schedule + dispatch of step N+1, collect + update of
    step N). Returns {} when there were none."""
    import statistics

    if not steps:
        return {}
    top = max(s[0] for s in steps)
    rows = [s[1:] for s in steps if s[0] == top]
    med = [1e3 * statistics.median(col) for col in zip(*rows)]
    sched, host, launch, device, output, cpu = med
    per_step = [1e3 * (r[0] + r[1] - r[2] + r[4]) for r in rows]  # host work, launch excluded
    return {
        "running": top,
        "steps": len(rows),
        "host_ms": round(statistics.median(per_step), 3),
        "host_cpu_ms": round(cpu, 3),
        "schedule_ms": round(sched, 3),
        "runner_host_ms": round(host - launch, 3),
        "output_ms": round(output, 3),
        "launch_ms": round(launch, 3),
        "device_ms": round(device, 3),
    }


def compare_sync(engine, args: argparse.Namespace, startup_s: float) -> dict:
    """``--compare-sync R``: the workload 2R times on one runner, sync and async alternating.

    Hidden host share of an async run = (H + D - W) / H, with H its host work per step
    (schedule + runner host + output), W its wall time per step and D the device time per step,
    taken from the synchronous runs (where the host waits for every step: D = their "device").
    """
    import dataclasses
    import statistics

    from jaxserve.engine.llm_engine import LLMEngine

    base = engine.config
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.compare_sync):
        for on in (False, True):
            engine.runner.reset_requests()
            config = dataclasses.replace(
                base, scheduler=dataclasses.replace(base.scheduler, async_scheduling=on)
            )
            e = LLMEngine(
                config, engine.runner, engine.arch, engine.tokenizer, engine.generation_config
            )
            runs[on].append(run_workload(e, args, startup_s))
    med = lambda xs: statistics.median(xs)  # noqa: E731
    host = lambda r: sum(r["ms_per_step"][k] for k in ("schedule", "runner_host", "output"))  # noqa: E731
    device = med([r["ms_per_step"]["device"] for r in runs[False]])
    result = {}
    for on, label in ((False, "sync"), (True, "async")):
        rs = runs[on]
        result[label] = {
            "output_tok_per_s": med([r["output_tok_per_s"] for r in rs]),
            "host_ms_per_step": round(med([host(r) for r in rs]), 3),
            "wall_ms_per_step": round(med([r["ms_per_step"]["wall"] for r in rs]), 3),
        }
    h, w = result["async"]["host_ms_per_step"], result["async"]["wall_ms_per_step"]
    result["hidden_host_share"] = round(max(0.0, min(1.0, (h + device - w) / h)), 3) if h else 0.0
    result["async_over_sync_tok_per_s"] = round(
        result["async"]["output_tok_per_s"] / result["sync"]["output_tok_per_s"], 3
    )
    print(
        f"\nmedians over {args.compare_sync} alternating pairs: sync {result['sync']}, "
        f"async {result['async']}; async/sync output tok/s {result['async_over_sync_tok_per_s']}; "
        f"share of the async run's host time hidden under device time "
        f"{100 * result['hidden_host_share']:.0f}%"
    )
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
