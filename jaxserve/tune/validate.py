"""Predicted vs measured: one trace replayed by the tuner and sent to a live server.

``bench_serve_preset`` runs the ``jaxserve bench serve`` command in a subprocess for a preset
trace (the same requests: built from the same preset, sizes and seed, so the same prompts and
Poisson send times). A subprocess, because a client in the server's process competes with it
for the GIL while parsing its streams, and the measured run is then slower than the server
alone (1.4-1.9x on a 2-core box). ``compare`` puts the prediction beside the result
(throughput, TTFT and TPOT p50, relative errors).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from jaxserve.tune.simulate import SimResult


def bench_serve_preset(
    base_url: str, preset: str, seed: int, overrides: dict[str, Any]
) -> dict[str, Any]:
    """One ``jaxserve bench serve --preset PRESET --seed SEED --<override> ...`` run in a
    subprocess (``preset_trace(preset, seed=seed, **overrides)`` sends the same requests);
    returns its result JSON.

    Raises:
      subprocess.CalledProcessError: the command failed (its stderr is passed through).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [sys.executable, "-m", "jaxserve.cli", "bench", "serve", "--base-url", base_url]
        cmd += ["--preset", preset, "--seed", str(seed), "--percentiles", "50,99"]
        for key, value in overrides.items():
            cmd += ["--" + key.replace("_", "-"), str(value)]
        subprocess.run([*cmd, "--result-file", out], check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def compare(name: str, predicted: SimResult, measured: dict[str, Any]) -> dict[str, Any]:
    """One row: predicted and measured output throughput (tok/s) and TTFT p50 (ms), and the
    relative error of each ((predicted - measured) / measured)."""
    p = predicted.summary()
    row = {
        "workload": name,
        "pred_output_throughput": p["output_throughput"],
        "meas_output_throughput": round(measured["output_throughput"], 3),
        "pred_ttft_ms_p50": p["ttft_ms_p50"],
        "meas_ttft_ms_p50": round(measured["median_ttft_ms"], 3),
        "pred_tpot_ms_p50": p["tpot_ms_p50"],
        "meas_tpot_ms_p50": round(measured["median_tpot_ms"], 3),
    }
    for key in ("output_throughput", "ttft_ms_p50", "tpot_ms_p50"):
        pred, meas = row[f"pred_{key}"], row[f"meas_{key}"]
        row[f"err_{key}"] = None if not meas or pred is None else round((pred - meas) / meas, 4)
    return row
