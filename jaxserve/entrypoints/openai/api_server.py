"""The aiohttp OpenAI-compatible server, its ``serve`` subcommand, and a non-HTTP entry for the batch CLI.

Endpoints (OpenAI API reference; vLLM's extras):

    POST /v1/completions        legacy completions (prompt: str | [str] | [int] | [[int]])
    POST /v1/chat/completions   chat completions (the tokenizer's chat template)
    GET  /v1/models             the served model
    GET  /health                200 while the engine thread lives, else 503
    GET  /metrics               Prometheus text exposition (jaxserve/metrics.py)
    POST /tokenize              {"prompt"} or {"messages"} -> {"tokens", "count", "max_model_len"}
    POST /detokenize            {"tokens"} -> {"prompt"}
    GET  /version               {"version"}
    GET  /openapi.json          the OpenAPI 3.1 document, request schemas from ``protocol``

``stream: true`` answers with server-sent events: one ``data: {chunk}`` per event, then
``data: [DONE]``. A client that disconnects has its request aborted (the handler is cancelled,
``handler_cancellation=True``, and its streams are aborted in ``finally``) before the engine's
next step, which frees its KV blocks.

Every failure a client can cause is an OpenAI-style 4xx (``errors.APIError``); a middleware turns
anything else into a logged 500 and counts it in ``app[INTERNAL_ERRORS]`` (tests assert it
stays 0). With ``--api-key`` the ``/v1/*``, ``/tokenize`` and ``/detokenize`` routes need
``Authorization: Bearer <key>`` (401 otherwise); ``/health``, ``/metrics`` and ``/version`` stay
open, as in vLLM. With ``--max-waiting-requests`` a request that finds that many requests
waiting gets a 503 with ``Retry-After``.

Reuse without HTTP (the batch CLI): ``await serve_request(llm, url, body)`` takes an AsyncLLM, a
URL ("/v1/completions" or "/v1/chat/completions") and a parsed JSON body and returns
``(status, response_dict)``: the same validation, engine calls and response building as the
server, for non-streaming requests (``stream: true`` is a 400). The pieces are plain functions
too: ``protocol.CompletionRequest``/``ChatCompletionRequest`` (validation),
``serving_completion.prepare_completion``/``build_completion_response`` and
``serving_chat.prepare_chat``/``build_chat_response``.

If the engine thread dies, in-flight requests get an error (503 ``engine_dead``, or an error
event on a stream), ``/health`` answers 503, and ``run_server`` returns 1 after a short grace
period, so ``jaxserve serve`` exits non-zero instead of hanging.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import importlib.metadata
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pydantic
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from jaxserve.engine.async_llm import DEFAULT_STEP_TIMEOUT_S, EngineDeadError, RequestStream
from jaxserve.entrypoints.openai.openapi import openapi_document
from jaxserve.entrypoints.openai.sse import DONE_EVENT, SSEEncoder
from jaxserve.serving.chat import (
    create_chat,
    messages_as_dicts,
    prepare_chat,
    stream_chat,
)
from jaxserve.serving.completion import (
    create_completion,
    prepare_completion,
    stream_completion,
)
from jaxserve.serving.engine_calls import abort_all, engine_error
from jaxserve.serving.errors import (
    APIError,
    bad_request,
    error_body,
    from_validation_error,
    from_value_error,
    model_not_found,
)
from jaxserve.serving.json_io import dumps, parse_json_body
from jaxserve.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from jaxserve.serving.validation import (
    ServingInfo,
    check_priority,
    check_prompt_bytes,
    check_prompt_ids,
    check_queue,
)

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


LLM_KEY = web.AppKey("llm", object)
TIMEOUTS_KEY = web.AppKey("timeouts", Timeouts)
DRAINING = web.AppKey("draining", asyncio.Event)
INFO_KEY = web.AppKey("info", ServingInfo)
API_KEY = web.AppKey("api_key", object)
INTERNAL_ERRORS = web.AppKey("internal_errors", list)

MAX_BODY_BYTES = 16 * 2**20
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
_PARSE_OFF_LOOP_BYTES = 256 * 2**10
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


# ---- JSON out ------------------------------------------------------------------------------


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


def _validate(model: type[pydantic.BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None


# ---- non-HTTP entry (batch CLI) -------------------------------------------------------------


def prepare(llm: Any, info: ServingInfo, url: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """Validates a completions or chat body: returns ``(request_model, job)``.

    Raises:
      APIError: 404 for an unknown URL or model, 400 for a bad body (naming the field).
    """
    if isinstance(body.get("model"), str):
        info.check_model(body["model"])  # before any other work, as OpenAI does
    if url == "/v1/completions":
        request = _validate(CompletionRequest, body)
        check_priority(request.priority, info)
        return request, prepare_completion(request, info, llm.tokenizer)
    if url == "/v1/chat/completions":
        request = _validate(ChatCompletionRequest, body)
        check_priority(request.priority, info)
        return request, prepare_chat(request, info, llm.tokenizer)
    raise APIError(
        f"url {url!r} is not supported (use /v1/completions or /v1/chat/completions)",
        status=404,
        param="url",
        code="not_found",
    )


async def serve_request(
    llm: Any, url: str, body: dict[str, Any], info: ServingInfo | None = None
) -> tuple[int, dict[str, Any]]:
    """Serves one non-streaming completions or chat request without HTTP.

    Args:
      llm: a running AsyncLLM.
      url: "/v1/completions" or "/v1/chat/completions".
      body: the parsed JSON request body.
      info: the served model's facts (default: read from ``llm``).

    Returns:
      ``(status, body)``: 200 and the OpenAI response object, or the error status and
      ``{"error": {...}}`` (400 bad input, 404 unknown model or URL, 503 engine dead).

    Raises:
      Nothing for bad input or a dead engine: ``APIError`` and ``EngineDeadError`` are turned
      into ``(status, body)``. Other exceptions (bugs) propagate.
    """
    info = info or ServingInfo.from_engine(llm)
    try:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        request, job = prepare(llm, info, url, body)
        if request.stream:
            raise bad_request("stream is not supported here", param="stream")
        llm.check_health()
        if url == "/v1/completions":
            return 200, await create_completion(llm, job)
        return 200, await create_chat(llm, job)
    except APIError as exc:
        return exc.status, exc.body()
    except EngineDeadError as exc:
        error = engine_error(exc)
        return error.status, error.body()


# ---- HTTP handlers ---------------------------------------------------------------------------


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


async def _write_sse(
    request: web.Request, streams: list[RequestStream], chunks: AsyncIterator[dict[str, Any]]
) -> web.StreamResponse:
    """Streams ``chunks`` as SSE events, then ``data: [DONE]``.

    Each event is written as soon as it is made, except once every stream has finished: what
    is left then (the last token's chunk, the usage chunk, ``[DONE]``) follows without waiting,
    so it goes out in one write with the end of the response.
    """
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )
    encoder = SSEEncoder()
    try:
        await response.prepare(request)
        held: list[bytes] = []
        async for chunk in chunks:
            held.append(encoder.event(chunk))
            if not all(stream.finished for stream in streams):
                await response.write(held[0] if len(held) == 1 else b"".join(held))
                held.clear()
        held.append(DONE_EVENT)
        await response.write_eof(b"".join(held))
    except ConnectionResetError:  # the client went away; its requests are aborted below
        pass
    finally:
        abort_all(streams)
        await chunks.aclose()  # type: ignore[attr-defined]
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


def _generation_handler(url: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        llm = request.app[LLM_KEY]
        info = request.app[INFO_KEY]
        _check_not_draining(request)
        body = await _read_json(request)
        # Tokenizing and rendering templates of long prompts takes a while: off the event loop.
        parsed, job = await asyncio.to_thread(prepare, llm, info, url, body)
        try:
            llm.check_health()
        except EngineDeadError as exc:
            raise engine_error(exc) from None
        check_queue(llm, info)
        if parsed.stream:
            start = stream_completion if url == "/v1/completions" else stream_chat
            streams, chunks = await start(llm, job)
            return await _write_sse(request, streams, chunks)
        create = create_completion if url == "/v1/completions" else create_chat
        return json_response(await create(llm, job))

    return handler


def _model_card(info: ServingInfo) -> dict[str, Any]:
    return {
        "id": info.model_name,
        "object": "model",
        "created": info.created,
        "owned_by": "jaxserve",
        "root": info.model_path,
        "parent": None,
        "max_model_len": info.max_model_len,
    }


async def _models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the served model (OpenAI's list-models shape)."""
    return json_response({"object": "list", "data": [_model_card(request.app[INFO_KEY])]})


async def _model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: the served model's card, or 404 ``model_not_found``."""
    info = request.app[INFO_KEY]
    name = request.match_info["model"]
    if name != info.model_name:
        raise model_not_found(name)
    return json_response(_model_card(info))


async def _ledger(request: web.Request) -> web.Response:
    """``GET /v1/requests/{request_id}/ledger``: a finished request's ledger (engine request id
    or response id), or 404 ``ledger_not_found`` when unknown or past ``--ledger-history``."""
    request_id = request.match_info["request_id"]
    return ledger_response(request_id, await request.app[LLM_KEY].get_ledger(request_id))


def ledger_response(request_id: str, ledger: Any) -> web.Response:
    """The ledger as JSON, or the 404 ``ledger_not_found`` when ``ledger`` is None."""
    if ledger is None:
        raise APIError(
            f"no ledger for request {request_id!r}: unknown, unfinished, or older than the "
            "last --ledger-history finished requests",
            status=404,
            param="request_id",
            code="ledger_not_found",
        )
    return json_response(ledger)


async def _health(request: web.Request) -> web.Response:
    llm = request.app[LLM_KEY]
    _check_not_draining(request)  # a load balancer stops sending here while we drain
    if llm.errored:
        return json_response(
            error_body(
                f"the engine is dead: {llm.dead_error!r}", "server_error", code="engine_dead"
            ),
            status=503,
        )
    return web.Response(status=200)


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = await request.app[LLM_KEY].render_metrics()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _openapi(request: web.Request) -> web.Response:
    """``GET /openapi.json``: the API's OpenAPI document (``openapi.openapi_document``)."""
    return json_response(openapi_document(request.app[INFO_KEY].model_name))


async def _version(request: web.Request) -> web.Response:
    try:
        version = importlib.metadata.version("jaxserve")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return json_response({"version": version})


def _tokenize_body(tokenizer: Any, info: ServingInfo, body: TokenizeRequest) -> list[int]:
    """``/tokenize``'s work (in a worker thread): the byte-length check, then the tokenizer."""
    try:
        if body.messages is not None:
            messages = messages_as_dicts(body.messages)
            check_prompt_bytes([m["content"] for m in messages], info, field="messages")
            return tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt)
        check_prompt_bytes([body.prompt], info)
        return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    except ValueError as exc:
        raise from_value_error(exc) from None


async def _tokenize(request: web.Request) -> web.Response:
    llm = request.app[LLM_KEY]
    info = request.app[INFO_KEY]
    body = _validate(TokenizeRequest, await _read_json(request))
    info.check_model(body.model)
    # Off the event loop: a long prompt must not stall /health and every other client.
    tokens = await asyncio.to_thread(_tokenize_body, llm.tokenizer, info, body)
    return json_response(
        {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens}
    )


async def _detokenize(request: web.Request) -> web.Response:
    llm = request.app[LLM_KEY]
    info = request.app[INFO_KEY]
    body = _validate(DetokenizeRequest, await _read_json(request))
    info.check_model(body.model)
    if body.tokens:
        check_prompt_ids(
            body.tokens,
            dataclasses.replace(info, max_model_len=len(body.tokens), enable_chunked_prefill=True),
            field="tokens",
        )
    return json_response({"prompt": llm.tokenizer.decode(body.tokens)})


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
    llm: Any,
    *,
    api_key: str | None = None,
    info: ServingInfo | None = None,
    header_timeout_s: float = Timeouts.header_s,
    body_timeout_s: float = Timeouts.body_s,
    routes: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]] | None = None,
) -> web.Application:
    """The aiohttp application serving ``llm`` (an AsyncLLM).

    Args:
      llm: the running AsyncLLM.
      api_key: require ``Authorization: Bearer <api_key>`` on the API routes; None: open.
      info: the served model's facts (default: read from ``llm``).
      header_timeout_s, body_timeout_s: see :class:`Timeouts`.
      routes: handlers replacing this module's for the given paths (the Ray ingress answers
        generation, ledgers, ``/health`` and ``/metrics`` from its replicas), same methods.
    """
    middlewares = [_errors_middleware]
    if api_key:
        middlewares.append(_auth_middleware(api_key))
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[LLM_KEY] = llm
    app[INFO_KEY] = info or ServingInfo.from_engine(llm)
    app[API_KEY] = api_key
    app[INTERNAL_ERRORS] = []
    app[TIMEOUTS_KEY] = Timeouts(header_timeout_s, body_timeout_s)
    app[DRAINING] = asyncio.Event()
    own = {
        "/v1/completions": _generation_handler("/v1/completions"),
        "/v1/chat/completions": _generation_handler("/v1/chat/completions"),
        "/v1/requests/{request_id}/ledger": _ledger,
        "/health": _health,
        "/metrics": _metrics,
    }
    own.update(routes or {})
    app.router.add_post("/v1/completions", own["/v1/completions"])
    app.router.add_post("/v1/chat/completions", own["/v1/chat/completions"])
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_get("/v1/requests/{request_id}/ledger", own["/v1/requests/{request_id}/ledger"])
    app.router.add_get("/health", own["/health"])
    app.router.add_get("/metrics", own["/metrics"])
    app.router.add_get("/version", _version)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    return app


async def run_server(
    llm: Any,
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
      llm: the running AsyncLLM.
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


# ---- the `serve` subcommand ------------------------------------------------------------------


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``serve``: every EngineArgs flag (vLLM's names) plus --host, --port and --api-key."""
    from jaxserve.config import EngineArgs

    parser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions).",
    )
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to listen on (0: any free port)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("JAXSERVE_API_KEY"),
        help="require 'Authorization: Bearer <key>' on the API routes "
        "(default: $JAXSERVE_API_KEY, else open)",
    )
    parser.add_argument(
        "--request-header-timeout-s",
        type=float,
        default=Timeouts.header_s,
        help="close a connection whose request head has not fully arrived this many seconds "
        "after connecting or after the previous response (slow clients)",
    )
    parser.add_argument(
        "--request-body-timeout-s",
        type=float,
        default=Timeouts.body_s,
        help="answer 408 when a request body takes longer than this to arrive",
    )
    parser.add_argument(
        "--step-timeout-s",
        type=float,
        default=DEFAULT_STEP_TIMEOUT_S,
        help="watchdog: a model step running longer than this marks the engine dead (/health "
        "503, pending requests get an error, exit 1); 0 disables it",
    )
    parser.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM/SIGINT stop accepting and let in-flight requests finish for up to "
        "this long, then abort them and exit 0",
    )
    from jaxserve.entrypoints.ray_serve import add_ray_args  # Ray itself is imported only if used

    add_ray_args(parser)
    parser.set_defaults(func=run_serve)
    return parser


_SERVER_FLAGS = (
    "host",
    "port",
    "request_header_timeout_s",
    "request_body_timeout_s",
    "step_timeout_s",
    "shutdown_timeout_s",
    "data_parallel_size",
    "distributed_executor_backend",
    "ray_address",
    "routing",
)


def config_report(cfg: Any, args: argparse.Namespace | None = None) -> list[str]:
    """The resolved-config log lines: one per part of an EngineConfig, then the server flags."""
    lines = ["resolved config:"]
    for part in dataclasses.fields(cfg):
        value = getattr(cfg, part.name)  # a config section, or a plain knob (ledger_history)
        shown = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        lines.append(f"  {part.name}: {shown}")
    if args is not None:
        server = {name: getattr(args, name) for name in _SERVER_FLAGS if hasattr(args, name)}
        server["api_key"] = "set" if getattr(args, "api_key", None) else None
        lines.append(f"  server: {server}")
    return lines


def _startup_report(llm: Any, startup_s: float, args: argparse.Namespace | None = None) -> str:
    cfg = llm.engine_config
    lines = config_report(cfg, args)
    runner = getattr(llm.engine, "runner", None)
    if runner is not None and hasattr(runner, "token_buckets"):
        lines.append(
            f"  step token buckets: {list(runner.token_buckets)} "
            f"(sequence buckets {list(runner.seq_buckets)})"
        )
    blocks, size = cfg.cache.num_gpu_blocks, cfg.cache.block_size
    lines.append(
        f"KV pool: {blocks} blocks x {size} tokens ({max(blocks - 1, 0) * size} usable tokens; "
        f"block 0 is the null block)"
    )
    num_host = getattr(cfg.cache, "num_host_blocks", 0)
    if num_host:
        lines.append(
            f"KV offloading: {num_host} host blocks ({num_host * size} tokens, "
            f"{cfg.cache.kv_offloading_size} GiB, backend {cfg.cache.kv_offloading_backend}); "
            f"resume cost probe: load {cfg.cache.offload_load_s_per_call * 1e6:.1f} us per call "
            f"+ {cfg.cache.offload_load_s_per_block * 1e6:.1f} us per block, recompute "
            f"{cfg.cache.offload_recompute_s_per_token * 1e6:.2f} us per token"
        )
    compile_s = getattr(runner, "compile_seconds", None)
    if compile_s is not None:
        lines.append(f"compile time: {compile_s:.1f} s (startup {startup_s:.1f} s)")
    else:
        lines.append(f"startup (load + KV sizing + compile): {startup_s:.1f} s")
    return "\n".join(lines)


def check_port_free(host: str, port: int) -> None:
    """Raises ValueError (saying what to do) when ``host:port`` cannot be listened on now."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's listener
            s.bind(infos[0][4])
    except OSError as e:
        raise ValueError(
            f"port: cannot listen on {host}:{port} ({e.strerror or e}); stop the process using "
            "it or pass --port N (--port 0 picks a free one)"
        ) from None


def run_serve(args: argparse.Namespace) -> None:
    """The ``serve`` command: builds the engine, prints the config, serves until SIGINT/SIGTERM.

    Exits 0 after a signal (in-flight requests drained), 1 if the engine died (an error, or the
    step watchdog).
    """
    from jaxserve.config import EngineArgs
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.ray_serve import run_ray_serve, uses_ray

    if uses_ray(args):
        run_ray_serve(args)
        return
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.check(need_tokenizer=True)  # before loading and compiling: one-line errors
    check_port_free(args.host, args.port)
    start = time.perf_counter()
    llm = AsyncLLM.from_engine_args(engine_args, step_timeout_s=args.step_timeout_s)
    print(_startup_report(llm, time.perf_counter() - start, args), flush=True)
    sys.exit(serve_until_signal(llm, args))


def serve_until_signal(
    llm: Any,
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
