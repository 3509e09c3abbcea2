"""The batch CLI (``jaxserve run-batch``) on the bundled model: the shared "Batch CLI" cases.

One engine for the module (float32, reference attention, small knobs) serves the in-process
runs (``run_batch_main(args, llm=...)``: the command's whole path except building the engine);
the resume case also runs the real command in a subprocess and SIGKILLs it. Both use the same
flags and the test session's persistent XLA cache, so the subprocess compiles nothing new.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from fake_engine import FakeEngine
from server_harness import MODEL_DIR, LiveServer

from jaxserve.cli import build_parser, main
from jaxserve.config import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.batch_io import (
    BatchLine,
    LineError,
    OutputFile,
    error_record,
    parse_input,
    read_records,
    record_succeeded,
    response_record,
)
from jaxserve.entrypoints.run_batch import (
    EXIT_ENGINE_DEAD,
    EXIT_OK,
    EXIT_SOME_FAILED,
    EXIT_USAGE,
    run_batch_main,
)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
XLA_CACHE_DIR = os.path.join(tempfile.gettempdir(), f"jaxserve-test-xla-{os.getuid()}")
MAX_MODEL_LEN = 256
ENGINE_FLAGS = [
    os.path.abspath(MODEL_DIR),
    "--dtype",
    "float32",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--num-gpu-blocks-override",
    "64",
    "--max-num-batched-tokens",
    "128",
    "--max-num-seqs",
    "8",
    "--attention-backend",
    "reference",
    "--token-buckets",
    "16,32,64,128",
    "--compilation-cache-dir",
    XLA_CACHE_DIR,
    "--no-progress",
]
COMPL, CHAT = "/v1/completions", "/v1/chat/completions"


def _args(input_path: str, output_path: str, *extra: str):
    return build_parser(["run-batch"]).parse_args(
        ["run-batch", "-i", input_path, "-o", output_path, *ENGINE_FLAGS, *extra]
    )


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _records(path) -> list[dict]:
    with open(path, "rb") as f:
        data = f.read()
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.split(b"\n")[:-1]]


def _run(tmp_path, lines: list[str], llm, name: str = "run", *extra: str) -> tuple[int, list[dict]]:
    """Writes ``lines`` as an input file, runs the command in-process on ``llm``."""
    src, out = tmp_path / f"{name}.in.jsonl", tmp_path / f"{name}.out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    code = run_batch_main(_args(str(src), str(out), *extra), llm=llm)
    return code, _records(out)


def _by_id(records: list[dict]) -> dict[str, dict]:
    out = {}
    for r in records:
        assert r["custom_id"] not in out, f"duplicate record for {r['custom_id']}"
        out[r["custom_id"]] = r
    return out


def _assert_same(got, want, path="body") -> None:
    """Equal structures; floats (logprobs) within 1e-4, since a different batch composition pads
    the step to another bucket and XLA may sum in another order (float32 round-off)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), path
        for key in want:
            _assert_same(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


def _stable(body: dict) -> dict:
    """A response body without what legitimately differs between two runs (ids, time, prefix-cache hits)."""
    usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return {
        "choices": body["choices"],
        "usage": usage,
        "object": body["object"],
        "model": body["model"],
    }


@pytest.fixture(scope="module")
def llm():
    engine = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(_args("-", "-")))
    yield engine
    engine.shutdown()


# ---- the shared cases ---------------------------------------------------------------------------


def test_overlong_line(tmp_path, llm):
    lines = [
        _line("first", COMPL, {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}),
        _line("long", COMPL, {"prompt": list(range(5, 5 + MAX_MODEL_LEN + 40)), "max_tokens": 8}),
        _line(
            "third",
            CHAT,
            {
                "messages": [{"role": "user", "content": "Tell me a story."}],
                "max_tokens": 10,
                "temperature": 0,
            },
        ),
    ]
    code, records = _run(tmp_path, lines, llm)
    assert code == EXIT_SOME_FAILED
    got = _by_id(records)
    assert set(got) == {"first", "long", "third"}
    long = got["long"]
    assert long["error"] is None and long["response"]["status_code"] == 400
    error = long["response"]["body"]["error"]
    assert error["param"] == "prompt" and str(MAX_MODEL_LEN) in error["message"]
    assert str(MAX_MODEL_LEN + 40) in error["message"]
    for cid, line in (("first", lines[0]), ("third", lines[2])):
        assert record_succeeded(got[cid])
        solo_code, solo = _run(tmp_path, [line], llm, name=f"solo-{cid}")
        assert solo_code == EXIT_OK and len(solo) == 1
        assert _stable(solo[0]["response"]["body"]) == _stable(got[cid]["response"]["body"])


def test_per_line_errors(tmp_path, llm):
    valid = {"prompt": "The cat", "max_tokens": 6, "temperature": 0}
    lines = [
        _line("ok", COMPL, valid),
        _line("rerank", "/v1/rerank", {"query": "hi", "documents": ["a"]}),
        _line("streamed", CHAT, {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
        '{"custom_id": "broken", "url": "/v1/completions", "body": {"prompt": ',
        "",
        _line("no-messages", CHAT, {"max_tokens": 4}),
        json.dumps({"url": COMPL, "body": valid}),
        _line("ok", COMPL, valid),
        json.dumps({"custom_id": "get", "method": "GET", "url": COMPL, "body": valid}),
        json.dumps({"custom_id": "no-body", "method": "POST", "url": COMPL}),
        "[1, 2]",
        _line("bad-param", COMPL, {**valid, "temperature": -1}),
    ]
    code, records = _run(tmp_path, lines, llm)
    assert code == EXIT_SOME_FAILED
    assert len(records) == len(lines) - 1  # the blank line has no record
    line_errors = {r["error"]["line"]: r for r in records if r["error"] is not None}
    responses = {r["custom_id"]: r["response"] for r in records if r["error"] is None}
    assert {line: (r["custom_id"], r["error"]["code"]) for line, r in line_errors.items()} == {
        2: ("rerank", "invalid_url"),
        4: (None, "invalid_json"),
        7: (None, "missing_custom_id"),
        8: ("ok", "duplicate_custom_id"),
        9: ("get", "invalid_method"),
        10: ("no-body", "invalid_body"),
        11: (None, "invalid_json"),
    }
    for line, r in line_errors.items():
        assert r["response"] is None and r["error"]["message"].startswith(f"line {line}:")
    assert set(responses) == {"ok", "streamed", "no-messages", "bad-param"}
    assert responses["ok"]["status_code"] == 200 and responses["ok"]["body"]["choices"][0]["text"]
    for cid, param in (
        ("streamed", "stream"),
        ("no-messages", "messages"),
        ("bad-param", "temperature"),
    ):
        assert responses[cid]["status_code"] == 400
        assert responses[cid]["body"]["error"]["param"] == param, responses[cid]


def _http(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_bodies_equal_the_http_servers(tmp_path, llm):
    bodies = [
        (COMPL, {"prompt": "Once upon a time, there was", "max_tokens": 12, "temperature": 0}),
        (
            COMPL,
            {
                "prompt": ["The dog", "A little girl"],
                "max_tokens": 6,
                "temperature": 0,
                "logprobs": 2,
                "echo": True,
                "ignore_eos": True,
            },
        ),
        (COMPL, {"prompt": "She said", "max_tokens": 16, "temperature": 0, "stop": ["."]}),
        (
            CHAT,
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is a cat?"},
                ],
                "max_completion_tokens": 12,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 1,
            },
        ),
        (COMPL, {"prompt": "x", "top_p": 1.5}),
        (CHAT, {"model": "not-served", "messages": [{"role": "user", "content": "hi"}]}),
    ]
    lines = [_line(f"r{i}", url, body) for i, (url, body) in enumerate(bodies)]
    _, records = _run(tmp_path, lines, llm)
    got = _by_id(records)
    server = LiveServer(llm)
    try:
        for i, (url, body) in enumerate(bodies):
            status, expected = _http(server.url + url, body)
            response = got[f"r{i}"]["response"]
            assert response["status_code"] == status
            if status == 200:
                assert response["request_id"] == response["body"]["id"]
                _assert_same(_stable(response["body"]), _stable(expected))
            else:
                assert response["body"] == expected
    finally:
        server.close()
    assert not server.internal_errors


def test_resume_after_sigkill_and_torn_line(tmp_path, llm):
    """Kill the real command mid-run, tear its last record, rerun: every custom_id exactly once."""
    n = 40
    lines = [
        _line(
            f"req-{i:02d}",
            COMPL,
            {
                "prompt": f"Story number {i}: once upon a time",
                "temperature": 0,
                "max_tokens": 16 + 8 * (i % 5),
                "ignore_eos": True,
            },
        )
        for i in range(n)
    ]
    src, out = tmp_path / "resume.in.jsonl", tmp_path / "resume.out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    log = open(tmp_path / "first-run.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxserve.cli",
            "run-batch",
            "-i",
            str(src),
            "-o",
            str(out),
            *ENGINE_FLAGS,
            "--fsync-interval-s",
            "0",
        ],
        cwd=REPO,
        stdout=log,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 240
        while not (out.exists() and out.read_bytes().count(b"\n") >= 4):
            assert proc.poll() is None, (tmp_path / "first-run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run wrote no records"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    data = out.read_bytes()
    end = data.rfind(b"\n") + 1
    complete = data[:end].split(b"\n")[:-1]
    assert 4 <= len(complete) < n, (
        f"{len(complete)} of {n} records before the kill: nothing left to resume"
    )
    # Simulate a kill inside the last write: cut the last record in half.
    torn = json.loads(complete[-1])["custom_id"]
    keep = end - len(complete[-1]) - 1 + len(complete[-1]) // 2
    kept_records = complete[:-1]
    with open(out, "r+b") as f:
        f.truncate(keep)

    code = run_batch_main(_args(str(src), str(out)), llm=llm)
    assert code == EXIT_OK
    final = out.read_bytes()
    assert final.startswith(b"\n".join(kept_records) + b"\n"), (
        "records of the first run were rewritten"
    )
    records = _records(out)
    got = _by_id(records)
    assert sorted(got) == [f"req-{i:02d}" for i in range(n)]
    assert torn in got
    for i in range(n):
        body = got[f"req-{i:02d}"]["response"]["body"]
        assert body["usage"]["completion_tokens"] == 16 + 8 * (i % 5)
    # A third run finds everything done: it writes nothing and needs no engine.
    assert run_batch_main(_args(str(src), str(out)), llm=None) == EXIT_OK
    assert out.read_bytes() == final


# ---- the command around the cases ----------------------------------------------------------------


def test_stdin_to_stdout(tmp_path, llm, monkeypatch, capsysbinary):
    lines = [
        _line("a", COMPL, {"prompt": "Hello", "max_tokens": 4, "temperature": 0}),
        _line("b", COMPL, {"prompt": "Hello", "max_tokens": 0, "echo": True}),
    ]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n".join(lines)).encode())))
    code = run_batch_main(_args("-", "-"), llm=llm)
    captured = capsysbinary.readouterr()
    assert code == EXIT_OK
    records = [
        json.loads(x) for x in captured.out.decode().splitlines()
    ]  # stdout holds records only
    assert sorted(r["custom_id"] for r in records) == ["a", "b"]
    assert all(record_succeeded(r) for r in records)
    assert b"2 succeeded, 0 failed" in captured.err


def test_usage_errors(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    src = tmp_path / "in.jsonl"
    src.write_text(_line("a", COMPL, {"prompt": "hi"}) + "\n")
    for argv in (
        ["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(out)],
        ["run-batch", "-i", str(src), "-o", str(tmp_path)],
        ["run-batch", "-i", str(src), "-o", str(tmp_path / "no-such-dir" / "out.jsonl")],
        ["run-batch", "-o", str(out)],
        ["run-batch", "-i", str(src), "-o", str(out), "--max-num-seqs", "many"],
        ["run-batch", "-i", str(src), "-o", str(out), "--fsync-interval-s", "-1"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == EXIT_USAGE, argv
    assert not out.exists()
    assert run_batch_main(_args(str(src), str(src))) == EXIT_USAGE  # would read its own output
    out.write_text("not a batch record\n")
    assert run_batch_main(_args(str(src), str(out))) == EXIT_USAGE
    assert out.read_text() == "not a batch record\n"
    assert "line 1 is not a batch output record" in capsys.readouterr().err


def test_engine_death_stops_the_run_and_a_rerun_resumes(tmp_path):
    """Requests the engine did not finish get no record (exit 1); a rerun runs exactly them."""
    lines = [_line(f"q{i}", COMPL, {"prompt": f"prompt {i}", "max_tokens": 5}) for i in range(6)]
    dead = AsyncLLM(FakeEngine(MODEL_DIR, max_num_seqs=1, step_s=0.0, fail_at_step=13))
    try:
        code, first = _run(tmp_path, lines, dead, "dead")
    finally:
        dead.shutdown()
    assert code == EXIT_ENGINE_DEAD
    assert 1 <= len(first) < len(lines) and all(record_succeeded(r) for r in first)
    healthy = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.0))
    try:
        code = run_batch_main(
            _args(str(tmp_path / "dead.in.jsonl"), str(tmp_path / "dead.out.jsonl")), llm=healthy
        )
    finally:
        healthy.shutdown()
    assert code == EXIT_OK
    assert sorted(_by_id(_records(tmp_path / "dead.out.jsonl"))) == [f"q{i}" for i in range(6)]


def test_embeddings_and_scores(tmp_path):
    """``/v1/embeddings`` and ``/v1/score`` lines (vLLM's run-batch serves both) on a pooling
    engine: the server's bodies; on a generate engine: the 400 naming ``--runner pooling``."""
    texts = ["The cat", "A dog"]
    lines = [
        _line("e", "/v1/embeddings", {"input": texts, "encoding_format": "float"}),
        _line("s", "/v1/score", {"text_1": texts[0], "text_2": texts}),
        _line("bad", "/v1/embeddings", {"input": []}),
    ]
    pooling = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.0, convert="embed"))
    try:
        code, records = _run(tmp_path, lines, pooling, "pooling")
    finally:
        pooling.shutdown()
    assert code == EXIT_SOME_FAILED
    got = {r["custom_id"]: r["response"] for r in _by_id(records).values()}
    embedding = got["e"]["body"]
    assert got["e"]["status_code"] == 200 and embedding["object"] == "list"
    assert [d["index"] for d in embedding["data"]] == [0, 1]
    assert embedding["usage"]["prompt_tokens"] == embedding["usage"]["total_tokens"] > 0
    scores = got["s"]["body"]["data"]
    assert got["s"]["status_code"] == 200 and scores[0]["score"] == pytest.approx(1.0)
    assert got["bad"]["status_code"] == 400 and got["bad"]["body"]["error"]["param"] == "input"
    generate = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.0))
    try:
        code, records = _run(tmp_path, lines[:1], generate, "generate")
    finally:
        generate.shutdown()
    assert code == EXIT_SOME_FAILED
    refused = records[0]["response"]
    assert (
        refused["status_code"] == 400 and "--runner pooling" in refused["body"]["error"]["message"]
    )


# ---- the file format, without an engine ------------------------------------------------------------


def test_resume_keys_line_errors_by_line_and_responses_by_custom_id(tmp_path):
    lines = [
        _line("a", COMPL, {"prompt": "x"}).encode(),
        b"{oops",
        _line("a", COMPL, {"prompt": "y"}).encode(),
    ]
    items = parse_input(lines)
    assert [type(i) for i in items] == [BatchLine, LineError, LineError]
    assert [i.line for i in items] == [1, 2, 3]
    path = tmp_path / "out.jsonl"
    # A run killed after writing the line errors but before line 1's response.
    with OutputFile.open(str(path))[0] as output:
        output.write(error_record(items[2]))
    output, state = OutputFile.open(str(path))
    with output:
        assert [state.is_done(i) for i in items] == [
            False,
            False,
            True,
        ]  # "a" itself still has to run
        output.write(response_record("a", 200, {"id": "cmpl-1", "usage": {}}))
        output.write(error_record(items[1]))
    state = read_records(path.read_bytes())
    assert [state.is_done(i) for i in items] == [True, True, True]
    assert state.succeeded(items[0]) and not state.succeeded(items[1])


def test_torn_tail_is_truncated_and_the_file_is_locked(tmp_path):
    path = tmp_path / "out.jsonl"
    good = b'{"id":"batch_req_1","custom_id":"a","response":{"status_code":200,"body":{}},"error":null}\n'
    path.write_bytes(good + b'{"id":"batch_req_2","custom_id":"b","resp')
    output, state = OutputFile.open(str(path))
    try:
        assert state.torn_bytes > 0 and state.num_records == 1 and set(state.done_ids) == {"a"}
        assert path.read_bytes() == good
        with pytest.raises(ValueError, match="another run-batch"):
            OutputFile.open(str(path))
    finally:
        output.close()
    OutputFile.open(str(path))[0].close()  # the lock went with the first handle


def test_include_ledger_writes_each_records_ledger(tmp_path, llm):
    body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    lines = [_line("own", COMPL, {**body, "include_ledger": True}), _line("plain", COMPL, body)]
    code, records = _run(tmp_path, lines, llm)
    assert code == EXIT_OK
    got = _by_id(records)
    assert got["own"]["response"]["body"]["ledger"]["num_output_tokens"] == 3
    assert "ledger" not in got["plain"]["response"]["body"]
    code, records = _run(tmp_path, [lines[1]], llm, "all", "--include-ledger")
    led = records[0]["response"]["body"]["ledger"]
    assert led["finish_reason"] == "length" and led["num_steps"] >= 3
