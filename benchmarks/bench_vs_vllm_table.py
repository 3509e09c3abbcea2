"""The table of ``benchmarks/bench_vs_vllm.sh``: per cell, the medians over the reps of each
metric for vLLM and jaxserve and their ratio (jaxserve / vLLM), as a Markdown table.

Reads ``OUT_DIR/{vllm,js}__CELL_rN.json`` (``vllm bench serve`` results) beside ``.cpu`` (server
CPU seconds during the run) and ``.rss`` (the server's peak RSS during the run, KiB) files. A
cell ending in ``_c1``, ``_c16`` or ``_single`` also gets the TTFT p99 target; every cell gets
the output tok/s (>= 1.0) and mean e2e (<= 1.0) targets, single requests TTFT and TPOT (<= 1.0).
A run whose requests all failed counts as missing. A ratio over a vLLM figure of 0 (its TPOT when a request's tokens all arrive in the first chunk)
is n/a.

  python3 benchmarks/bench_vs_vllm_table.py OUT_DIR
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys

# (column, result key or file suffix, higher is better)
METRICS = (
    ("output tok/s", "output_throughput", True),
    ("mean e2e ms", "mean_e2el_ms", False),
    ("TTFT p99 ms", "p99_ttft_ms", False),
    ("TPOT median ms", "median_tpot_ms", False),
    ("server CPU s", ".cpu", False),
    ("peak RSS MiB", ".rss", False),
)


def load(out: str) -> dict[str, dict[str, dict[int, dict]]]:
    """{cell: {server: {rep: {metric key: value}}}}."""
    runs: dict = {}
    for path in glob.glob(os.path.join(out, "*__*_r*.json")):
        m = re.match(r"(vllm|js)__(.+)_r(\d+)\.json$", os.path.basename(path))
        if not m:
            continue
        server, cell, rep = m.group(1), m.group(2), int(m.group(3))
        with open(path) as f:
            row = json.load(f)
        if not row.get("completed"):
            continue  # every request failed (e.g. the server died): no figures
        stem = path[: -len(".json")]
        for suffix, scale in ((".cpu", 1.0), (".rss", 1 / 1024)):
            if os.path.exists(stem + suffix):
                with open(stem + suffix) as f:
                    text = f.read().strip()
                if text:
                    row[suffix] = float(text) * scale
        runs.setdefault(cell, {}).setdefault(server, {})[rep] = row
    return runs


def targets(cell: str) -> dict[str, bool]:
    """Column -> whether a ratio above 1.0 (higher-is-better: below) misses a target."""
    want = {"output tok/s": True, "mean e2e ms": True}
    if cell.endswith(("_c1", "_c16", "_single")):
        want["TTFT p99 ms"] = True
    if cell.endswith("_single"):
        want["TPOT median ms"] = True
    return want


def main(out: str) -> int:
    runs = load(out)
    if not runs:
        print(f"no results in {out}")
        return 1
    print(
        "| cell | reps | "
        + " | ".join(f"{name} (vLLM / jaxserve: ratio)" for name, _, _ in METRICS)
        + " | targets |"
    )
    print("|" + " --- |" * (len(METRICS) + 3))
    order = lambda c: (c.rsplit("_", 1)[0].split("_")[0], int(c.split("_")[1].split("x")[0]), c)  # noqa: E731
    for cell in sorted(runs, key=order):
        v, j = runs[cell].get("vllm", {}), runs[cell].get("js", {})
        reps = sorted(set(v) & set(j))
        cols, missed = [], []
        want = targets(cell)
        for name, key, higher in METRICS:
            a = [v[r][key] for r in reps if key in v[r]]
            b = [j[r][key] for r in reps if key in j[r]]
            if not a or not b:
                cols.append("-")
                continue
            ma, mb = statistics.median(a), statistics.median(b)
            if ma < 0.05:  # vLLM's TPOT is 0 when a request's tokens all came in its first chunk
                cols.append(f"{ma:,.1f} / {mb:,.1f}: n/a")
                continue
            ratio = mb / ma
            cols.append(f"{ma:,.1f} / {mb:,.1f}: **{ratio:.2f}**")
            if name in want and (ratio < 1.0 if higher else ratio > 1.0):
                missed.append(name)
        verdict = "met" if not missed else "missed: " + ", ".join(missed)
        if not reps:
            verdict = "no data (a server's run is missing)"
        print(f"| {cell} | {len(reps)} | " + " | ".join(cols) + f" | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
