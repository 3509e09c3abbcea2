"""#38's "8 huge prompts" case: a small request's latency alone and beside eight 15.7 MB prompts
that the server refuses (400), against tests/entrypoints/fake_serve.py (the fake engine: the cost
measured is the server's, not a model's) started in a subprocess from the current directory's
checkout; the client runs in this process.

    .venv/bin/python benchmarks/bench_huge_prompts.py [--reps N]

Prints the small request's latencies alone and beside (the eight start 0.3 s before it), the
time the eight take to be refused, and the ratios of the fastest and of the medians. For a
before/after comparison run it from two checkouts alternately (cwd and PYTHONPATH the checkout).
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


async def measure(url: str, reps: int) -> None:
    headers = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await timed(client, json=SMALL)  # warm-up
        alone, beside, huge_s, statuses = [], [], [], set()
        for _ in range(reps):
            alone.append((await timed(client, json=SMALL))[0])
            tasks = [
                asyncio.create_task(timed(client, content=HUGE, headers=headers)) for _ in range(8)
            ]
            await asyncio.sleep(0.3)  # the eight are being received and parsed
            beside.append((await timed(client, json=SMALL))[0])
            results = await asyncio.gather(*tasks)
            huge_s.append(max(s for s, _ in results))
            statuses |= {status for _, status in results}
    print(f"small alone {[round(x, 3) for x in alone]} s, beside {[round(x, 3) for x in beside]} s")
    print(f"eight huge refused in {[round(x, 2) for x in huge_s]} s (statuses {sorted(statuses)})")
    print(
        f"ratio beside / alone: of the fastest {min(beside) / min(alone):.2f}, "
        f"of the medians {statistics.median(beside) / statistics.median(alone):.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    proc, url = start_server()
    try:
        asyncio.run(measure(url, args.reps))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
