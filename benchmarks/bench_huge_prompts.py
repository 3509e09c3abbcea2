"""#38's "8 huge prompts" case: a small request's latency alone and beside eight 15.7 MB prompts
that the server refuses (400), against tests/entrypoints/fake_serve.py (the fake engine: the cost
measured is the server's, not a model's) started in a subprocess from the current directory's
checkout; the client runs in this process.

    .venv/bin/python benchmarks/bench_huge_prompts.py [--reps N] [--delay S] [--throughout] [--huge-in-subprocess]

Prints the small request's latencies alone and beside (the eight start ``--delay`` s before it,
0.3 by default), the time the eight take to be refused, and the ratios of the fastest and of the
medians. ``--throughout`` times small requests one after another from then until the eight
end (every moment of their refusal, not one: with the eight refused in 0.3 s a single request at
+0.3 s may miss them). ``--huge-in-subprocess`` sends the eight from another process, so that the event loop
timing the small request does not also push their 126 MB (the first form sends everything from
one loop: the client's own sending is then in the small request's time). For a before/after
comparison run it from two checkouts alternately (cwd and PYTHONPATH the checkout).
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
import threading
import time

import httpx2 as httpx

SMALL = {"prompt": "Once upon a time", "max_tokens": 8}
HUGE = json.dumps({"prompt": "word " * (15_700_000 // 5), "max_tokens": 4}).encode()


def start_server() -> tuple[subprocess.Popen, str]:
    """fake_serve.py on a free port; returns the process and its URL."""
    proc = subprocess.Popen(
        [sys.executable, "tests/entrypoints/fake_serve.py", "--port", "0", "--step-s", "0.002"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"on (http://\S+)", line)
        if match:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep it drained
            return proc, match.group(1)
    raise RuntimeError("fake_serve.py did not start")


async def timed(client: httpx.AsyncClient, **kwargs) -> tuple[float, int]:
    start = time.perf_counter()
    r = await client.post("/v1/completions", **kwargs)
    return time.perf_counter() - start, r.status_code


async def send_huge(url: str) -> list[tuple[float, int]]:
    """The eight, at once, each on its own connection: (seconds, status) of each."""
    headers = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        tasks = [
            asyncio.create_task(timed(client, content=HUGE, headers=headers)) for _ in range(8)
        ]
        return await asyncio.gather(*tasks)


async def huge_in_subprocess(url: str, started: asyncio.Event) -> list[tuple[float, int]]:
    """The eight from a child process; ``started`` is set once it begins sending them."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--send-huge", url, stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    await proc.stdout.readline()  # "sending"
    started.set()
    out, _ = await proc.communicate()
    return [tuple(r) for r in json.loads(out)]


async def measure(
    url: str, reps: int, delay: float, subprocess_sender: bool, throughout: bool
) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await timed(client, json=SMALL)  # warm-up
        alone, beside, huge_s, statuses = [], [], [], set()
        for _ in range(reps):
            alone.append((await timed(client, json=SMALL))[0])
            started = asyncio.Event()
            if subprocess_sender:
                task = asyncio.create_task(huge_in_subprocess(url, started))
                await started.wait()
            else:
                task = asyncio.create_task(send_huge(url))
            await asyncio.sleep(delay)  # the eight are being sent, received and parsed
            beside.append((await timed(client, json=SMALL))[0])
            while throughout and not task.done():  # one after another until the eight end
                beside.append((await timed(client, json=SMALL))[0])
            results = await task
            huge_s.append(max(s for s, _ in results))
            statuses |= {status for _, status in results}
    print(f"small alone {[round(x, 3) for x in alone]} s, beside {[round(x, 3) for x in beside]} s")
    print(f"eight huge refused in {[round(x, 2) for x in huge_s]} s (statuses {sorted(statuses)})")
    print(
        f"ratio beside / alone: of the fastest {min(beside) / min(alone):.2f}, "
        f"of the medians {statistics.median(beside) / statistics.median(alone):.2f}, "
        f"of the slowest beside to the median alone {max(beside) / statistics.median(alone):.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.3, help="seconds after the eight start")
    parser.add_argument("--huge-in-subprocess", action="store_true")
    parser.add_argument(
        "--throughout",
        action="store_true",
        help="time small requests one after another until the eight end (not only one)",
    )
    parser.add_argument("--send-huge", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.send_huge:  # the --huge-in-subprocess sender
        print("sending", flush=True)
        print(json.dumps(asyncio.run(send_huge(args.send_huge))))
        return
    proc, url = start_server()
    try:
        asyncio.run(measure(url, args.reps, args.delay, args.huge_in_subprocess, args.throughout))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
