"""LoRA under tensor parallelism (#33): TP 2 and 4 (simulated CPU devices, one subprocess)
give the mixed-adapter batch the tokens transformers + peft give, with the adapters' B pools
sharded like their base layers (q_proj's heads split over the mesh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.join(HERE, "..", "..")
GOLDEN = np.load(os.path.join(HERE, "..", "fixtures", "lora", "golden.npz"))


@pytest.mark.slow
def test_tensor_parallel_2_and_4_match_peft_with_sharded_adapters():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.path.abspath(REPO))
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "lora_tp_harness.py"), "--tp", "2,4"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["tp"] for r in results] == [2, 4]
    for r in results:
        for k, (name, tokens, lps) in enumerate(zip(r["names"], r["tokens"], r["logprobs"])):
            key = name or "base"
            assert tokens == GOLDEN[f"{key}_tokens_{k % 3}"].tolist(), (r["tp"], name, k)
            np.testing.assert_allclose(lps, GOLDEN[f"{key}_logprobs_{k % 3}"], atol=1e-4)
        # [slots, rank, heads, head_dim]: heads split over the mesh, like q_proj's weight
        assert r["lora_b"] == [2, 8, 4, 16] and r["lora_b_shard"] == [2, 8, 4 // r["tp"], 16]
