"""The server's CPU per streamed token without a model: the serving layer's per-token cost.

Runs ``jaxserve serve``'s code over the scripted engine of the server tests
(``tests/entrypoints/fake_serve.py``: the real tokenizer, detokenizer, AsyncLLM, serving layer,
SSE writer and aiohttp; a model that costs nothing), streams ``--num-requests`` completions of
``--max-tokens`` tokens, ``--concurrency`` at a time, and reads the server process's CPU time
(user + system, ``/proc/PID/stat``) over the run: CPU microseconds per streamed token, a figure
that other processes on the machine do not inflate (the client runs in this process).

``--trees A B`` runs the same server code from two checkouts (``PYTHONPATH``), alternating
them ``--rounds`` times, and prints each one's median and B / A: a before/after comparison on
one machine at one time (``git archive BASE | tar -x -C /tmp/base`` makes the other tree).

  .venv/bin/python benchmarks/bench_serve_stream.py --trees /tmp/base . --rounds 5

The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trees",
        nargs="+",
        default=[os.path.join(HERE, "..")],
        help="checkouts whose server code to run (default: this one)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs per tree, interleaved")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens per request")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--chat", action="store_true", help="stream chat completions instead")
    return parser.parse_args(argv)


def _cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds (``/proc/PID/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream(session: aiohttp.ClientSession, url: str, body: dict) -> int:
    """Sends one streamed request (``ignore_eos``: it streams exactly ``max_tokens`` tokens);
    returns its tokens once it ended with ``[DONE]``."""
    last = b""
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.strip():
                last = line
    assert last.strip() == b"data: [DONE]", last
    return body["max_tokens"]


async def _load(base_url: str, args: argparse.Namespace) -> tuple[int, float]:
    path, extra = (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story."}]})
        if args.chat
        else ("/v1/completions", {"prompt": "Once upon a time"})
    )
    body = {**extra, "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True}
    gate = asyncio.Semaphore(args.concurrency)

    async def one(session: aiohttp.ClientSession) -> int:
        async with gate:
            return await _stream(session, base_url + path, body)

    start = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        counts = await asyncio.gather(*(one(session) for _ in range(args.num_requests)))
    return sum(counts), time.perf_counter() - start


def run_once(tree: str, args: argparse.Namespace) -> dict:
    """Starts the scripted server from ``tree``, warms it up, measures one load."""
    tree = os.path.abspath(tree)
    env = {**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": "cpu"}
    server = subprocess.Popen(
        [sys.executable, os.path.join(tree, "tests/entrypoints/fake_serve.py"), "--port", "0"]
        + ["--step-s", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = server.stdout.readline()
        match = re.search(r"http://\S+", line)
        if match is None:
            raise RuntimeError(f"the server in {tree} did not start: {line!r}")
        base_url = match.group(0)
        warm = argparse.Namespace(**{**vars(args), "num_requests": args.concurrency})
        asyncio.run(_load(base_url, warm))
        cpu0 = _cpu_s(server.pid)
        tokens, wall = asyncio.run(_load(base_url, args))
        cpu = _cpu_s(server.pid) - cpu0
    finally:
        server.terminate()
        server.wait(30)
    return {
        "tree": tree,
        "tokens": tokens,
        "server_cpu_us_per_token": cpu / tokens * 1e6,
        "tokens_per_s": tokens / wall,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs: dict[str, list[dict]] = {os.path.abspath(t): [] for t in args.trees}
    for r in range(args.rounds):
        for tree in runs:
            result = run_once(tree, args)
            runs[tree].append(result)
            print(
                f"round {r + 1} {tree}: {result['server_cpu_us_per_token']:.1f} us CPU / token, "
                f"{result['tokens_per_s']:.0f} tokens/s ({result['tokens']} tokens)",
                flush=True,
            )
    summary = {
        tree: {
            "median_server_cpu_us_per_token": statistics.median(
                x["server_cpu_us_per_token"] for x in results
            ),
            "median_tokens_per_s": statistics.median(x["tokens_per_s"] for x in results),
        }
        for tree, results in runs.items()
    }
    trees = list(summary)
    if len(trees) == 2:
        a, b = (summary[t]["median_server_cpu_us_per_token"] for t in trees)
        summary["cpu_ratio_second_over_first"] = b / a
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
