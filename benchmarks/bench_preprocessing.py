"""Request preprocessing beside other requests (#38 deliverable 1): a small request's latency
alone and beside the worst allowed case of each feature whose preprocessing grows with the
request (bad words, allowed token ids, logit bias, stop strings, a costly regex, 16k choices,
50 tool schemas, the longest prompt the byte bound lets through), as a ratio of medians
measured interleaved in one run; "plain" is the control (a request of the same size without the
feature). "bad_words_n128" / "plain_n128" are F1's per-step case (n = 128 with 500 bad words
and without); "worst ms" is that request's own latency. The cases and the measurement live in
tests/entrypoints/preprocessing_cases.py, which the tests share.

    .venv/bin/python benchmarks/bench_preprocessing.py [--reps 5] [--cases bad_words,regex]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "entrypoints"))

import httpx2 as httpx  # noqa: E402
from preprocessing_cases import CASES, N128_CASES, measure_ratio  # noqa: E402
from server_harness import running_server, small_engine_args  # noqa: E402

from jaxserve.entrypoints.http.api_server import SERVING  # noqa: E402


async def _run(url: str, cases: list[str], reps: int, max_prompt_bytes: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        print(
            f"{'case':<18} {'alone ms':>9} {'beside ms':>10} {'ratio':>6} {'status':>7} "
            f"{'worst ms':>9}"
        )
        for name in cases:
            r = await measure_ratio(client, name, max_prompt_bytes, reps)
            print(
                f"{name:<18} {1e3 * r.alone_s:9.1f} {1e3 * r.beside_s:10.1f} "
                f"{r.ratio:6.2f} {r.worst_status:7d} {1e3 * r.worst_s:9.1f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="timed rounds per case")
    parser.add_argument(
        "--cases", default=",".join(CASES + N128_CASES), help="comma-separated case names"
    )
    args = parser.parse_args()
    engine_args = small_engine_args(
        num_gpu_blocks_override=256,
        max_num_seqs=128,
        max_num_batched_tokens=256,
        token_buckets="16,64,256",
    )
    with running_server(engine_args) as srv:
        max_prompt_bytes = srv.app[SERVING].info.max_prompt_bytes
        print(
            f"server {srv.url}: small_engine_args (128 seqs, 256-token budget), "
            f"max_prompt_bytes {max_prompt_bytes}"
        )
        asyncio.run(_run(srv.url, args.cases.split(","), args.reps, max_prompt_bytes))


if __name__ == "__main__":
    main()
