"""Sharded, streamed loading (``load_model(..., tensor_parallel_size=N)``,
``jaxserve.model.sharded_loader``) on simulated CPU devices, for every family's golden fixture:
the parameters equal the whole load placed by ``place_model`` (KV heads replicated at TP 4, query
heads too at TP 8), no process reads a whole tensor of a parameter it holds only a slice of, and
our orbax layout (``jaxserve convert``, on one device or two) restores into meshes of TP 1/2/4
equal to the safetensors load."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
GOLDEN = os.path.join(HERE, "..", "fixtures", "golden")
FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
)
TP = {name: (1, 2, 4) for name in FAMILIES} | {"llama": (1, 2, 4, 8)}
ORBAX = ("llama", "qwen3_moe")
ORBAX_WRITERS = ("llama", "qwen3_moe@2")  # qwen3_moe converted on 2 devices, each writing shards

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str, int], dict]:
    args = [sys.executable, os.path.join(HERE, "sharded_load_harness.py"), "--devices", "8"]
    for name in FAMILIES:
        args += ["--model", os.path.join(GOLDEN, name) + "@" + ",".join(map(str, TP[name]))]
    for name in ORBAX_WRITERS:
        args += ["--orbax", name]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {(r["model"], r["format"], r["tp"]): r for r in lines}


CASES = [(name, tp) for name in FAMILIES for tp in TP[name]]


@pytest.mark.slow
@pytest.mark.parametrize("model,tp", CASES)
def test_sharded_load_equals_whole_load_placed(results, model, tp):
    r = results[(model, "safetensors", tp)]
    assert r["not_equal"] == []
    assert r["same_placement"]


@pytest.mark.slow
@pytest.mark.parametrize("model,tp", [c for c in CASES if c[1] > 1])
def test_no_process_reads_a_whole_tensor_it_holds_a_slice_of(results, model, tp):
    r = results[(model, "safetensors", tp)]
    assert r["split_tensors"] > 0  # the instrument saw the split parameters' tensors
    assert r["whole_reads_of_split_tensors"] == []
    assert 0 < r["largest_read_fraction_of_split_tensor"] <= 0.5


@pytest.mark.slow
@pytest.mark.parametrize("model,tp", [(m, tp) for m in ORBAX for tp in (1, 2, 4)])
def test_orbax_restore_equals_safetensors_load(results, model, tp):
    r = results[(model, "orbax", tp)]
    assert r["not_equal"] == []
    assert r["same_placement"]


def test_progress_line_shows_gb_and_gb_per_second():
    import io

    from jaxserve.model.sharded_loader import LoadProgress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    progress = LoadProgress(3_000_000_000, stream=out)
    progress.last_shown -= 1  # as if half a second had passed since the last line
    progress.update(1_500_000_000)
    progress.close()
    lines = out.getvalue().replace("\r", "\n").split()
    text = " ".join(lines)
    assert "loading weights: 1.50/3.00 GB (" in text and "GB/s)" in text
    quiet = io.StringIO()  # not a terminal: nothing printed (the total is logged)
    LoadProgress(10, stream=quiet).update(10)
    assert quiet.getvalue() == ""
