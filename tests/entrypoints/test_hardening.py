"""Issue #19's found faults, each as a regression test over the scripted FakeEngine.

Every case here answered a 500, stalled the event loop, or broke an OpenAI/vLLM rule before the
fix; the module's server must end with ``internal_errors == []``.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time

import httpx2 as httpx
import pytest
from fake_engine import FakeEngine
from server_harness import MODEL_DIR, LiveServer, assert_error, sse

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.http.api_server import build_app
from jaxserve.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from jaxserve.serving.validation import ServingInfo
from jaxserve.tokenizer.stop_strings import StopChecker

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSG = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server():
    llm = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.002, max_model_len=256))
    srv = LiveServer(llm)
    yield srv
    assert srv.internal_errors == []
    srv.close()
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


# ---- content parts, null content, cache_salt ----------------------------------------------------


@pytest.mark.parametrize("kind", [{}, ["text"], 3, None, True])
def test_content_part_type_not_a_string_is_400(client, server, kind):
    messages = [{"role": "user", "content": [{"type": kind, "text": "x"}]}]
    assert_error(client.post(CHAT, json={"messages": messages}), 400, "messages.0.content")
    assert_error(client.post("/tokenize", json={"messages": messages}), 400, "messages.0.content")
    assert server.internal_errors == []


def test_content_part_not_an_object_is_400(client):
    for content in ([3], [["text"]], [{"type": "text"}], [{"type": "text", "text": 3}]):
        messages = [{"role": "user", "content": content}]
        assert_error(client.post(CHAT, json={"messages": messages}), 400)


def test_user_message_with_null_content_is_400(client):
    for role in ("user", "system", "developer", "tool"):
        error = assert_error(
            client.post(CHAT, json={"messages": [{"role": role, "content": None}]}), 400
        )
        assert error["param"].startswith("messages.0")
    # an assistant turn may have null content (OpenAI: when it made tool calls)
    ok = client.post(
        CHAT,
        json={
            "messages": [*MSG, {"role": "assistant", "content": None}, *MSG],
            "max_tokens": 1,
        },
    )
    assert ok.status_code == 200, ok.text


def test_empty_cache_salt_is_400(client):
    """vLLM's rule: cache_salt, when given, is a non-empty string (an empty one would silently
    share the unsalted cache)."""
    for path, body in ((COMPL, {"prompt": "x"}), (CHAT, {"messages": MSG})):
        assert_error(client.post(path, json={**body, "cache_salt": ""}), 400, "cache_salt")
        ok = client.post(path, json={**body, "cache_salt": "tenant-a", "max_tokens": 1})
        assert ok.status_code == 200


# ---- authorization header ---------------------------------------------------------------------


def test_api_key_header_not_utf8_is_401():
    llm = AsyncLLM(FakeEngine(MODEL_DIR))
    srv = LiveServer(llm, api_key="sésame")
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            for raw in (
                b"Bearer \xe9",
                b"Bearer \xff\xfe",
                b"\xe9 x",
                "Bearer sésame".encode("latin-1"),  # the key's characters, not its UTF-8 bytes
            ):
                r = c.post(COMPL, json={"prompt": "x"}, headers={"Authorization": raw})
                assert_error(r, 401, code="invalid_api_key")
            ok = c.post(
                COMPL,
                json={"prompt": "x", "max_tokens": 1},
                headers={"Authorization": "Bearer sésame".encode()},
            )
            assert ok.status_code == 200
        assert srv.internal_errors == []
    finally:
        srv.close()
        llm.shutdown()


# ---- stop strings -----------------------------------------------------------------------------


def test_stop_string_caps(client):
    too_many = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    error = assert_error(client.post(COMPL, json={"prompt": "x", "stop": too_many}), 400, "stop")
    assert str(MAX_STOP_STRINGS) in error["message"]
    too_long = "y" * (MAX_STOP_STRING_CHARS + 1)
    error = assert_error(client.post(CHAT, json={"messages": MSG, "stop": [too_long]}), 400, "stop")
    assert str(MAX_STOP_STRING_CHARS) in error["message"]
    at_cap = ["z" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS
    assert (
        client.post(COMPL, json={"prompt": "x", "stop": at_cap, "max_tokens": 2}).status_code == 200
    )
    with pytest.raises(ValueError, match="^stop"):
        SamplingParams(stop=too_many)


def test_stop_check_cost_does_not_grow_with_output():
    """Each step's stop work reads only the tail the new text can complete: holding 64 stops of
    256 characters over a 200,000-character output costs about what it costs over 1,000."""
    stops = ["\u00e9" * (MAX_STOP_STRING_CHARS - 1) + f"{i:02d}" for i in range(MAX_STOP_STRINGS)]

    def cost(length: int) -> float:
        checker = StopChecker(stops)
        text = "\u00e9" * length
        start = time.perf_counter()
        for _ in range(50):
            checker.check(text, 4)
            checker.holdback(text)
        return time.perf_counter() - start

    cost(1000)
    short, long = min(cost(1000) for _ in range(3)), min(cost(200_000) for _ in range(3))
    assert long < 5 * short + 0.01, (short, long)
    assert StopChecker(stops).holdback("x" + "\u00e9" * 300) == MAX_STOP_STRING_CHARS - 1
    assert StopChecker(["abcab"]).holdback("zzabca") == 4
    assert StopChecker(["abcab"]).holdback("zzabcx") == 0


# ---- lengths ----------------------------------------------------------------------------------


def test_prompt_plus_max_tokens_over_max_model_len_is_clamped(client):
    """As vLLM 0.32: a max_tokens beyond what max_model_len leaves after the prompt is clamped to
    it (finish_reason "length" there); a prompt that leaves no room is a 400 (see below)."""
    prompt = [1] + [500] * 250  # 251 tokens of 256
    for max_tokens in (6, 10**6, None):  # None: up to max_model_len
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        out = client.post(COMPL, json=body).json()
        assert out["usage"]["completion_tokens"] == 5, out
        assert out["choices"][0]["finish_reason"] == "length"
    assert client.post(COMPL, json={"prompt": prompt, "max_tokens": 4}).status_code == 200
    chat = client.post(CHAT, json={"messages": MSG, "max_completion_tokens": 10**6})
    assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"] in (
        "stop",
        "length",
    )
    assert_error(
        client.post(COMPL, json={"prompt": [1] + [500] * 255, "max_tokens": 1}), 400, "prompt"
    )


def test_huge_prompt_rejected_before_tokenizing(client, server):
    """A prompt whose UTF-8 length guarantees more than max_model_len tokens is a 400 at once
    (it used to be tokenized in full first), and /health stays fast meanwhile. (15 MB bodies
    are 413s before they are read: test_stress.py; this one is under that limit.)"""
    huge = "word " * 600_000  # 3 MB, far over max_model_len 256's byte bound
    for path, body in (
        (COMPL, {"prompt": huge}),
        (COMPL, {"prompt": ["hi", huge]}),
        (CHAT, {"messages": [{"role": "user", "content": huge}]}),
        ("/tokenize", {"prompt": huge}),
        ("/tokenize", {"messages": [{"role": "user", "content": huge}]}),
    ):
        start = time.monotonic()
        error = assert_error(client.post(path, json=body), 400)
        assert "max_model_len" in error["message"] and "bytes" in error["message"]
        assert time.monotonic() - start < 3.0, path


def test_tokenize_runs_off_the_event_loop(server):
    """A long (but admissible) /tokenize must not block /health."""
    done = threading.Event()
    slow_calls: list[float] = []

    real_encode = server.llm.tokenizer.encode

    def slow_encode(*args, **kwargs):
        time.sleep(0.8)
        return real_encode(*args, **kwargs)

    server.llm.tokenizer.encode = slow_encode
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:

            def tokenize():
                c.post("/tokenize", json={"prompt": "Hello world"})
                done.set()

            t = threading.Thread(target=tokenize)
            t.start()
            time.sleep(0.1)
            while not done.is_set():
                start = time.monotonic()
                assert c.get("/health").status_code == 200
                slow_calls.append(time.monotonic() - start)
                time.sleep(0.05)
            t.join()
    finally:
        del server.llm.tokenizer.encode
    assert slow_calls and max(slow_calls) < 0.4, slow_calls


# ---- chat response fields and streaming --------------------------------------------------------


def test_system_fingerprint_and_refusal(client):
    chat = client.post(CHAT, json={"messages": MSG, "max_tokens": 2}).json()
    fp = chat["system_fingerprint"]
    assert isinstance(fp, str) and fp.startswith("fp_")
    assert chat["choices"][0]["message"]["refusal"] is None
    compl = client.post(COMPL, json={"prompt": "x", "max_tokens": 2}).json()
    assert compl["system_fingerprint"] == fp
    chunks = sse(client, CHAT, {"messages": MSG, "max_tokens": 2, "stream": True})[:-1]
    assert all(c["system_fingerprint"] == fp for c in chunks)


def test_chat_role_chunk_comes_with_the_first_token():
    """vLLM sends the role chunk once the engine produced output; a stream whose engine dies
    before any token shows the error, not a role chunk that measured nothing."""
    llm = AsyncLLM(FakeEngine(MODEL_DIR, fail_at_step=1))
    srv = LiveServer(llm, dead_grace_s=2.0)
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            events = sse(c, CHAT, {"messages": MSG, "stream": True, "max_tokens": 4})
        assert events[-1] == "[DONE]"
        assert len(events) == 2 and events[0]["error"]["code"] == "engine_dead", events
    finally:
        srv.close()
        llm.shutdown()


def test_chat_role_chunk_per_choice_then_content(client):
    chunks = sse(client, CHAT, {"messages": MSG, "max_tokens": 3, "n": 2, "stream": True})[:-1]
    roles = [c for c in chunks if "role" in c["choices"][0]["delta"]]
    assert sorted(c["choices"][0]["index"] for c in roles) == [0, 1]
    assert chunks[:2] == roles


# ---- memory-aware admission --------------------------------------------------------------------


def test_logprobs_buffers_over_memory_budget_is_400():
    """n x logprobs x vocabulary buffers that cannot fit the host's free memory: a 400 naming n,
    the server keeps serving (it used to allocate and bring the engine down)."""
    llm = AsyncLLM(FakeEngine(MODEL_DIR))
    info = dataclasses.replace(ServingInfo.from_engine(llm), memory_probe=lambda: 1_000_000)
    srv = LiveServer(llm, app=build_app(llm, info=info))  # 1 MB free
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            error = assert_error(
                c.post(COMPL, json={"prompt": "x", "n": 64, "logprobs": 5}), 400, "n"
            )
            assert "memory" in error["message"]
            r = c.post(COMPL, json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
            assert c.get("/health").status_code == 200
        assert srv.internal_errors == []
    finally:
        srv.close()
        llm.shutdown()


# ---- slow clients, header-level errors -----------------------------------------------------------


def _raw(srv: LiveServer, data: bytes, timeout: float = 10.0) -> bytes:
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                b = s.recv(65536)
            except TimeoutError:
                break
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)


def test_oversized_header_gets_json_error(server):
    reply = _raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")), head
    assert b"application/json" in head, head
    assert "error" in json.loads(body)


def test_slow_client_is_cut_off():
    llm = AsyncLLM(FakeEngine(MODEL_DIR))
    srv = LiveServer(
        llm,
        app=build_app(llm, header_timeout_s=0.5, body_timeout_s=0.5),
    )
    try:
        host, port = srv.url.removeprefix("http://").split(":")
        # headers that never finish
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            start = time.monotonic()
            reply = s.recv(65536)
            assert time.monotonic() - start < 5
            assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply
        # a body that trickles
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )
            start = time.monotonic()
            reply = s.recv(65536)
            assert time.monotonic() - start < 5
            assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            assert c.post(COMPL, json={"prompt": "x", "max_tokens": 1}).status_code == 200
        assert srv.internal_errors == []
    finally:
        srv.close()
        llm.shutdown()


def test_serve_flags_in_help_and_startup_report(server):
    from jaxserve.cli import build_parser
    from jaxserve.entrypoints.serve import startup_report

    defaults = build_parser(["serve"]).parse_args(["serve"])
    assert (defaults.step_timeout_s, defaults.shutdown_timeout_s) == (300.0, 30.0)
    assert (defaults.request_header_timeout_s, defaults.request_body_timeout_s) == (30.0, 60.0)
    argv = ["serve", "--step-timeout-s", "5", "--shutdown-timeout-s", "2"]
    report = startup_report(server.llm, 1.0, build_parser(argv).parse_args(argv))
    assert "'step_timeout_s': 5.0" in report and "'shutdown_timeout_s': 2.0" in report
    assert "'request_header_timeout_s': 30.0" in report and "'api_key': None" in report


def test_cached_probe_rereads_after_ttl():
    from jaxserve.serving.validation import cached_probe

    calls = []
    probe = cached_probe(lambda: calls.append(1) or len(calls), ttl_s=0.05)
    assert probe() == 1 and probe() == 1  # one read serves the burst
    time.sleep(0.06)
    assert probe() == 2
