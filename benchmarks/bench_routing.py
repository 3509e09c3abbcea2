"""Routing policies over data-parallel replicas on Ray: prefix-cache hit rate and TTFT.

Starts N replicas of the bundled model on a local Ray cluster and the ingress in this process,
then replays one shared-prefix workload per policy (``--num-prefixes`` system prompts of
``--prefix-len`` tokens, each request one of them, drawn at random, then ``--input-len`` unique
tokens; streamed, ``--max-concurrency`` in flight) and prints, per policy, the prefix-cache hit
rate over all replicas (growth of ``prefix_cache_hits_total`` / ``prefix_cache_queries_total``
in the ingress's merged ``/metrics``), mean and median TTFT, and the run's wall time. Each
policy's run uses its own ``cache_salt``, so no run hits blocks an earlier run cached.

The KV pool per replica (``--num-gpu-blocks``) is what makes routing matter: prefix-aware
routing's gain is the cache capacity it multiplies. With the defaults a replica holds about 4
of the 8 prefixes: enough for the half that prefix-aware routing sends it, not for all 8 that
round-robin sends every replica. (With pools that hold every prefix, all policies hit alike.)

  .venv/bin/python benchmarks/bench_routing.py      # 2 replicas, 8 x 512-token prefixes, 400 requests

The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402
from aiohttp import web  # noqa: E402

from jaxserve.bench.client import completion_payload, send_completion  # noqa: E402
from jaxserve.bench.metrics_scrape import fetch_snapshot  # noqa: E402
from jaxserve.bench.workloads import TokenSource, WorkloadSpec, make_requests  # noqa: E402
from jaxserve.config import EngineArgs  # noqa: E402
from jaxserve.entrypoints.http.ray_ingress import make_ingress  # noqa: E402
from jaxserve.entrypoints.ray_serve import start_replicas  # noqa: E402
from jaxserve.entrypoints.router import POLICIES, Router  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, run in order")
    p.add_argument("--num-prompts", type=int, default=400)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--input-len", type=int, default=32, help="unique tokens after the prefix")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument(
        "--num-gpu-blocks", type=int, default=161, help="KV blocks per replica (16 tokens)"
    )
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--token-buckets", default="16,64,256")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


async def run_policy(url, model, requests, policy, salt, max_concurrency):
    """Sends ``requests`` through the ingress; returns (hit rate, TTFTs, wall seconds, errors)."""
    sem = asyncio.Semaphore(max_concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        before = await fetch_snapshot(session, url + "/metrics")

        async def one(req):
            async with sem:
                payload = completion_payload(model, req, extra_body={"cache_salt": salt})
                return await send_completion(session, url + "/v1/completions", payload, req)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in requests))
        wall = time.perf_counter() - t0
        after = None
        for _ in range(30):  # a replica restarting (it should not) answers no metrics for a while
            after = await fetch_snapshot(session, url + "/metrics")
            if after and after["prefix_cache_hits"] is not None:
                break
            await asyncio.sleep(2)
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    ttfts = [r.ttft for r in results if r.success]
    errors = [r.error for r in results if not r.success]
    return hits / max(queries, 1), ttfts, wall, errors


async def main_async(args, ingress, model, requests) -> list[dict]:
    runner = web.AppRunner(ingress.build_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    rows = []
    try:
        warm = requests[: args.max_concurrency]
        await run_policy(url, model, warm, "round-robin", "warm-up", args.max_concurrency)
        for policy in args.policies.split(","):
            old = ingress.router
            ingress.router = Router(len(old.replicas), policy, old.block_size, old.none_hash)
            for mine, theirs in zip(ingress.router.replicas, old.replicas):
                mine.capacity_blocks = theirs.capacity_blocks
            hit_rate, ttfts, wall, errors = await run_policy(
                url, model, requests, policy, f"{policy}-{args.seed}", args.max_concurrency
            )
            row = {
                "policy": policy,
                "prefix_hit_rate": round(hit_rate, 4),
                "mean_ttft_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
                "median_ttft_s": round(statistics.median(ttfts), 4) if ttfts else None,
                "wall_s": round(wall, 2),
                "errors": len(errors),
            }
            rows.append(row)
            print(
                f"{policy:>13}: hit rate {hit_rate:6.1%}  mean TTFT {row['mean_ttft_s']} s  "
                f"median TTFT {row['median_ttft_s']} s  wall {wall:.1f} s  errors {len(errors)}",
                flush=True,
            )
    finally:
        await runner.cleanup()
    return rows


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    import ray

    from jaxserve.tokenizer import get_tokenizer

    engine_args = EngineArgs(
        dtype="float32",
        max_model_len=args.prefix_len + args.input_len + args.output_len + 16,
        num_gpu_blocks_override=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        token_buckets=args.token_buckets,
        attention_backend="xla",
    )
    t0 = time.perf_counter()
    actors, described = start_replicas(engine_args, args.replicas)
    ingress = make_ingress(actors, described, "round-robin")
    print(f"{args.replicas} replicas ready in {time.perf_counter() - t0:.0f} s", flush=True)
    info = described[0]["info"]
    source = TokenSource.from_tokenizer(get_tokenizer(info.model_path))
    spec = WorkloadSpec(
        kind="shared-prefix",
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        seed=args.seed,
    )
    requests = make_requests(spec, source)
    # The workload cycles through the prefixes (request i has prefix i % num_prefixes), which
    # round-robin over an even number of replicas would turn into perfect affinity: draw the
    # order at random instead, as independent users would arrive.
    order = np.random.default_rng(args.seed).permutation(len(requests))
    requests = [requests[i] for i in order]
    try:
        rows = asyncio.run(main_async(args, ingress, info.model_name, requests))
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        ray.shutdown()
    by = {r["policy"]: r for r in rows}
    summary = {"rows": rows, "config": vars(args)}
    if "prefix-aware" in by and "round-robin" in by and by["round-robin"]["prefix_hit_rate"]:
        summary["hit_rate_ratio_prefix_aware_vs_round_robin"] = round(
            by["prefix-aware"]["prefix_hit_rate"] / by["round-robin"]["prefix_hit_rate"], 2
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
