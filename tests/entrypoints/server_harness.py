"""A live server on a free port, in a background thread with its own event loop, and HTTP helpers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from jaxserve.entrypoints.http.api_server import INTERNAL_ERRORS, build_app, run_server

MODEL_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "tiny-llama")
FAKE_SERVE = os.path.join(os.path.dirname(__file__), "fake_serve.py")


def small_engine_args(**overrides: Any) -> Any:
    """CPU-sized EngineArgs on the bundled model: float32, reference attention, token buckets
    16 and 64, 64-token budget, 8 sequences, 256-token context; ``overrides`` win."""
    from jaxserve.config import EngineArgs

    args = dict(
        model=MODEL_DIR,
        dtype="float32",
        served_model_name="tiny-llama",
        max_model_len=256,
        num_gpu_blocks_override=64,
        block_size=16,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        attention_backend="reference",
        token_buckets="16,64",
    )
    return EngineArgs(**{**args, **overrides})


@contextlib.contextmanager
def running_server(args: Any):
    """Starts an AsyncLLM from ``args`` behind a LiveServer; yields the server, then stops both
    and asserts the server logged no internal error."""
    from jaxserve.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(args)
    srv = LiveServer(llm)
    try:
        yield srv
    finally:
        srv.close()
        llm.shutdown()
    assert not srv.internal_errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_cli(args: list[str], log: str, timeout_s: float = 300):
    """Runs ``jaxserve serve *args --port <free port>`` (CPU) in a subprocess, output to the file
    ``log``; yields its base URL once /health answers 200, then terminates it.

    Raises:
      AssertionError: the server exited, or was not healthy within ``timeout_s`` (with its log).
    """
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", *args, "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, JAX_PLATFORMS="cpu")
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"serve exited {proc.returncode}:\n{open(log).read()}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"serve did not come up:\n{open(log).read()}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


class LiveServer:
    """Runs ``run_server(llm)`` on 127.0.0.1:<free port> until ``close()`` (HTTPS with an
    ``ssl_context``).

    Attributes:
      url: ``http://127.0.0.1:<port>`` (``https://`` with TLS).
      app: the aiohttp application (``app[INTERNAL_ERRORS]`` lists unexpected exceptions).
      exit_code: run_server's return value once it stopped, else None.
    """

    def __init__(
        self,
        llm: Any,
        *,
        api_key: str | None = None,
        dead_grace_s: float = 0.3,
        start_timeout_s: float = 30.0,
        app: Any = None,
        ssl_context: Any = None,
    ) -> None:
        self.llm = llm
        self.app = app if app is not None else build_app(llm, api_key=api_key)
        self.exit_code: int | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._port = 0
        self._dead_grace_s = dead_grace_s
        self._ssl_context = ssl_context
        self._thread = threading.Thread(target=self._run, name="test-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout_s):
            raise RuntimeError("server did not start")
        scheme = "https" if ssl_context is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self._port}"

    def _run(self) -> None:
        async def main() -> int:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def ready(host: str, port: int) -> None:
                self._port = port
                self._ready.set()

            return await run_server(
                self.llm,
                host="127.0.0.1",
                port=0,
                ready=ready,
                stop=self._stop,
                dead_grace_s=self._dead_grace_s,
                app=self.app,
                ssl_context=self._ssl_context,
            )

        self.exit_code = asyncio.run(main())

    @property
    def internal_errors(self) -> list[str]:
        return self.app[INTERNAL_ERRORS]

    def wait_stopped(self, timeout: float) -> int | None:
        """Waits for the server to stop on its own (engine death); returns its exit code."""
        self._thread.join(timeout)
        return self.exit_code

    def close(self) -> int | None:
        if self._thread.is_alive() and self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)
        return self.exit_code


def sse(client, path, body, *, expect=200):
    """The parsed ``data:`` events of a streamed request (``"[DONE]"`` kept as a string)."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == expect, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
            else:
                assert line == "", line
    return events


def metric_values(client) -> dict[str, float]:
    text = client.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(
                f"[{v}]" for k, v in sorted(s.labels.items()) if k != "model_name"
            )
            out[key] = s.value
    return out


def wait_idle(client, llm, timeout=2.0):
    """Waits until no request runs and no KV block is used; returns the last metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = metric_values(client)
        idle = (
            m["jaxserve:num_requests_running"] == 0
            and m["jaxserve:kv_cache_usage_perc"] == 0
            and m["jaxserve:num_requests_waiting"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m, idle
        time.sleep(0.02)


def assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


class FakeServeProcess:
    """``fake_serve.py`` (``jaxserve serve``'s flags and signal handling over the FakeEngine) in
    a subprocess; ``url`` once it is listening (``https://`` with the TLS flags)."""

    def __init__(self, *flags: str) -> None:
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        self.p = subprocess.Popen(
            [sys.executable, FAKE_SERVE, "--port", "0", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            match = re.search(r"on (https?://\S+)", line)
            if match:
                self.url = match.group(1)
                threading.Thread(target=self._drain_output, daemon=True).start()
                return
        self.p.kill()
        raise RuntimeError("fake_serve did not start:\n" + "".join(self.lines))

    def _drain_output(self) -> None:
        for line in self.p.stdout:
            self.lines.append(line)

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise AssertionError("did not exit:\n" + "".join(self.lines)) from None
