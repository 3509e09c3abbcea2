"""The ``jaxserve`` console script: every subcommand is reachable, and ``generate`` prints the
bundled model's greedy continuation (the issue's first runnable command)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxserve.cli import COMMANDS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_every_subcommand():
    out = _run("--help")
    assert out.returncode == 0, out.stderr
    for name in ("serve", "generate", "run-batch", "convert", "bench"):
        assert name in COMMANDS
        assert name in out.stdout


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_subcommand_has_its_own_help(name):
    out = _run(name, "--help")
    assert out.returncode == 0, out.stderr
    assert f"jaxserve {name}" in out.stdout


def test_generate_prints_the_dense_greedy_continuation():
    from jaxserve.model import default_model_path
    from jaxserve.model.loader import load_model
    from jaxserve.reference_generate import generate_dense
    from jaxserve.tokenizer import get_tokenizer

    path = str(default_model_path())
    model, _, _ = load_model(path)
    tok = get_tokenizer(path)
    ids = generate_dense(model, tok.encode("The king said"), 12, eos_token_ids=[tok.eos_token_id])
    expected = tok.decode(ids)
    assert expected.strip(), "the bundled model should write some text"

    out = _run("generate", "The king said", "--max-tokens", "12")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected.strip()


def test_generate_names_a_missing_model_directory(tmp_path):
    missing = tmp_path / "no-such-model"
    out = _run("generate", "hi", "--max-tokens", "2", "--model", str(missing))
    assert out.returncode == 2
    assert out.stderr.strip() == f"jaxserve generate: error: model directory not found: {missing}"


def test_serve_rejects_a_bad_flag_value_by_name():
    out = _run("serve", "--max-num-seqs", "0")
    assert out.returncode == 2
    assert "max_num_seqs" in out.stderr and "Traceback" not in out.stderr
