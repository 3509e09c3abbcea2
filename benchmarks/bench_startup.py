"""Start-up time of `jaxserve serve`: seconds from launch until it prints "serving", per run.

The first run may compile (cold persistent cache); later runs are warm restarts, the figure the
README quotes. Each run's own start-up report (load, KV sizing, compile/warm-up) is printed too.

    python benchmarks/bench_startup.py --runs 3                 # default flags, the bundled model
    python benchmarks/bench_startup.py --runs 2 -- smollm2 --max-num-batched-tokens 256
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time


def one_start(serve_args: list[str]) -> tuple[float, list[str]]:
    """Seconds until "serving ..." and the lines printed before it (stdout + stderr)."""
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", *serve_args]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(f"{time.monotonic() - t0:7.1f}s  {line.rstrip()}")
            if line.startswith("serving "):
                return time.monotonic() - t0, lines
        raise RuntimeError("serve exited before serving:\n" + "\n".join(lines))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("serve_args", nargs="*", help="after --: MODEL and flags for jaxserve serve")
    args = ap.parse_args()
    times = []
    for i in range(args.runs):
        seconds, lines = one_start(args.serve_args)
        times.append(seconds)
        keep = [ln for ln in lines if "bucket" not in ln or "warm-up:" in ln]
        print(f"--- run {i + 1}: {seconds:.1f} s to serving\n" + "\n".join(keep[-8:]))
    print(f"load average (1 min): {os.getloadavg()[0]:.1f}")
    print(
        f"time to serving, s: {[round(t, 1) for t in times]}; warm median (runs 2..): "
        f"{statistics.median(times[1:]) if len(times) > 1 else float('nan'):.1f}"
    )


if __name__ == "__main__":
    main()
