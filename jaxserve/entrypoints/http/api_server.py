"""The aiohttp OpenAI-compatible server: routes, middlewares and SSE writing.

Endpoints (OpenAI API reference; vLLM's extras):

    POST /v1/completions        legacy completions (prompt: str | [str] | [int] | [[int]])
    POST /v1/chat/completions   chat completions (the tokenizer's chat template)
    POST /v1/responses          OpenAI's Responses API (serving/responses.py)
    GET  /v1/responses/{id}     a stored response; DELETE forgets it
    POST /v1/embeddings         embeddings (--runner pooling; serving/pooling.py)
    POST /pooling               vLLM's pooled vectors; POST /v1/score (and /score): cosine
    GET  /v1/models             the served model (once per --served-model-name), LoRA adapters
    POST /v1/load_lora_adapter  {"lora_name", "lora_path"}; /v1/unload_lora_adapter (--enable-lora)
    GET  /v1/requests/{id}/ledger  a finished request's ledger
    GET  /health                200 while the engine serves, else 503
    GET  /metrics               Prometheus text exposition (jaxserve/metrics.py)
    POST /tokenize              {"prompt"} or {"messages"} -> {"tokens", "count", "max_model_len"}
    POST /detokenize            {"tokens"} -> {"prompt"}
    GET  /version               {"version"}
    GET  /openapi.json          the OpenAPI 3.1 document, request schemas from ``protocol``
    POST /sleep?level=&mode=    sleep mode (--enable-sleep-mode; vLLM's): free device memory
    POST /wake_up?tags=         take it back; GET /is_sleeping: {"is_sleeping"}

Each route reads the body and hands it to the transport-free layer
(:class:`jaxserve.serving.endpoints.OpenAIServing`: validation, prompts, engine calls, response
bodies), then writes what it returns: a JSON body, or for ``stream: true`` server-sent events,
one ``data: {chunk}`` per event, then ``data: [DONE]``. A client that disconnects has its
request aborted (the handler is cancelled, ``handler_cancellation=True``, and its streams are
aborted in ``finally``) before the engine's next step, which frees its KV blocks.

Every failure a client can cause is an OpenAI-style 4xx (``APIError``); a middleware turns
anything else into a logged 500 and counts it in ``app[INTERNAL_ERRORS]`` (tests assert it
stays 0). With ``--api-key`` the ``/v1/*``, ``/tokenize``, ``/detokenize``, ``/sleep``,
``/wake_up``, ``/pooling`` and ``/score`` routes need ``Authorization: Bearer <key>`` (401
otherwise); ``/health``, ``/metrics``, ``/version`` and ``/is_sleeping`` stay open, as in
vLLM. With several keys (``--api-key`` repeated or a comma list) a request's ledger, and a
stored ``/v1/responses`` response, is readable only with the key that created it;
``--no-ledger-route`` removes the ledger route. With ``--max-waiting-requests`` a request that
finds that many requests waiting gets a 503 with ``Retry-After``; so does one that finds the
engine asleep.

Transport options: TLS (``--ssl-keyfile`` / ``--ssl-certfile``: ``run_server``'s
``ssl_context``), CORS (``cors.py``) and ``--root-path`` (every route is served both at its
path and under the prefix, for a proxy that may or may not strip it; ``/openapi.json`` names
the prefix in ``servers``).

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
import os
import signal
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_urldispatcher import _default_expect_handler

from jaxserve.engine.protocol import EngineClient
from jaxserve.entrypoints.http.cors import CORSPolicy, cors_middleware, install_cors
from jaxserve.entrypoints.http.openapi import LEDGER_PATH, openapi_document
from jaxserve.entrypoints.http.sse import DONE_EVENT, SSEEncoder, named_event
from jaxserve.serving.endpoints import (
    LARGE_BODY_BYTES,
    OpenAIServing,
    Reply,
    StreamReply,
    off_loop,
    version,
)
from jaxserve.serving.errors import APIError, error_body
from jaxserve.serving.json_io import dumps, parse_json_body
from jaxserve.serving.pooling import POOLING_KINDS
from jaxserve.serving.validation import ServingInfo, request_body_limit

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


@dataclasses.dataclass
class Drain:
    """A server's shutdown state: the generating requests in flight and whether the drain window
    has run out (the requests still in flight are then cut: :func:`run_server`).

    Attributes:
      in_flight: the handler tasks of generating requests that have not answered yet.
      cut: True once the window ran out; a handler cancelled then answers with
        :func:`shutdown_cut_error` instead of a truncated response.
      window_s: the drain window, seconds (named in the error).
    """

    in_flight: set[asyncio.Task] = dataclasses.field(default_factory=set)
    cut: bool = False
    window_s: float = 0.0


SERVING = web.AppKey("serving", OpenAIServing)
TIMEOUTS_KEY = web.AppKey("timeouts", Timeouts)
DRAINING = web.AppKey("draining", asyncio.Event)
DRAIN = web.AppKey("drain", Drain)
API_KEY = web.AppKey("api_key", object)
KEY_ID = web.RequestKey("api_key_id", str)
"""Which of several API keys authenticated a request (its index, as a string)."""
INTERNAL_ERRORS = web.AppKey("internal_errors", list)
ROOT_PATH = web.AppKey("root_path", str)
BODY_LIMIT = web.AppKey("body_limit", int)
"""Bytes above which a request body is refused (413) before it is read
(``validation.request_body_limit``)."""

MAX_BODY_BYTES = 16 * 2**20
"""The largest request body, whatever the model's limits (``BODY_LIMIT`` is often lower)."""
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
_PROTECTED_PREFIXES = (
    "/v1/",
    "/tokenize",
    "/detokenize",
    "/sleep",
    "/wake_up",
    "/pooling",
    "/score",
)

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


def _check_json_media_type(request: web.Request) -> None:
    """Bodies are JSON: no ``Content-Type``, ``application/json`` or ``application/*+json``
    (as FastAPI, and so vLLM, reads them); another media type is a 415."""
    given = request.headers.get("Content-Type")
    if given is None:
        return
    kind = given.split(";", 1)[0].strip().lower()
    if kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json")):
        return
    raise APIError(
        f"the request body must be JSON: send Content-Type: application/json (got {given[:100]!r})",
        status=415,
        code="unsupported_media_type",
    )


async def _read_json(request: web.Request) -> dict[str, Any]:
    """The parsed body (see :func:`_read_json_sized`)."""
    return (await _read_json_sized(request))[0]


async def _read_json_sized(request: web.Request) -> tuple[dict[str, Any], bool]:
    """The parsed body, and whether it was large (over ``LARGE_BODY_BYTES``: parsed in the
    large-body lane). A client that takes longer than the body timeout to send it gets a 408
    and its connection closed (a byte-per-second body must not hold a connection forever).

    Raises:
      APIError: 415 for a media type other than JSON, 408 as above, 400 for a body that is not
        a JSON object in UTF-8.
    """
    _check_json_media_type(request)
    timeout = request.app[TIMEOUTS_KEY].body_s
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except web.HTTPRequestEntityTooLarge:  # a chunked body (no Content-Length) past the limit:
        raise body_too_large(request.app[BODY_LIMIT]) from None  # cut where it passed it
    except TimeoutError:
        raise APIError(
            f"the request body did not arrive within {timeout:g} s",
            status=408,
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    if len(raw) > LARGE_BODY_BYTES:  # a 16 MB body takes ~0.2 s to parse: off the loop, in
        return await off_loop(parse_json_body, raw, large=True), True  # the large-body lane
    return parse_json_body(raw), False


def body_too_large(limit: int, declared: int | None = None) -> APIError:
    """The 413 of a body over ``limit`` bytes: declared so (``Content-Length``), or a chunked
    one that passed it while arriving. Its connection is then closed (:func:`closing`)."""
    size = f"declares {declared} bytes" if declared is not None else f"passed {limit} bytes"
    return APIError(
        f"the request body is too large: it {size}, and this server takes at most {limit} bytes "
        f"(what the largest request this model can serve needs: a prompt of max_model_len "
        f"tokens and every field at its cap); send a shorter prompt, or fewer prompts per request",
        status=413,
        code="request_too_large",
        headers={"Connection": "close"},
    )


def closing(response: web.Response) -> web.Response:
    """``response``, after which its connection is closed. What the client still sends of its
    body is discarded unparsed for up to aiohttp's ``lingering_time`` (10 s) first: closing at
    once, with those bytes unread, resets the connection, and a client still sending (httpx
    sends the whole body before it reads) then gets a connection error instead of the answer."""
    response.force_close()
    return response


def _over_limit(request: BaseRequest) -> web.Response | None:
    """The 413 (its connection then closed) when the request's ``Content-Length`` is over the
    app's ``BODY_LIMIT``; else None."""
    limit = request.app[BODY_LIMIT]
    declared = request.content_length
    if declared is None or declared <= limit:
        return None
    error = body_too_large(limit, declared)
    return closing(json_response(error.body(), status=error.status, headers=error.headers))


@web.middleware
async def _body_limit_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Refuses a body declared larger than ``BODY_LIMIT`` from its headers, before any
    handler reads it (what arrives meanwhile is discarded unparsed: :func:`closing`) (#38: eight 15.7 MB prompts were received and parsed whole to be
    refused with a 400, slowing a small request beside them 4-11x)."""
    return _over_limit(request) or await handler(request)


async def _expect_handler(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: the 413 instead of ``100 Continue`` for a body declared
    over the limit (such a client then never sends it), else aiohttp's default."""
    response = _over_limit(request)
    if response is not None:
        return response
    return await _default_expect_handler(request)


def shutdown_cut_error(window_s: float) -> APIError:
    """The 503 a request gets when the server shuts down under it: it was still running when
    the drain window (``--shutdown-timeout-s``) ran out."""
    return APIError(
        f"the server shut down before this request finished: it was still running when the "
        f"drain window of {window_s:g} s (--shutdown-timeout-s) ran out; retry it elsewhere",
        status=503,
        type="server_error",
        code="shutting_down",
        headers={"Connection": "close"},
    )


def _was_cut(request: web.Request) -> bool:
    """True when the handler was cancelled because the drain window ran out (not because its
    client went away); the task's cancellation is then taken back, so it can answer."""
    if not request.app[DRAIN].cut:
        return False
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    return True


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
    encode = named_event if reply.named_events else SSEEncoder().event
    streams = reply.streams
    cut = False
    sent = 0  # events made: the next one's sequence_number on a named-event stream
    try:
        await response.prepare(request)
        held: list[bytes] = []
        async for chunk in reply.chunks:
            held.append(encode(chunk))
            sent += 1
            if not all(stream.finished for stream in streams):
                await response.write(held[0] if len(held) == 1 else b"".join(held))
                held.clear()
        if not reply.named_events:
            held.append(DONE_EVENT)
        await response.write_eof(b"".join(held))
    except ConnectionResetError:  # the client went away; its requests are aborted below
        pass
    except asyncio.CancelledError:  # the client went away, or the drain window ran out
        if not _was_cut(request):
            raise
        cut = True
    finally:
        await reply.close()
    if cut:  # an error event and [DONE], not a truncated body (a whole event was written last)
        error = shutdown_cut_error(request.app[DRAIN].window_s)
        if not response.prepared:
            raise error
        if reply.named_events:  # the Responses API's error event; its streams have no [DONE]
            event = named_event(
                {
                    "type": "error",
                    "sequence_number": sent,
                    "code": error.code,
                    "message": error.message,
                    "param": None,
                }
            )
        else:
            event = encode(error.body()) + DONE_EVENT
        try:
            await response.write_eof(event)
        except ConnectionResetError:
            pass
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
        drain = request.app[DRAIN]
        task = asyncio.current_task()
        assert task is not None
        drain.in_flight.add(task)
        try:
            body, large = await _read_json_sized(request)
            serving = request.app[SERVING]
            serve = serving.pool if pooling else serving.generate
            reply = await serve(url, body, owner=request.get(KEY_ID), large=large)
            return await _send(request, reply)
        except asyncio.CancelledError:  # the client went away, or the drain window ran out
            if not _was_cut(request):
                raise
            raise shutdown_cut_error(drain.window_s) from None  # a stream answers in _write_sse
        finally:
            drain.in_flight.discard(task)

    return handler


async def _models(request: web.Request) -> web.Response:
    return json_response(request.app[SERVING].models())


async def _model(request: web.Request) -> web.Response:
    return json_response(request.app[SERVING].model(request.match_info["model"]))


async def _ledger(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    ledger = await serving.ledger(request.match_info["request_id"], owner=request.get(KEY_ID))
    return json_response(ledger)


async def _health(request: web.Request) -> web.StreamResponse:
    _check_not_draining(request)  # a load balancer stops sending here while we drain
    return await _send(request, request.app[SERVING].health())


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = await request.app[SERVING].metrics()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _openapi(request: web.Request) -> web.Response:
    """``GET /openapi.json``: the API's OpenAPI document (``openapi.openapi_document``)."""
    app = request.app
    ledger_route = ("GET", LEDGER_PATH) in served_routes(app)
    return json_response(openapi_document(app[SERVING].info, app[ROOT_PATH], ledger_route))


async def _stored_response(request: web.Request) -> web.Response:
    serving, response_id = request.app[SERVING], request.match_info["response_id"]
    return json_response(serving.stored_response(response_id, owner=request.get(KEY_ID)))


async def _delete_response(request: web.Request) -> web.Response:
    serving, response_id = request.app[SERVING], request.match_info["response_id"]
    return json_response(serving.delete_response(response_id, owner=request.get(KEY_ID)))


async def _sleep(request: web.Request) -> web.Response:
    query = request.query
    return json_response(await request.app[SERVING].sleep(query.get("level"), query.get("mode")))


async def _wake_up(request: web.Request) -> web.Response:
    tags = request.query.getall("tags", [])
    return json_response(await request.app[SERVING].wake_up(tags))


async def _load_lora_adapter(request: web.Request) -> web.Response:
    return json_response(await request.app[SERVING].load_lora_adapter(await _read_json(request)))


async def _unload_lora_adapter(request: web.Request) -> web.Response:
    serving = request.app[SERVING]
    return json_response(await serving.unload_lora_adapter(await _read_json(request)))


async def _is_sleeping(request: web.Request) -> web.Response:
    return json_response(request.app[SERVING].is_sleeping())


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
        response = json_response(exc.body(), status=exc.status, headers=exc.headers)
        if exc.headers.get("Connection") == "close":  # a 408 / 413 / 503 shutting_down
            return closing(response)
        return response
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


def api_keys(values: str | Sequence[str] | None) -> tuple[str, ...]:
    """The API keys of ``--api-key`` values (each may be a comma-separated list; blanks are
    dropped), in order, without duplicates."""
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    keys = [key.strip() for value in values for key in value.split(",")]
    return tuple(dict.fromkeys(key for key in keys if key))


def _auth_middleware(keys: tuple[str, ...], root_path: str = "") -> Any:
    expected = [key.encode() for key in keys]
    tell_apart = len(keys) > 1  # one key: every caller is the same one
    protected = _PROTECTED_PREFIXES + tuple(root_path + p for p in _PROTECTED_PREFIXES if root_path)

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith(protected):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            # The scheme is case-insensitive (RFC 7235); the key is compared in constant time, as
            # bytes, with every key (which one matched takes no longer to find): aiohttp keeps
            # bytes that are not UTF-8 as surrogate escapes, and turning them back into those
            # bytes (not re-encoding them) can never raise.
            given_bytes = given.strip().encode("utf-8", "surrogateescape")
            matches = [hmac.compare_digest(given_bytes, key) for key in expected]
            if scheme.lower() != "bearer" or not any(matches):
                raise APIError(
                    "invalid or missing API key (send 'Authorization: Bearer <key>')",
                    status=401,
                    type="invalid_request_error",
                    code="invalid_api_key",
                )
            if tell_apart:
                request[KEY_ID] = str(matches.index(True))
        return await handler(request)

    return auth


def build_app(
    llm: EngineClient,
    *,
    api_key: str | Sequence[str] | None = None,
    info: ServingInfo | None = None,
    header_timeout_s: float = Timeouts.header_s,
    body_timeout_s: float = Timeouts.body_s,
    serving: OpenAIServing | None = None,
    ledger_route: bool = True,
    cors: CORSPolicy | None = None,
    root_path: str = "",
) -> web.Application:
    """The aiohttp application serving ``llm``.

    Args:
      llm: the engine client (an AsyncLLM, or the Ray replicas' client).
      api_key: require ``Authorization: Bearer <key>`` on the API routes with one of these keys
        (a key, a comma-separated list, or a sequence of either: :func:`api_keys`); None or
        empty: open. With several keys a ledger is readable only with the key that created its
        request.
      ledger_route: serve ``GET /v1/requests/{id}/ledger`` (False: 404, as any unknown route).
      info: the served model's facts (default: read from ``llm``).
      header_timeout_s, body_timeout_s: see :class:`Timeouts`.
      serving: what answers the routes (default ``OpenAIServing(llm, info)``; the Ray ingress
        passes one that picks a replica per request).
      cors: which browser origins may call (``cors.CORSPolicy``); None: no CORS headers.
      root_path: a path prefix (``--root-path``, e.g. "/llm") every route is also served under.

    Raises:
      ValueError: a root_path that does not start with "/" (or ends with one).
    """
    if root_path and (not root_path.startswith("/") or root_path.endswith("/")):
        raise ValueError(f"root_path must start with '/' and not end with it, got {root_path!r}")
    middlewares = [_errors_middleware, _body_limit_middleware]
    if cors is not None and cors.enabled:
        middlewares.append(cors_middleware(cors))  # before auth: preflights carry no key
    keys = api_keys(api_key)
    if keys:
        middlewares.append(_auth_middleware(keys, root_path))
    serving = serving or OpenAIServing(llm, info)
    limit = request_body_limit(serving.info, MAX_BODY_BYTES)
    app = web.Application(middlewares=middlewares, client_max_size=limit)
    if cors is not None and cors.enabled:
        install_cors(app, cors)
    app[SERVING] = serving
    app[BODY_LIMIT] = limit
    app[API_KEY] = keys or None
    app[INTERNAL_ERRORS] = []
    app[TIMEOUTS_KEY] = Timeouts(header_timeout_s, body_timeout_s)
    app[DRAINING] = asyncio.Event()
    app[DRAIN] = Drain()
    app[ROOT_PATH] = root_path
    router = app.router
    router.add_post(
        "/v1/completions", _generation_handler("/v1/completions"), expect_handler=_expect_handler
    )
    router.add_post(
        "/v1/chat/completions",
        _generation_handler("/v1/chat/completions"),
        expect_handler=_expect_handler,
    )
    router.add_post(
        "/v1/responses", _generation_handler("/v1/responses"), expect_handler=_expect_handler
    )
    for url in POOLING_KINDS:  # /v1/embeddings, /pooling, /v1/score, /score
        router.add_post(url, _generation_handler(url, pooling=True), expect_handler=_expect_handler)
    router.add_get("/v1/responses/{response_id}", _stored_response)
    router.add_delete("/v1/responses/{response_id}", _delete_response)
    router.add_get("/v1/models", _models)
    router.add_get("/v1/models/{model}", _model)
    if ledger_route:
        router.add_get(LEDGER_PATH, _ledger)
    router.add_get("/health", _health)
    router.add_get("/metrics", _metrics)
    router.add_get("/version", _version)
    router.add_get("/openapi.json", _openapi)
    router.add_post("/tokenize", _tokenize, expect_handler=_expect_handler)
    router.add_post("/detokenize", _detokenize, expect_handler=_expect_handler)
    router.add_post("/sleep", _sleep, expect_handler=_expect_handler)
    router.add_post("/wake_up", _wake_up, expect_handler=_expect_handler)
    router.add_get("/is_sleeping", _is_sleeping)
    router.add_post("/v1/load_lora_adapter", _load_lora_adapter, expect_handler=_expect_handler)
    router.add_post("/v1/unload_lora_adapter", _unload_lora_adapter, expect_handler=_expect_handler)
    if root_path:
        for route in list(router.routes()):
            if route.method != "HEAD":  # add_get added these; the copies get their own
                path = route.resource.canonical
                router.add_route(
                    route.method, root_path + path, route.handler, expect_handler=_expect_handler
                )
    return app


def served_routes(app: web.Application) -> set[tuple[str, str]]:
    """``(method, path template)`` of every route ``app`` serves (HEAD and the ``--root-path``
    copies left out): what ``/openapi.json`` must describe."""
    prefix = app[ROOT_PATH]
    return {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.method != "HEAD"
        and not (prefix and route.resource.canonical.startswith(prefix + "/"))
    }


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
    ssl_context: ssl.SSLContext | None = None,
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
      ssl_context: serve HTTPS with it (``make_ssl_context``); None: plain HTTP.

    Returns:
      The process exit code: 0 after ``stop``, 1 if the engine died.
    """
    app = app if app is not None else build_app(llm, api_key=api_key)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=CUT_ANSWER_S,  # our own drain() has waited for the handlers
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
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
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
        await drain(runner, app[DRAIN], shutdown_timeout_s)
        await runner.cleanup()  # idle connections closed; every handler has answered
    return 1 if llm.errored else 0


CUT_ANSWER_S = 0.5
"""How long cut handlers get to write their 503 / error event once the drain window ran out."""


async def drain(runner: web.AppRunner, state: Drain, window_s: float) -> None:
    """Stops listening, then lets the generating requests in flight finish for up to
    ``window_s``; those still running then are cut: each handler is cancelled with
    ``state.cut`` set, which aborts its engine requests and answers a 503 ``shutting_down``
    (a JSON body, or on a stream an error event and ``[DONE]``) within ``CUT_ANSWER_S``."""
    for site in list(runner.sites):
        await site.stop()  # no new connections; open ones get 503 shutting_down (DRAINING)
    state.window_s = window_s
    deadline = time.monotonic() + window_s
    while state.in_flight and (left := deadline - time.monotonic()) > 0:
        await asyncio.wait(set(state.in_flight), timeout=left)
    if not state.in_flight:
        return
    logger.warning(
        "shutting down: the drain window (%g s) ran out; cutting %d requests with a 503",
        window_s,
        len(state.in_flight),
    )
    state.cut = True
    tasks = set(state.in_flight)
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=CUT_ANSWER_S)


def app_options(args: argparse.Namespace) -> dict[str, Any]:
    """``build_app``'s keyword arguments from the ``serve`` flags (the Ray ingress too)."""
    return {
        "api_key": args.api_key,
        "header_timeout_s": args.request_header_timeout_s,
        "body_timeout_s": args.request_body_timeout_s,
        "cors": CORSPolicy(
            tuple(args.allowed_origins),
            tuple(args.allowed_methods),
            tuple(args.allowed_headers),
            args.allow_credentials,
        ),
        "root_path": args.root_path,
        "ledger_route": getattr(args, "ledger_route", True),
    }


def make_ssl_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    """The server's TLS context from ``--ssl-certfile`` / ``--ssl-keyfile`` (PEM), or None
    when neither is given.

    Raises:
      ValueError: only one is given, or they cannot be read or do not match (naming the flag).
    """
    if not certfile and not keyfile:
        return None
    if not certfile or not keyfile:
        missing = "ssl_certfile" if not certfile else "ssl_keyfile"
        raise ValueError(f"{missing}: TLS needs both --ssl-certfile and --ssl-keyfile")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"ssl_certfile: cannot load the certificate {certfile!r} with the key {keyfile!r} "
            f"({getattr(exc, 'strerror', None) or exc})"
        ) from None
    return context


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

    Returns within ``--shutdown-timeout-s`` + 1 s of the signal: the drain window, the cut
    requests' answers, then the engine thread's current step if it ends in time (it is not
    waited for past that, nor are worker threads still tokenizing a prompt; see
    :func:`exit_now`).

    Returns:
      The exit code: 0 after a signal, 1 if the engine died or its thread did not stop (a step
      hung through the drain).
    """
    signalled: list[float] = []

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            signalled.append(time.monotonic())
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        served = app or build_app(llm, **app_options(args))
        name = what or llm.model_name
        tls = make_ssl_context(args.ssl_certfile, args.ssl_keyfile)
        scheme = "https" if tls is not None else "http"
        return await run_server(
            llm,
            host=args.host,
            port=args.port,
            app=served,
            stop=stop,
            shutdown_timeout_s=args.shutdown_timeout_s,
            ssl_context=tls,
            ready=lambda h, p: print(
                f"serving {name} on {scheme}://{h}:{p}{args.root_path}", flush=True
            ),
        )

    code = run_loop(main())
    if signalled:  # what is left of window + 1 s (the engine thread ends after its step)
        left = signalled[0] + args.shutdown_timeout_s + SHUTDOWN_SLACK_S - time.monotonic()
        timeout = max(0.1, left)
    else:
        timeout = 1.0 if llm.errored else 5.0  # a dead engine's thread may be hung
    llm.shutdown(timeout=timeout)
    if llm.is_running:
        logger.error("the engine thread did not stop (a step is hung); exiting anyway")
        code = code or 1
    return code


SHUTDOWN_SLACK_S = 0.8
"""A signalled server returns this long after its drain window at the latest (the process
exit's own cost keeps it under the promised window + 1 s)."""


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop (libuv; installed with orbax-checkpoint), else asyncio's: at rate inf
    the loop writes one SSE event per token per stream, and uvloop's transports and callbacks
    cost less Python time, time the engine thread shares the GIL with. ``JAXSERVE_EVENT_LOOP=
    asyncio`` picks asyncio's loop."""
    if os.environ.get("JAXSERVE_EVENT_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run_loop(main: Awaitable[int]) -> int:
    """``asyncio.run(main)``, except that at the end worker threads still running (a long
    prompt being tokenized by a request that was cut) are not waited for: ``asyncio.run`` waits
    up to 300 s for the default executor's threads."""
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()  # the default executor is shut down without waiting


def exit_now(code: int) -> None:
    """Ends the process with ``code`` at once, after flushing the logs and standard streams:
    ``sys.exit`` would wait for worker threads still running (Python joins the executors'
    threads at exit), which can outlive the shutdown window by seconds."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
