"""The aiohttp OpenAI-compatible server: routes, middlewares and SSE writing.

Endpoints (OpenAI API reference; vLLM's extras):

    POST /v1/completions        legacy completions (prompt: str | [str] | [int] | [[int]])
    POST /v1/chat/completions   chat completions (the tokenizer's chat template)
    GET  /v1/models             the served model
    GET  /v1/requests/{id}/ledger  a finished request's ledger
    GET  /health                200 while the engine serves, else 503
    GET  /metrics               Prometheus text exposition (jaxserve/metrics.py)
    POST /tokenize              {"prompt"} or {"messages"} -> {"tokens", "count", "max_model_len"}
    POST /detokenize            {"tokens"} -> {"prompt"}
    GET  /version               {"version"}
    GET  /openapi.json          the OpenAPI 3.1 document, request schemas from ``protocol``

Each route reads the body and hands it to the transport-free layer
(:class:`jaxserve.serving.endpoints.OpenAIServing`: validation, prompts, engine calls, response
bodies), then writes what it returns: a JSON body, or for ``stream: true`` server-sent events,
one ``data: {chunk}`` per event, then ``data: [DONE]``. A client that disconnects has its
request aborted (the handler is cancelled, ``handler_cancellation=True``, and its streams are
aborted in ``finally``) before the engine's next step, which frees its KV blocks.

Every failure a client can cause is an OpenAI-style 4xx (``APIError``); a middleware turns
anything else into a logged 500 and counts it in ``app[INTERNAL_ERRORS]`` (tests assert it
stays 0). With ``--api-key`` the ``/v1/*``, ``/tokenize`` and ``/detokenize`` routes need
``Authorization: Bearer <key>`` (401 otherwise); ``/health``, ``/metrics`` and ``/version`` stay
open, as in vLLM. With ``--max-waiting-requests`` a request that finds that many requests
waiting gets a 503 with ``Retry-After``.

If the engine dies, in-flight requests get an error (503 ``engine_dead``, or an error event on
a stream), ``/health`` answers 503, and ``run_server`` returns 1 after a short grace period, so
``jaxserve serve`` exits non-zero instead of hanging. The ``serve`` command itself (flags,
start-up report) is ``jaxserve.entrypoints.serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from jaxserve.engine.protocol import EngineClient
from jaxserve.entrypoints.http.openapi import openapi_document
from jaxserve.entrypoints.http.sse import DONE_EVENT, SSEEncoder
from jaxserve.serving.endpoints import OpenAIServing, Reply, StreamReply, version
from jaxserve.serving.errors import APIError, error_body
from jaxserve.serving.json_io import dumps, parse_json_body
from jaxserve.serving.pooling import POOLING_KINDS
from jaxserve.serving.validation import ServingInfo

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Per-connection time limits, seconds (slow or stalled clients must not hold connections).

    Attributes:
      header_s: from connecting (or the end of the previous response) to a complete request
        head; past it the connection is closed (aiohttp's keep-alive timer).
      body_s: to read a request body once its head arrived; past it a 408.
    """

    header_s: float = 30.0
    body_s: float = 60.0


SERVING = web.AppKey("serving", OpenAIServing)
TIMEOUTS_KEY = web.AppKey("timeouts", Timeouts)
DRAINING = web.AppKey("draining", asyncio.Event)
API_KEY = web.AppKey("api_key", object)
INTERNAL_ERRORS = web.AppKey("internal_errors", list)

MAX_BODY_BYTES = 16 * 2**20
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
_PARSE_OFF_LOOP_BYTES = 256 * 2**10
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# ---- reading and writing -------------------------------------------------------------------


def json_response(
    obj: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """An ``application/json`` response with ``dumps(obj)`` as its body.

    Raises:
      ValueError: if ``obj`` holds NaN or infinity (``allow_nan=False``).
      TypeError: if ``obj`` is not JSON-serialisable.
    """
    return web.Response(
        body=dumps(obj), status=status, headers=headers, content_type="application/json"
    )


async def _read_json(request: web.Request) -> dict[str, Any]:
    """The parsed body; a client that takes longer than the body timeout to send it gets a 408
    and its connection closed (a byte-per-second body must not hold a connection forever)."""
    timeout = request.app[TIMEOUTS_KEY].body_s
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        raise APIError(
            f"the request body did not arrive within {timeout:g} s",
            status=408,
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    if len(raw) > _PARSE_OFF_LOOP_BYTES:  # a 16 MB body takes the loop ~0.2 s to parse
        return await asyncio.to_thread(parse_json_body, raw)
    return parse_json_body(raw)


async def _send(request: web.Request, reply: Reply) -> web.StreamResponse:
    """Writes a serving reply: a JSON body (none when ``reply.body`` is None), or SSE events."""
    if isinstance(reply, StreamReply):
        return await _write_sse(request, reply)
    if reply.body is None:
        return web.Response(status=reply.status, headers=reply.headers)
    return json_response(reply.body, status=reply.status, headers=reply.headers)


async def _write_sse(request: web.Request, reply: StreamReply) -> web.StreamResponse:
    """Streams the reply's chunks as SSE events, then ``data: [DONE]``; closes the reply.

    Each event is written as soon as it is made, except once every stream has finished: what
    is left then (the last token's chunk, the usage chunk, ``[DONE]``) follows without waiting,
    so it goes out in one write with the end of the response.
    """
    headers = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    response = web.StreamResponse(
        headers={**headers, **reply.headers} if reply.headers else headers
    )
    encoder = SSEEncoder()
    streams = reply.streams
    try:
        await response.prepare(request)
        held: list[bytes] = []
        async for chunk in reply.chunks:
            held.append(encoder.event(chunk))
            if not all(stream.finished for stream in streams):
                await response.write(held[0] if len(held) == 1 else b"".join(held))
                held.clear()
        held.append(DONE_EVENT)
        await response.write_eof(b"".join(held))
    except ConnectionResetError:  # the client went away; its requests are aborted below
        pass
    finally:
        await reply.close()
    return response


def _check_not_draining(request: web.Request) -> None:
    if request.app[DRAINING].is_set():
        raise APIError(
            "the server is shutting down and takes no new requests",
            status=503,
            type="server_error",
            code="shutting_down",
            headers={"Connection": "close"},
        )


# ---- routes ----------------------------------------------------------------------------------


def _generation_handler(url: str, *, pooling: bool = False) -> Handler:
    """The route of a generating endpoint (``OpenAIServing.generate``), or of a pooling one
    (``OpenAIServing.pool``)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        _check_not_draining(request)
        body = await _read_json(request)
        serving = request.app[SERVING]
        reply = await (serving.pool if pooling else serving.generate)(url, body)
        return await _send(request, reply)

    return handler


async def _models(request: web.Request) -> web.Response:
    return json_response(request.app[SERVING].models())


async def _model(request: web.Request) -> web.Response:
    return json_response(request.app[SERVING].model(request.match_info["model"]))


async def _ledger(request: web.Request) -> web.Response:
    return json_response(await request.app[SERVING].ledger(request.match_info["request_id"]))


async def _health(request: web.Request) -> web.StreamResponse:
    _check_not_draining(request)  # a load balancer stops sending here while we drain
    return await _send(request, request.app[SERVING].health())


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = await request.app[SERVING].metrics()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _openapi(request: web.Request) -> web.Response:
    """``GET /openapi.json``: the API's OpenAPI document (``openapi.openapi_document``)."""
    return json_response(openapi_document(request.app[SERVING].info.model_name))


async def _version(request: web.Request) -> web.Response:
    return json_response({"version": version()})


async def _tokenize(request: web.Request) -> web.Response:
    return json_response(await request.app[SERVING].tokenize(await _read_json(request)))


async def _detokenize(request: web.Request) -> web.Response:
    return json_response(request.app[SERVING].detokenize(await _read_json(request)))


# ---- middleware and app ----------------------------------------------------------------------


@web.middleware
async def _errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return json_response(exc.body(), status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status
        )
        message = (
            exc.text
            if exc.text and exc.text != exc.reason
            else f"{exc.status} {exc.reason}: {request.path}"
        )
        return json_response(error_body(message, kind, code=code), status=exc.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # noqa: BLE001 - a bug of ours, not the client's input
        logger.exception("internal error serving %s %s", request.method, request.path)
        request.app[INTERNAL_ERRORS].append(repr(exc))
        return json_response(
            error_body("internal server error", "server_error", code="internal_error"), status=500
        )


class _JSONErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering errors found before any handler runs (a
    malformed request line, an oversized header) with our JSON error body, not plain text."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)  # logs; raises if sent
        kind = "invalid_request_error" if status < 500 else "server_error"
        code = {408: "request_timeout", 413: "request_too_large"}.get(status)
        text = message or (str(exc) if exc else "") or f"{status} {plain.reason}"
        response = json_response(error_body(text, kind, code=code), status=status)
        response.force_close()
        return response


class _JSONErrorServer(web.Server):
    """aiohttp's server, building :class:`_JSONErrorHandler` connections."""

    def __call__(self) -> RequestHandler:
        return _JSONErrorHandler(self, loop=self._loop, **self._kwargs)


def _auth_middleware(api_key: str) -> Any:
    expected = api_key.encode()

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith(_PROTECTED_PREFIXES):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            # The scheme is case-insensitive (RFC 7235); the key is compared in constant time, as
            # bytes: aiohttp keeps bytes that are not UTF-8 as surrogate escapes, and turning
            # them back into those bytes (not re-encoding them) can never raise.
            given_bytes = given.strip().encode("utf-8", "surrogateescape")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given_bytes, expected):
                raise APIError(
                    "invalid or missing API key (send 'Authorization: Bearer <key>')",
                    status=401,
                    type="invalid_request_error",
                    code="invalid_api_key",
                )
        return await handler(request)

    return auth


def build_app(
    llm: EngineClient,
    *,
    api_key: str | None = None,
    info: ServingInfo | None = None,
    header_timeout_s: float = Timeouts.header_s,
    body_timeout_s: float = Timeouts.body_s,
    serving: OpenAIServing | None = None,
) -> web.Application:
    """The aiohttp application serving ``llm``.

    Args:
      llm: the engine client (an AsyncLLM, or the Ray replicas' client).
      api_key: require ``Authorization: Bearer <api_key>`` on the API routes; None: open.
      info: the served model's facts (default: read from ``llm``).
      header_timeout_s, body_timeout_s: see :class:`Timeouts`.
      serving: what answers the routes (default ``OpenAIServing(llm, info)``; the Ray ingress
        passes one that picks a replica per request).
    """
    middlewares = [_errors_middleware]
    if api_key:
        middlewares.append(_auth_middleware(api_key))
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[SERVING] = serving or OpenAIServing(llm, info)
    app[API_KEY] = api_key
    app[INTERNAL_ERRORS] = []
    app[TIMEOUTS_KEY] = Timeouts(header_timeout_s, body_timeout_s)
    app[DRAINING] = asyncio.Event()
    app.router.add_post("/v1/completions", _generation_handler("/v1/completions"))
    app.router.add_post("/v1/chat/completions", _generation_handler("/v1/chat/completions"))
    for url in POOLING_KINDS:  # /v1/embeddings, /pooling, /v1/score, /score
        app.router.add_post(url, _generation_handler(url, pooling=True))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_get("/v1/requests/{request_id}/ledger", _ledger)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/version", _version)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    return app


async def run_server(
    llm: EngineClient,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    ready: Callable[[str, int], None] | None = None,
    stop: asyncio.Event | None = None,
    dead_grace_s: float = 1.0,
    app: web.Application | None = None,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
) -> int:
    """Serves ``llm`` over HTTP until ``stop`` is set or the engine dies.

    Shutdown (``stop`` set, e.g. by SIGTERM) drains: the listening socket closes, new requests
    on open connections and ``/health`` get a 503 ``shutting_down``, and in-flight requests run
    to their end for up to ``shutdown_timeout_s``; those still running then are cancelled (their
    engine requests aborted, their KV blocks freed).

    Args:
      llm: the running engine client (an AsyncLLM, or the Ray replicas' ReplicaSet).
      host, port: where to listen (port 0 picks a free one).
      api_key: see ``build_app``.
      ready: called with (host, bound port) once listening.
      stop: set it to shut down (the ``serve`` command sets it on SIGINT/SIGTERM).
      dead_grace_s: after the engine dies, keep answering (503 on /health, errors to pending
        requests) this long before closing.
      app: a prebuilt ``build_app(llm, ...)`` (then ``api_key`` is ignored); default: built here.
      shutdown_timeout_s: how long a drain waits for in-flight requests, seconds.

    Returns:
      The process exit code: 0 after ``stop``, 1 if the engine died.
    """
    app = app if app is not None else build_app(llm, api_key=api_key)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
        keepalive_timeout=app[TIMEOUTS_KEY].header_s,
    )
    await runner.setup()
    assert runner.server is not None
    runner.server.__class__ = _JSONErrorServer
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_dead(_: BaseException) -> None:
        loop.call_soon_threadsafe(loop.call_later, dead_grace_s, stop.set)

    llm.add_dead_callback(on_dead)
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        if ready is not None:
            ready(host, bound)
        await stop.wait()
    finally:
        app[DRAINING].set()
        if not llm.errored:
            logger.info(
                "shutting down: draining %d in-flight requests (at most %g s)",
                llm.num_pending_requests,
                shutdown_timeout_s,
            )
        await runner.cleanup()  # stop listening, wait for handlers, cancel the rest
    return 1 if llm.errored else 0


def serve_until_signal(
    llm: EngineClient,
    args: argparse.Namespace,
    *,
    app: web.Application | None = None,
    what: str | None = None,
) -> int:
    """Serves ``llm`` with the ``serve`` flags in ``args`` until SIGINT/SIGTERM or engine death,
    then stops the engine.

    ``app`` replaces the app built from ``args`` (the Ray ingress builds its own), ``what`` the
    served model's name in the "serving ..." line.

    Returns:
      The exit code: 0 after a signal, 1 if the engine died or its thread did not stop (a step
      hung through the drain).
    """

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        served = app or build_app(
            llm,
            api_key=args.api_key,
            header_timeout_s=args.request_header_timeout_s,
            body_timeout_s=args.request_body_timeout_s,
        )
        name = what or llm.model_name
        return await run_server(
            llm,
            host=args.host,
            port=args.port,
            app=served,
            stop=stop,
            shutdown_timeout_s=args.shutdown_timeout_s,
            ready=lambda h, p: print(f"serving {name} on http://{h}:{p}", flush=True),
        )

    code = asyncio.run(main())
    llm.shutdown(timeout=1.0 if llm.errored else 5.0)  # a dead engine's thread may be hung
    if llm.is_running:
        logger.error("the engine thread did not stop (a step is hung); exiting anyway")
        code = code or 1
    return code
