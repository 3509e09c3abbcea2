"""MoE experts split over simulated CPU devices: expert parallel 2/4/8 (whole experts per
device) and tensor parallel (each expert's width split) give the greedy float32 tokens of one
device, on the harness workload (prefix caching, chunked prefill, preemption). One subprocess
per model (``moe_harness.py``, 8 simulated devices), both at once, for the whole module."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tp_harness import HERE, subprocess_env

# Qwen2-MoE: shared expert, a dense layer, top-4 not renormalised; Mixtral: top-2 renormalised.
RUNS = {
    "qwen2_moe": ("1", "ep2", "ep8", "tp4"),
    "mixtral": ("1", "ep4", "tp8"),
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def moe_results() -> dict[tuple[str, str], dict]:
    """``{(model, run): moe_harness.run result}`` for every entry of ``RUNS``."""
    procs = []
    for model, runs in RUNS.items():
        args = ["--devices", "8", "--model", model]
        for spec in runs:
            args += ["--run", spec]
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, "moe_harness.py"), *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=subprocess_env(),
            )
        )
    results = {}
    for proc in procs:
        out, err = proc.communicate(timeout=1500)
        assert proc.returncode == 0, f"harness failed ({proc.returncode}):\n{err[-4000:]}"
        for line in out.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                results[(r["model"], r["run"])] = r
    return results


@pytest.mark.parametrize(
    "model,run", [(m, r) for m, runs in RUNS.items() for r in runs if r != "1"]
)
def test_greedy_tokens_equal_one_device(moe_results, model, run):
    want = moe_results[(model, "1")]["tokens"]
    assert len(want) == 5 and all(len(t) == 16 for t in want)
    assert moe_results[(model, run)]["tokens"] == want


def test_expert_parallel_splits_experts_and_tensor_parallel_their_width(moe_results):
    # up_proj [E=8, e=64, f=32]: EP keeps f whole and splits E; TP keeps E and splits f.
    assert moe_results[("qwen2_moe", "1")]["placement"]["up_proj_shard"] == [8, 64, 32]
    assert moe_results[("qwen2_moe", "ep2")]["placement"]["up_proj_shard"] == [4, 64, 32]
    assert moe_results[("qwen2_moe", "ep8")]["placement"]["up_proj_shard"] == [1, 64, 32]
    assert moe_results[("qwen2_moe", "tp4")]["placement"]["up_proj_shard"] == [8, 64, 8]
    assert moe_results[("mixtral", "tp8")]["placement"]["up_proj_shard"] == [8, 64, 4]
