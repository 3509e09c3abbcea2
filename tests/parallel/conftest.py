"""One run of the tensor-parallel harness per test session, shared by every test here.

JAX fixes the device count when it first initialises, and the rest of the suite assumes one
device, so the multi-device engines run in subprocesses (``tp_harness.py``) with simulated CPU
devices; two of them run at once (the models split between them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tp_harness import GEMMA_MODELS, GEMMA_TP_SIZES, HERE, REPO, TP_SIZES, subprocess_env


def _harness(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "tp_harness.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )


def _collect(proc: subprocess.Popen, timeout: float) -> list[dict]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"harness failed ({proc.returncode}):\n{err[-4000:]}"
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture(scope="session")
def tp_results() -> dict[tuple[str, int, str], dict]:
    """``{(model, tp, backend): result}`` of ``tp_harness.run`` for the bundled model and every
    fixture at TP 1/2/4/8 (xla attention), the Gemma fixtures at TP 1/2/4, qwen3 at TP 2 with
    the Pallas GPU kernel (interpreted on CPU), keyed "pallas", and the bundled model at TP 2
    speculating with its draft model (K = 3), keyed "spec"."""
    sizes = ",".join(map(str, TP_SIZES))
    procs = [
        (
            # TP 3 splits neither model's heads: the refusal is checked too (no compile).
            _harness(
                "--devices", "8", "--tp", sizes + ",3", "--model", "bundled", "--model", "llama"
            ),
            "xla",
        ),
        (
            _harness(
                "--devices",
                "8",
                "--tp",
                sizes,
                "--model",
                "qwen2",
                "--model",
                "qwen3",
                "--model",
                "mistral",
            ),
            "xla",
        ),
    ]
    gemma = ["--tp", ",".join(map(str, GEMMA_TP_SIZES))]
    for name in GEMMA_MODELS:
        gemma += ["--model", name]
    procs.append((_harness("--devices", "4", *gemma), "xla"))
    pallas = _harness(
        "--devices",
        "2",
        "--tp",
        "2",
        "--model",
        "qwen3",
        "--backend",
        "pallas-gpu",
        "--max-tokens",
        "4",
    )
    draft = os.path.join(REPO, "jaxserve", "checkpoints", "tiny-llama-draft")
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    speculating = _harness(
        "--devices", "2", "--tp", "2", "--model", "bundled",
        "--speculative-config", json.dumps(spec),
    )  # fmt: skip
    results = {}
    for proc, backend in procs:
        for r in _collect(proc, timeout=900):
            results[(r["model"], r["tp"], backend)] = r
    for r in _collect(pallas, timeout=900):
        results[(r["model"], r["tp"], "pallas")] = r
    for r in _collect(speculating, timeout=900):
        results[(r["model"], r["tp"], "spec")] = r
    return results
