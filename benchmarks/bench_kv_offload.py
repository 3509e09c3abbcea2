"""KV offloading benchmark: a multi-turn chat workload whose working set is ~4x the device pool,
with the host tier off and on.

Workload: ``--conversations`` conversations of ``--turns`` turns each. Turn k's prompt is the
conversation so far (every earlier prompt and answer) plus ``--user-tokens`` new tokens; the
answer is ``--output-tokens`` greedy tokens. Turns are issued round-robin over the
conversations (c0t0, c1t0, ..., c0t1, ...) with ``--concurrency`` requests in flight, so
between two turns of one conversation the others' turns push its history out of a small
device pool (``--num-gpu-blocks``). With offloading the evicted blocks wait on the host and
come back as host hits.

Printed per mode: prefix hit rate (hit tokens / prompt tokens, device + host), host hits,
TTFT mean / p50 / p99, throughput (prompt + output tokens / wall second), preemptions (with
``--concurrency`` high enough to overrun the pool) and the host-tier tokens their resumes
loaded or recomputed by the start-up cost probe's choice, and with offloading the in-workload copy rate (bytes copied / host seconds spent in the copy calls,
which on a busy CPU includes waiting for the step the copy is queued behind), then the copy
bandwidth of one isolated batched copy each way.

``--async-scheduling both`` (the default) runs each mode with async scheduling on and off
(four engines, runs interleaved: off/on with async, then off/on without, per repeat) and
prints one table per loop, with the box's 1-minute load average around each run.

Run:  .venv/bin/python benchmarks/bench_kv_offload.py [--repeats 3] [--async-scheduling both]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import jax
import numpy as np

from jaxserve.config import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.model import default_model_path
from jaxserve.sampling_params import SamplingParams


def make_engine(args, offload_gib: float, async_scheduling: bool = True) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(
            model=args.model,
            dtype=args.dtype,
            load_format=args.load_format,
            attention_backend=args.attention_backend,
            num_gpu_blocks_override=args.num_gpu_blocks,
            kv_offloading_size=offload_gib,
            max_num_batched_tokens=args.budget,
            token_buckets=args.token_buckets,
            max_num_seqs=args.concurrency,
            max_model_len=1024,
            async_scheduling=async_scheduling,
        )
    )


def run_workload(engine: LLMEngine, args, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    history = [[1] for _ in range(args.conversations)]
    order = [(t, c) for t in range(args.turns) for c in range(args.conversations)]
    arrival: dict[str, float] = {}
    ttft: list[float] = []
    in_flight: set[str] = set()
    prompt_tokens = output_tokens = cached = 0
    stats0 = engine.get_stats()
    host_kv = engine.runner.host_kv
    copies0 = dataclasses.replace(host_kv.timing) if host_kv is not None else None
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    while order or in_flight:
        while order and len(in_flight) < args.concurrency:
            turn, conv = order.pop(0)
            user = rng.integers(3, 4000, size=args.user_tokens).tolist()
            prompt = history[conv] + user
            history[conv] = prompt
            rid = f"c{conv}t{turn}"
            arrival[rid] = time.perf_counter()
            engine.add_request(rid, prompt, params)
            in_flight.add(rid)
            prompt_tokens += len(prompt)
        for out in engine.step():
            rid = out.request_id
            if rid in arrival:
                ttft.append(time.perf_counter() - arrival.pop(rid))
            if out.finished:
                in_flight.discard(rid)
                tokens = out.outputs[0].token_ids
                output_tokens += len(tokens)
                cached += out.num_cached_tokens
                history[int(rid[1 : rid.index("t")])] += list(tokens)
    wall = time.perf_counter() - t0
    st = engine.get_stats()
    ttft.sort()
    res = {
        "hit_rate": cached / prompt_tokens,
        "host_hit_tokens": st.host_cache_hits_total - stats0.host_cache_hits_total,
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft),
        "ttft_p50_ms": 1e3 * ttft[len(ttft) // 2],
        "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "tok_s": (prompt_tokens + output_tokens) / wall,
        "preemptions": st.num_preemptions_total - stats0.num_preemptions_total,
        "resumed_loaded": st.kv_offload_resumed_loaded_tokens_total
        - stats0.kv_offload_resumed_loaded_tokens_total,
        "resumed_recomputed": st.kv_offload_resumed_recomputed_tokens_total
        - stats0.kv_offload_resumed_recomputed_tokens_total,
        "prompt_tokens": prompt_tokens,
        "load_avg": (load0 + os.getloadavg()[0]) / 2,
    }
    if host_kv is not None:
        t, t0c = host_kv.timing, copies0
        blocks = t.saved_blocks + t.loaded_blocks - t0c.saved_blocks - t0c.loaded_blocks
        seconds = t.save_s + t.load_s - t0c.save_s - t0c.load_s
        copied = blocks * host_kv.block_bytes
        res["copy_rate_GBps"] = copied / 1e9 / max(seconds, 1e-9)
        res["copied_MB"] = copied / 1e6
    return res


def copy_bandwidth(engine: LLMEngine, num_blocks: int) -> tuple[float, float]:
    """(device -> host, host -> device) GB/s of one batched copy of ``num_blocks`` blocks
    through the runner's own gather / scatter (blocks 1..n copied out and written back
    unchanged), medians of 5, each waited for."""
    from jaxserve.worker.kv_offload import _gather, _padded, _scatter

    runner = engine.runner
    host_kv = runner.host_kv
    ids = _padded(list(range(1, num_blocks + 1)))
    nbytes = len(ids) * host_kv.block_bytes
    d2h, h2d = [], []
    for _ in range(6):
        t0 = time.perf_counter()
        rows = np.asarray(_gather(runner.kv_caches, ids))
        t1 = time.perf_counter()
        runner.kv_caches = _scatter(runner.kv_caches, ids, rows)
        jax.block_until_ready(runner.kv_caches)
        t2 = time.perf_counter()
        d2h.append(t1 - t0)
        h2d.append(t2 - t1)
    return nbytes / 1e9 / statistics.median(d2h[1:]), nbytes / 1e9 / statistics.median(h2d[1:])


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights (8B shapes)")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--num-gpu-blocks", type=int, default=33, help="device pool, blocks of 16")
    ap.add_argument("--offload-gib", type=float, default=0.05)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--token-buckets", default="16,32,64,128,256")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved off/on runs")
    ap.add_argument(
        "--async-scheduling",
        choices=["on", "off", "both"],
        default="both",
        help="the engine loop: async scheduling on, off, or both (interleaved)",
    )
    args = ap.parse_args()
    loops = {"on": [True], "off": [False], "both": [True, False]}[args.async_scheduling]
    engines = {
        (loop, mode): make_engine(args, gib, loop)
        for loop in loops
        for mode, gib in (("off", 0.0), ("on", args.offload_gib))
    }
    working_set = args.conversations * (1 + args.turns * (args.user_tokens + args.output_tokens))
    pool = (args.num_gpu_blocks - 1) * 16
    on_engine = engines[loops[0], "on"]
    print(
        f"working set {working_set} tokens over a device pool of {pool} tokens "
        f"({working_set / pool:.1f}x); host tier {on_engine.config.cache.num_host_blocks} blocks"
    )
    cache = on_engine.config.cache
    print(
        f"resume cost probe: load {cache.offload_load_s_per_call * 1e6:.1f} us per call + "
        f"{cache.offload_load_s_per_block * 1e6:.1f} us per block, recompute "
        f"{cache.offload_recompute_s_per_token * 1e6:.2f} us per token; copies staged through "
        f"{on_engine.runner.host_kv.memory_kind or 'numpy'}"
    )
    results: dict[tuple, list[dict]] = {key: [] for key in engines}
    for rep in range(args.repeats):
        for key, engine in engines.items():
            engine.scheduler.kv_cache_manager.reset_prefix_cache()
            results[key].append(run_workload(engine, args, seed=rep))
    for loop in loops:
        name = "async scheduling" if loop else "synchronous loop (--no-async-scheduling)"
        print(f"\n{name}")
        keys = list(results[loop, "on"][0])
        print(f"{'metric':>16} " + " ".join(f"{m:>10}" for m in ("off", "on")) + "   (medians)")
        med = {}
        for k in keys:
            row = []
            for mode in ("off", "on"):
                vals = [r[k] for r in results[loop, mode] if k in r]
                med[mode, k] = statistics.median(vals) if vals else float("nan")
                row.append(f"{med[mode, k]:10.3f}")
            print(f"{k:>16} " + " ".join(row))
        off_hits = med["off", "hit_rate"]
        hit_ratio = f"x{med['on', 'hit_rate'] / off_hits:.2f}" if off_hits else "from 0"
        print(
            f"hit rate {hit_ratio}, "
            f"mean TTFT x{med['on', 'ttft_mean_ms'] / med['off', 'ttft_mean_ms']:.2f}, "
            f"throughput x{med['on', 'tok_s'] / med['off', 'tok_s']:.2f} (on / off)"
        )
    n = min(32, args.num_gpu_blocks - 1)
    d2h, h2d = copy_bandwidth(on_engine, n)
    print(
        f"copy bandwidth, one batch of {n} blocks ({on_engine.runner.host_kv.block_bytes} "
        f"bytes each): device -> host {d2h:.2f} GB/s, host -> device {h2d:.2f} GB/s"
    )


if __name__ == "__main__":
    main()
