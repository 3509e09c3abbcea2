"""#38's stress scenarios as bounded tests on the fake-engine server (deliverable 8): a stream
storm with disconnects beside a health probe, and huge prompts refused in the large-body lane
while a small request is served. (The others live beside what they test: malformed bodies and
schemathesis in test_openai_server_fake.py / test_openapi_fuzz.py, preemption storms in
tests/engine/test_soak.py, run-batch SIGKILLs in test_run_batch.py, slow clients in
test_hardening.py, engine faults, stalls and SIGTERM in test_watchdog_drain.py, KV-offload
churn in tests/engine/test_kv_offload_engine.py, a killed Ray replica in test_ray_serve.py.)
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time

import httpx2 as httpx
import pytest
from fake_engine import FakeEngine
from server_harness import MODEL_DIR, LiveServer

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.http.api_server import BODY_LIMIT
from jaxserve.serving.endpoints import LARGE_BODY_BYTES, OpenAIServing

COMPL = "/v1/completions"


@pytest.fixture(scope="module")
def server():
    llm = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.003, max_num_seqs=32, num_blocks=512))
    srv = LiveServer(llm)
    yield srv
    srv.close()
    llm.shutdown()


async def _stream(client: httpx.AsyncClient, i: int, leave_after: int | None) -> list[str]:
    body = {"prompt": f"story {i}", "max_tokens": 40, "ignore_eos": True, "stream": True}
    events: list[str] = []
    async with client.stream("POST", COMPL, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if leave_after is not None and len(events) >= leave_after:
                    return events  # the client goes away mid-stream
    return events


def test_stream_storm_with_disconnects_leaves_nothing_behind(server):
    """64 concurrent streams, every other one leaving after a few chunks, twice over: the rest
    end with [DONE], /health stays 200 throughout, no internal error, and the engine holds no
    request afterwards (the sweep's 300 streams and disconnect storms, bounded)."""
    llm = server.llm

    async def main() -> None:
        limits = httpx.Limits(max_connections=80)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as c:
            health: list[int] = []
            done = asyncio.Event()

            async def probe() -> None:
                while not done.is_set():
                    health.append((await c.get("/health")).status_code)
                    await asyncio.sleep(0.05)

            prober = asyncio.create_task(probe())
            for wave in range(2):
                results = await asyncio.gather(
                    *(_stream(c, wave * 64 + i, 3 if i % 2 else None) for i in range(64))
                )
                for i, events in enumerate(results):
                    if i % 2 == 0:
                        assert events[-1] == "[DONE]", events[-3:]
                        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            done.set()
            await prober
            assert health and set(health) == {200}, health

    asyncio.run(main())
    deadline = threading.Event()
    for _ in range(100):  # aborts reach the engine before its next step
        if llm.num_pending_requests == 0:
            break
        deadline.wait(0.05)
    assert llm.num_pending_requests == 0
    assert server.internal_errors == []


def test_huge_prompts_are_refused_in_the_large_body_lane(server, monkeypatch):
    """Eight prompts under the body limit (``BODY_LIMIT``; over it they are 413s unread, below)
    but far over max_model_len are refused (400 naming prompt) while a small request beside
    them is served; their bodies are parsed and prepared in the one-thread
    large-body lane, not in the pool small requests use (#38: a small request beside them took
    8x its time alone; the ratio is measured in benchmarks/RESULTS.md, not here: this box's
    load makes timings unreliable)."""
    threads: dict[str, set[str]] = {"large": set(), "small": set()}
    prepare = OpenAIServing.prepare

    def recording_prepare(self, url, body, *args):
        kind = (
            "large"
            if isinstance(body.get("prompt"), str) and len(body["prompt"]) > 1000
            else "small"
        )
        threads[kind].add(threading.current_thread().name)
        return prepare(self, url, body, *args)

    monkeypatch.setattr(OpenAIServing, "prepare", recording_prepare)
    huge = json.dumps({"prompt": "word " * (4_000_000 // 5), "max_tokens": 4}).encode()
    assert LARGE_BODY_BYTES < len(huge) < server.app[BODY_LIMIT]

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            headers = {"Content-Type": "application/json"}
            big = [
                asyncio.create_task(c.post(COMPL, content=huge, headers=headers)) for _ in range(8)
            ]
            await asyncio.sleep(0.1)
            small = await c.post(COMPL, json={"prompt": "Once upon a time", "max_tokens": 4})
            assert small.status_code == 200, small.text
            for r in await asyncio.gather(*big):
                assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text

    asyncio.run(main())
    assert threads["large"] and all(n.startswith("jaxserve-large-body") for n in threads["large"])
    assert threads["small"] and not any(n.startswith("jaxserve-large") for n in threads["small"])
    assert server.internal_errors == []


def _raw_request(server, head: str) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(head.encode())
    return sock


def _read_reply(sock: socket.socket) -> bytes:
    """One response (its head and its Content-Length of body)."""
    reply = b""
    while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < int(
        reply.lower().partition(b"content-length: ")[2].split(b"\r\n")[0] or 0
    ):
        chunk = sock.recv(65536)
        assert chunk, reply
        reply += chunk
    return reply


def _error_of(reply: bytes) -> dict:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:300]
    assert b"Connection: close" in head, head
    return json.loads(body)["error"]


def test_a_body_declared_over_the_limit_is_refused_unread(server, monkeypatch):
    """A Content-Length over the body limit is a 413 from the headers alone: the client sends
    64 KiB of its declared 200 MB and gets the answer at once (Connection: close); nothing is
    prepared. With Expect: 100-continue the 413 comes instead of 100 Continue (#38: eight
    15.7 MB prompts were received and parsed whole to be refused)."""
    prepared = []
    monkeypatch.setattr(OpenAIServing, "prepare", lambda *a: prepared.append(a))
    limit = server.app[BODY_LIMIT]
    assert limit < 15_000_000  # the fake engine's max_model_len 256: well under the 16 MiB ceiling
    declared = 200_000_000
    for expect in ("", "Expect: 100-continue\r\n"):
        start = time.monotonic()
        sock = _raw_request(
            server,
            f"POST {COMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n{expect}\r\n",
        )
        with sock:
            if not expect:
                sock.sendall(b'{"prompt": "' + b"w" * 65536)
            error = _error_of(_read_reply(sock))
        assert time.monotonic() - start < 5.0
        assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
        assert str(limit) in error["message"] and str(declared) in error["message"]
    assert not prepared and server.internal_errors == []
    monkeypatch.undo()  # a body under the limit is read and served as before
    r = httpx.post(server.url + COMPL, json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_chunked_body_over_the_limit_is_cut_while_it_arrives(server):
    """A chunked body (no Content-Length) is refused with the 413 as soon as it passes the
    limit (Connection: close): the client stops well before the 3x the limit it meant to
    send."""
    limit = server.app[BODY_LIMIT]
    sock = _raw_request(
        server,
        f"POST {COMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n",
    )
    chunk = b"w" * 2**18
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent = 0
    with sock:
        sock.settimeout(0.5)
        try:
            while sent < 3 * limit:
                sock.sendall(framed)
                sent += len(chunk)
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:
                    break
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the server answered and closed while we were sending
        sock.settimeout(10)
        error = _error_of(_read_reply(sock))
    assert sent < 3 * limit, "the server read the whole body"
    assert error["code"] == "request_too_large" and str(limit) in error["message"]
    assert server.internal_errors == []
