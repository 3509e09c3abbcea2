"""The step watchdog and the SIGTERM drain, with a fault-injecting FakeEngine.

A step that hangs (``hang_at_step``) must mark the engine dead after ``--step-timeout-s``:
``/health`` 503, pending requests an error, the process exit 1. SIGTERM must stop accepting, let
in-flight requests finish within ``--shutdown-timeout-s`` (abort them after) and exit 0.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx2 as httpx
import pytest
from fake_engine import FakeEngine
from server_harness import MODEL_DIR, FakeServeProcess, LiveServer, assert_error, sse

from jaxserve.engine.async_llm import AsyncLLM

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


def test_hung_step_marks_engine_dead_and_server_exits_nonzero():
    engine = FakeEngine(MODEL_DIR, step_s=0.01, hang_at_step=3)
    llm = AsyncLLM(engine, step_timeout_s=0.5)
    srv = LiveServer(llm, dead_grace_s=0.5)
    results: dict[str, object] = {}
    try:
        with httpx.Client(base_url=srv.url, timeout=20) as c:

            def plain():
                results["plain"] = c.post(COMPL, json={"prompt": "x", "max_tokens": 50})

            t = threading.Thread(target=plain)
            t.start()
            start = time.monotonic()
            events = sse(c, CHAT, {"messages": [{"role": "user", "content": "hi"}], "stream": True})
            t.join(20)
            assert time.monotonic() - start < 10
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead"
            assert "step_timeout_s" in events[-2]["error"]["message"]
            assert_error(results["plain"], 503, code="engine_dead")
            assert_error(c.get("/health"), 503, code="engine_dead")
            assert_error(c.post(COMPL, json={"prompt": "x"}), 503, code="engine_dead")
        assert srv.wait_stopped(10) == 1
        assert srv.internal_errors == []
    finally:
        engine.release_hang.set()
        srv.close()
        llm.shutdown()


def test_watchdog_leaves_slow_but_live_steps_alone():
    llm = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.2), step_timeout_s=0.6)
    srv = LiveServer(llm)
    try:
        with httpx.Client(base_url=srv.url, timeout=20) as c:
            r = c.post(COMPL, json={"prompt": "x", "max_tokens": 6})
            assert r.status_code == 200 and not llm.errored
    finally:
        srv.close()
        llm.shutdown()


@pytest.mark.slow
def test_process_exits_nonzero_when_a_step_hangs():
    proc = FakeServeProcess("--hang-at-step", "2", "--step-timeout-s", "0.5")
    with httpx.Client(base_url=proc.url, timeout=20) as c:
        r = c.post(COMPL, json={"prompt": "x", "max_tokens": 5})
        assert_error(r, 503, code="engine_dead")
    assert proc.wait(20) == 1


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_exits_zero():
    proc = FakeServeProcess("--step-s", "0.05", "--shutdown-timeout-s", "20")
    with httpx.Client(base_url=proc.url, timeout=30) as c:
        body = {"prompt": "x", "max_tokens": 30, "stream": True}
        with c.stream("POST", COMPL, json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "text_completion" in first
            proc.p.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        with pytest.raises(httpx.TransportError):  # no longer listening
            httpx.get(proc.url + "/health", timeout=2)
    assert proc.wait(20) == 0


@pytest.mark.slow
def test_sigterm_aborts_what_outlives_the_shutdown_timeout():
    proc = FakeServeProcess("--step-s", "0.05", "--shutdown-timeout-s", "0.5")
    with httpx.Client(base_url=proc.url, timeout=30) as c:
        body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with c.stream("POST", COMPL, json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            start = time.monotonic()
            proc.p.send_signal(signal.SIGTERM)
            try:
                rest = [line for line in lines if line.startswith("data: ")]
            except httpx.TransportError:
                rest = []
        assert "data: [DONE]" not in rest
    assert proc.wait(20) == 0
    assert time.monotonic() - start < 10
