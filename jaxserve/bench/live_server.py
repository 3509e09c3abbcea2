"""Serve an engine already in this process over HTTP, from a background thread.

For notebooks and tests: ``BackgroundServer(llm)`` runs the OpenAI-compatible server
(``jaxserve.entrypoints.http.api_server.run_server``) on ``127.0.0.1`` and a free port, on its
own event loop in a daemon thread, around an engine you already built, so serving it costs no
second model load or compile. ``close()`` (or leaving a ``with`` block) stops the server and,
if it wrapped a plain engine, the engine thread; the engine is idle and usable again afterwards.

    llm = LLM(...)
    with BackgroundServer(llm) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class BackgroundServer:
    """The HTTP server around ``engine``, listening until ``close()``.

    Args:
      engine: a ``jaxserve.LLM``, an ``LLMEngine`` (both wrapped in a new ``AsyncLLM``, which
        ``close()`` shuts down), or a running ``AsyncLLM`` (left running by ``close()``).
      host: address to listen on.
      port: port; 0 picks a free one.
      api_key: require ``Authorization: Bearer <api_key>`` on the API routes.
      start_timeout_s: how long to wait for the server to listen.

    Attributes:
      url: ``http://<host>:<port>`` (``/metrics``, ``/health`` live here).
      base_url: ``url + "/v1"``, for the ``openai`` client.
      llm: the ``AsyncLLM`` being served.

    Raises:
      RuntimeError: the server did not start in time (the error it died of, if any, chained).
    """

    def __init__(
        self,
        engine: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        from jaxserve.engine.async_llm import AsyncLLM
        from jaxserve.entrypoints.http.api_server import run_server

        engine = getattr(engine, "llm_engine", engine)
        self._owns_llm = not isinstance(engine, AsyncLLM)
        self.llm = AsyncLLM(engine) if self._owns_llm else engine
        self._run_server = run_server
        self._host, self._port, self._api_key = host, port, api_key
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.exit_code: int | None = None
        self._thread = threading.Thread(
            target=self._serve, name="jaxserve-background-server", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(start_timeout_s) or self._error is not None:
            self.close()
            raise RuntimeError("the background server did not start") from self._error
        self.url = f"http://{host}:{self._port}"
        self.base_url = self.url + "/v1"

    def _serve(self) -> None:
        async def main() -> int:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def ready(_host: str, port: int) -> None:
                self._port = port
                self._ready.set()

            return await self._run_server(
                self.llm,
                host=self._host,
                port=self._port,
                api_key=self._api_key,
                ready=ready,
                stop=self._stop,
            )

        try:
            self.exit_code = asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            self._error = exc
            self._ready.set()

    def close(self, timeout_s: float = 30.0) -> int | None:
        """Stops the server (and the engine thread, if this object started it); returns
        ``run_server``'s exit code (0, or 1 if the engine died), None if it had not started."""
        if self._thread.is_alive() and self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout_s)
        if self._owns_llm:
            self.llm.shutdown()
        return self.exit_code

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
