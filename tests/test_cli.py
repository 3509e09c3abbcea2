"""The ``jaxserve`` console script: every subcommand is reachable, and ``generate`` prints the
bundled model's greedy continuation (checked against a teacher-forced dense forward)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
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


def test_generate_prints_a_greedy_continuation_of_the_prompt():
    """The printed ids are the prompt's tokens and, position by position, the argmax of one
    teacher-forced dense forward over prompt + output (the CLI decodes incrementally)."""
    import ast

    import numpy as np

    from jaxserve.model import default_model_path
    from jaxserve.model.loader import load_model
    from jaxserve.tokenizer import get_tokenizer

    out = _run("generate", "The king said", "--max-tokens", "12", "--show-token-ids")
    assert out.returncode == 0, out.stderr
    *text_lines, prompt_line, output_line = out.stdout.rstrip("\n").split("\n")
    prompt_ids = ast.literal_eval(prompt_line.removeprefix("prompt_token_ids: "))
    output_ids = ast.literal_eval(output_line.removeprefix("generated_token_ids: "))
    path = str(default_model_path())
    tok = get_tokenizer(path)
    assert prompt_ids == tok.encode("The king said")
    assert 0 < len(output_ids) <= 12
    # echoed: the prompt, then its continuation (#39: only the continuation was printed)
    text = "\n".join(text_lines)
    assert text == tok.decode(prompt_ids + output_ids, skip_special_tokens=True), text
    assert text.startswith("The king said") and text.removeprefix("The king said").strip()
    model, _, _ = load_model(path)
    ids = np.asarray([prompt_ids + output_ids], np.int32)
    logits = np.asarray(model.forward_dense(ids)[0])  # [L, vocab]
    n = len(prompt_ids)
    assert np.argmax(logits[n - 1 : n - 1 + len(output_ids)], axis=-1).tolist() == output_ids


@pytest.mark.parametrize("how", ["positional", "--model"])
def test_generate_names_a_missing_model_directory(tmp_path, how):
    missing = tmp_path / "no-such-model"
    model = [str(missing)] if how == "positional" else ["--model", str(missing)]
    out = _run("generate", "hi", *model, "--max-tokens", "2")
    assert out.returncode == 2
    assert out.stderr.strip() == f"jaxserve generate: error: model directory not found: {missing}"


def _one_line_error(out: subprocess.CompletedProcess, command: str, *needles: str) -> None:
    """A user error: exit 2, one line on stderr naming the problem, no traceback."""
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"jaxserve {command}: error: "), out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def model_without_tokenizer(tmp_path):
    from jaxserve.model import default_model_path

    d = tmp_path / "hf-no-tokenizer"
    d.mkdir()
    shutil.copy(os.path.join(default_model_path(), "config.json"), d)
    (d / "model.safetensors").write_bytes(b"")  # never read: the check comes first
    return d


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_model_directory_without_tokenizer_fails_before_loading(model_without_tokenizer, command):
    args = (
        ["hello", str(model_without_tokenizer)]
        if command == "generate"
        else [str(model_without_tokenizer)]
    )
    out = _run(command, *args)
    # The empty model.safetensors would fail differently: the check ran before loading.
    _one_line_error(out, command, "no tokenizer found", "tokenizer.json or tokenizer.model")


def test_serve_names_a_busy_port_before_loading():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _run("serve", "--port", str(port))
    _one_line_error(out, "serve", f"127.0.0.1:{port}", "--port")


def test_bench_serve_without_a_server_is_one_line():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _run("bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--vocab-size", "50")
    _one_line_error(out, "bench serve", "no server answers", "jaxserve serve")


def test_bench_serve_help_has_no_docstring_markup():
    out = _run("bench", "serve", "--help")
    assert out.returncode == 0, out.stderr
    assert "``" not in out.stdout and "\\\\" not in out.stdout


def test_ctrl_c_during_warmup_exits_without_traceback():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # the runner's first log line comes before the warm-up
        seen.append(line)
        if "model runner:" in line:
            break
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=120)[1]
    err = "".join(seen) + rest
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "jaxserve serve: interrupted" in err, err


def test_serve_rejects_a_bad_flag_value_by_name():
    out = _run("serve", "--max-num-seqs", "0")
    assert out.returncode == 2
    assert "max_num_seqs" in out.stderr and "Traceback" not in out.stderr


def test_serve_rejects_a_process_id_outside_the_job_by_name():
    out = _run(
        "serve", "--num-processes", "2", "--process-id", "2", "--distributed-coordinator", "h:1"
    )
    assert out.returncode == 2
    assert "process_id must be in [0, 2)" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "argv, closest",
    [
        (["serve", "--max-num-seq", "4"], "--max-num-seqs"),  # #39: was taken as --max-num-seqs
        (["serve", "--max-model-length=64"], "--max-model-len"),
        (["bench", "serve", "--num-prompt", "3"], "--num-prompts"),
    ],
)
def test_a_misspelt_flag_gets_its_commands_usage_and_the_closest_flag(argv, closest, capsys):
    """No abbreviations, and the subcommand (not the top level) names the flag it does not know
    and the one it has that is closest (#39)."""
    from jaxserve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    command = " ".join(a for a in argv if not a.startswith("-") and not a[0].isdigit())
    assert err.startswith(f"usage: jaxserve {command} "), err
    assert err.rstrip().endswith(f"(did you mean {closest}?)"), err


def test_every_argument_parser_refuses_abbreviations():
    """Every ``argparse.ArgumentParser(...)`` in the package, the scripts and the benchmarks
    passes ``allow_abbrev=False`` (the CLI's own ``Parser`` sets it for its subcommands)."""
    import ast

    offenders = []
    for folder in ("jaxserve", "scripts", "benchmarks"):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(root, name)
                for node in ast.walk(ast.parse(open(path).read())):
                    if (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "ArgumentParser"
                        and not any(
                            k.arg == "allow_abbrev"
                            and isinstance(k.value, ast.Constant)
                            and k.value.value is False
                            for k in node.keywords
                        )
                    ):
                        offenders.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
    assert not offenders, offenders
