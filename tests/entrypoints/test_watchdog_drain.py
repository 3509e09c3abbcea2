"""The step watchdog and the SIGTERM drain, with a fault-injecting FakeEngine.

A step that hangs (``hang_at_step``) must mark the engine dead after ``--step-timeout-s``:
``/health`` 503, pending requests an error, the process exit 1. SIGTERM must stop accepting, let
in-flight requests finish within ``--shutdown-timeout-s`` (abort them after) and exit 0.
"""

from __future__ import annotations

import asyncio
import json
import re
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
    health: list[int] = []
    done: list = []  # the completion's response (apart from health: a /health probe in flight
    # when the completion ends would land after it in a shared list)
    try:
        with httpx.Client(base_url=srv.url, timeout=20) as c:
            t = threading.Thread(
                target=lambda: done.append(c.post(COMPL, json={"prompt": "x", "max_tokens": 6}))
            )
            t.start()
            while t.is_alive():  # the engine is busy (0.2 s steps) but alive: /health 200
                health.append(c.get("/health").status_code)
                time.sleep(0.05)
            r = done.pop()
            assert r.status_code == 200 and not llm.errored
            assert len(health) > 5 and set(health) == {200}, health
    finally:
        srv.close()
        llm.shutdown()


def test_health_turns_503_when_host_side_work_stalls_and_the_watchdog_fires():
    """#38 F7: a request whose host-side preprocessing never returns (F1's bad-words masks in
    ``add_request``) froze the engine while ``/health`` said 200 and the step watchdog, which
    watched model steps only, never fired. Now ``/health`` is 503 ``engine_stalled`` once the
    loop turn outlives the step timeout, and the watchdog kills the engine."""
    engine = FakeEngine(MODEL_DIR, step_s=0.01, hang_at_add=2)
    llm = AsyncLLM(engine, step_timeout_s=1.0)
    srv = LiveServer(llm, dead_grace_s=1.0)
    results: dict[str, object] = {}
    try:
        with httpx.Client(base_url=srv.url, timeout=20) as c:
            assert c.post(COMPL, json={"prompt": "x", "max_tokens": 3}).status_code == 200
            assert c.get("/health").status_code == 200

            def stuck():
                with httpx.Client(base_url=srv.url, timeout=20) as own:
                    results["stuck"] = own.post(COMPL, json={"prompt": "y", "max_tokens": 3})

            t = threading.Thread(target=stuck)
            t.start()
            start = time.monotonic()
            codes = []
            while time.monotonic() - start < 10:
                r = c.get("/health")
                if r.status_code == 503:
                    codes.append(r.json()["error"]["code"])
                    if codes[-1] == "engine_dead":
                        break
                else:
                    assert time.monotonic() - start < 1.2, "still 200 past the step timeout"
                time.sleep(0.05)
            assert codes and codes[-1] == "engine_dead", codes
            assert set(codes) <= {"engine_stalled", "engine_dead"}
            assert "host-side work" in str(llm.dead_error)
            t.join(10)
            assert_error(results["stuck"], 503, code="engine_dead")
        assert srv.wait_stopped(10) == 1
        assert srv.internal_errors == []
    finally:
        engine.release_hang.set()
        srv.close()
        llm.shutdown()


def test_health_reports_a_stall_before_the_watchdog_and_shutdown():
    """``AsyncLLM.health``: ``engine_stalled`` as soon as a loop turn outlives the step timeout
    (the watchdog may poll up to a second later), ``shutting_down`` after ``shutdown``."""
    engine = FakeEngine(MODEL_DIR, step_s=0.001, hang_at_step=1)
    llm = AsyncLLM(engine, step_timeout_s=600)  # the watchdog stays out of it
    try:
        llm.step_timeout_s = 0.3

        async def start():
            from jaxserve.sampling_params import SamplingParams

            return await llm.add_request("r", "x", SamplingParams(max_tokens=2))

        asyncio.run(start())
        assert llm.health().healthy
        time.sleep(0.5)
        health = llm.health()
        assert not health.healthy and health.code == "engine_stalled"
        assert "model step" in str(health.error)
        engine.release_hang.set()
        deadline = time.monotonic() + 5
        while not llm.health().healthy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert llm.health().healthy  # the step came back: alive again
    finally:
        engine.release_hang.set()
        llm.shutdown()
    health = llm.health()
    assert not health.healthy and health.code == "shutting_down"


@pytest.fixture
def spawn():
    """Starts ``fake_serve.py`` subprocesses (``spawn(*flags)``); kills any still running at the
    end, so a failing test leaves no server behind."""
    procs: list[FakeServeProcess] = []

    def start(*flags: str) -> FakeServeProcess:
        procs.append(FakeServeProcess(*flags))
        return procs[-1]

    yield start
    for proc in procs:
        if proc.p.poll() is None:
            proc.p.kill()
            proc.p.wait(10)


@pytest.mark.slow
def test_process_exits_nonzero_when_a_step_hangs(spawn):
    proc = spawn("--hang-at-step", "2", "--step-timeout-s", "0.5")
    with httpx.Client(base_url=proc.url, timeout=20) as c:
        r = c.post(COMPL, json={"prompt": "x", "max_tokens": 5})
        assert_error(r, 503, code="engine_dead")
    assert proc.wait(20) == 1


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_exits_zero(spawn):
    proc = spawn("--step-s", "0.05", "--shutdown-timeout-s", "20")
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
def test_sigterm_past_the_drain_window_tells_clients_and_exits_in_time(spawn):
    """#38 F3: requests still running when the drain window runs out are cut with an answer (a
    stream: an error event ``shutting_down`` and ``[DONE]``; a non-streaming request: a 503 JSON
    body), not a truncated chunked body or an empty reply, and the process exits within the
    window plus 1 s (it overran: 10 s -> 16.4 s, 2 s -> ~4 s)."""
    window = 1.0
    proc = spawn("--step-s", "0.05", "--shutdown-timeout-s", str(window))
    plain: dict[str, object] = {}
    with httpx.Client(base_url=proc.url, timeout=30) as c:

        def non_streaming():
            with httpx.Client(base_url=proc.url, timeout=30) as own:
                plain["r"] = own.post(COMPL, json={"prompt": "y", "max_tokens": 200})

        t = threading.Thread(target=non_streaming)
        t.start()
        deadline = time.monotonic() + 10
        while not re.search(r"^jaxserve:num_requests_running\S* 1", c.get("/metrics").text, re.M):
            assert time.monotonic() < deadline, "the non-streaming request did not start"
            time.sleep(0.02)
        body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with c.stream("POST", COMPL, json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            start = time.monotonic()
            proc.p.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        t.join(30)
    code = proc.wait(20)
    exited_s = time.monotonic() - start
    assert code == 0
    assert rest[-1] == "data: [DONE]", rest[-3:]
    error = json.loads(rest[-2][len("data: ") :])["error"]
    assert error["code"] == "shutting_down" and "--shutdown-timeout-s" in error["message"]
    assert_error(plain["r"], 503, code="shutting_down")
    # window + 1 s, plus what this side adds (signal delivery, the wait's polling) on a busy box
    assert exited_s < window + 1.0 + 0.5, exited_s


@pytest.mark.slow
def test_sigterm_cuts_a_responses_stream_with_its_error_event(spawn):
    """A ``/v1/responses`` stream (named events, no ``[DONE]``) still running when the drain
    window runs out ends with the Responses API's ``error`` event, code ``shutting_down``, its
    ``sequence_number`` the next one."""
    proc = spawn("--step-s", "0.05", "--shutdown-timeout-s", "0.5")
    body = {"model": "fake-model", "input": "x", "max_output_tokens": 200, "stream": True}
    with httpx.Client(base_url=proc.url, timeout=30) as c:
        with c.stream("POST", "/v1/responses", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.p.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
    assert proc.wait(20) == 0
    assert rest[-2:-1] == ["event: error"], rest[-4:]
    error = json.loads(rest[-1][len("data: ") :])
    assert error["type"] == "error" and error["code"] == "shutting_down"
    numbers = [json.loads(x[len("data: ") :])["sequence_number"] for x in rest if x[:6] == "data: "]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
