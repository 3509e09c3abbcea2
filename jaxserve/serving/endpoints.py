"""The API's endpoints as transport-free calls over an engine client: what the HTTP routes,
``run-batch`` and the Ray ingress run for each request.

    serving = OpenAIServing(engine)                        # any EngineClient
    reply = await serving.generate("/v1/completions", body)  # JSONReply, or StreamReply of chunks
    status, body = await serving.serve_request(url, body)  # run-batch: no streaming, no HTTP
    serving.models(), await serving.tokenize(body), await serving.ledger(request_id), ...

A generating request is validated and its prompts built off the event loop (``prepare``:
tokenizing and rendering templates of long prompts takes a while), then started on an engine
(``start``): a non-streaming one runs to its end and becomes a :class:`JSONReply`; a streaming
one becomes a :class:`StreamReply` as soon as the engine holds its requests, so a refusal is
still a 400. The Ray ingress overrides ``start`` to pick a replica per request.

Adding a generating endpoint: its request model (``protocol``), its serving functions (a module
like ``completion``: ``prepare`` -> job, ``create`` / ``stream`` on an EngineClient), an entry
in :data:`GENERATION`, and a route line in the HTTP module. Any other endpoint: a method here
and a route line. An engine capability it needs is a member of ``EngineClient``.

Every failure a client can cause is an ``APIError``; a dead engine is a 503 ``engine_dead``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import importlib.metadata
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import pydantic

from jaxserve.engine.protocol import (
    EngineClient,
    EngineDeadError,
    EngineSleepingError,
    RequestOutputStream,
)
from jaxserve.serving.chat import create_chat, messages_as_dicts, prepare_chat, stream_chat
from jaxserve.serving.completion import create_completion, prepare_completion, stream_completion
from jaxserve.serving.engine_calls import abort_all, engine_error
from jaxserve.serving.errors import (
    APIError,
    bad_request,
    error_body,
    from_validation_error,
    from_value_error,
    model_not_found,
)
from jaxserve.serving.lora import (
    LOAD_PATH,
    UNLOAD_PATH,
    AdapterEngine,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    adapter_cards,
    check_enabled,
    load_lora_adapter,
    unload_lora_adapter,
)
from jaxserve.serving.pooling import (
    POOLING_KINDS,
    REQUEST_MODELS,
    PoolingJob,
    create_pooling,
    prepare_pooling,
    require_pooling,
)
from jaxserve.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from jaxserve.serving.responses import (
    ResponseStore,
    create_responses,
    prepare_responses,
    stream_responses,
)
from jaxserve.serving.validation import (
    ServingInfo,
    check_priority,
    check_prompt_bytes,
    check_prompt_ids,
    check_queue,
)

Chunks = AsyncIterator[dict[str, Any]]
logger = logging.getLogger(__name__)


class Job(Protocol):
    """A prepared generating request (``CompletionJob``, ``ChatJob``), as this module reads it.

    Attributes:
      request: the validated body (``stream``, ``priority``, ``cache_salt`` are read here).
      request_id: the response id; its engine requests are ``{request_id}-{i}``.
    """

    request: Any
    request_id: str

    @property
    def first_prompt(self) -> list[int]:
        """The first prompt's token ids (what a router matches against replicas' caches)."""
        ...


@dataclasses.dataclass(frozen=True)
class Generation:
    """A generating endpoint: its request model and serving functions.

    Attributes:
      request_model: validates the body (pydantic; errors become 400s naming the field).
      prepare: ``(request, info, tokenizer) -> job``: checks and tokenizes (APIError 4xx).
      create: ``(engine, job) -> body``: runs a non-streaming request to its end.
      stream: ``(engine, job) -> (streams, chunks)``: starts a streaming request.
      named_events: its stream's chunks are events named by their ``type`` (SSE ``event:``
        lines) and end without ``[DONE]`` (the Responses API).
      owned: ``prepare`` takes the caller as ``owner`` (the Responses API: stored responses
        belong to the API key that created them).
    """

    request_model: type[pydantic.BaseModel]
    prepare: Callable[..., Job]
    create: Callable[[EngineClient, Any], Awaitable[dict[str, Any]]]
    stream: Callable[[EngineClient, Any], Awaitable[tuple[list[RequestOutputStream], Chunks]]]
    named_events: bool = False
    owned: bool = False


GENERATION: dict[str, Generation] = {
    "/v1/completions": Generation(
        CompletionRequest, prepare_completion, create_completion, stream_completion
    ),
    "/v1/chat/completions": Generation(
        ChatCompletionRequest, prepare_chat, create_chat, stream_chat
    ),
    "/v1/responses": Generation(
        ResponsesRequest,
        prepare_responses,
        create_responses,
        stream_responses,
        named_events=True,
        owned=True,
    ),
}
"""The generating endpoints by URL path (``/v1/responses``' prepare takes the server's
``ResponseStore`` as ``store``: :class:`OpenAIServing` binds its own)."""


@dataclasses.dataclass
class JSONReply:
    """A response with a JSON body.

    Attributes:
      body: the JSON-ready body; None for an empty one.
      status: the HTTP status.
      headers: extra response headers, or None.
    """

    body: Any
    status: int = 200
    headers: dict[str, str] | None = None


@dataclasses.dataclass
class StreamReply:
    """A streamed response: each chunk dict is one event, then the stream's end (``[DONE]``).

    Whoever sends it calls :meth:`close` when it stops, for any reason.

    Attributes:
      chunks: the chunk dicts (a chunk ``{"error": {...}}`` ends them if the engine dies).
      streams: the engine requests behind them; once every one has finished, what is left of
        ``chunks`` follows without waiting (a writer may send it in one write).
      headers: extra response headers, or None.
      on_close: called once by :meth:`close` (the Ray ingress counts its request finished).
      named_events: each chunk is an event named by its ``type`` and the stream has no
        ``[DONE]`` (``Generation.named_events``).
    """

    chunks: Chunks
    streams: Sequence[RequestOutputStream]
    headers: dict[str, str] | None = None
    on_close: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    named_events: bool = False

    async def close(self) -> None:
        """Aborts the engine requests still running, closes ``chunks``, runs ``on_close``."""
        try:
            abort_all(self.streams)
            await self.chunks.aclose()  # type: ignore[attr-defined]
        finally:
            for callback in self.on_close:
                callback()


Reply = JSONReply | StreamReply


LARGE_BODY_BYTES = 256 * 2**10
"""A request body above this many bytes is large: it is parsed and prepared in the large-body
lane (:func:`off_loop`), one at a time, never in the threads small requests use."""

_large_lane = concurrent.futures.ThreadPoolExecutor(
    max_workers=1, thread_name_prefix="jaxserve-large-body"
)


async def off_loop(fn: Callable[..., Any], *args: Any, large: bool = False) -> Any:
    """``fn(*args)`` in a worker thread: the default pool, or for a large body the large-body
    lane (one thread). #38: eight 15.7 MB prompts, each parsed, checked and refused in the
    default pool, took every worker and the GIL, and a small request beside them waited 8x its
    time alone; in one lane at most one such body is being worked on at any time."""
    if not large:
        return await asyncio.to_thread(fn, *args)
    return await asyncio.get_running_loop().run_in_executor(_large_lane, fn, *args)


MAX_LOGGED_UNKNOWN_FIELDS = 256
"""Distinct unknown field names logged per process; past it one line says the rest are not
(a client sending random names must not grow the set without end)."""

_logged_unknown_fields: set[str] = set()
_logged_unknown_lock = threading.Lock()


def log_unknown_fields(request: pydantic.BaseModel, where: str) -> None:
    """Logs a warning, once per field name and process, for each top-level field of a
    request body that the server does not know and ignores (vLLM logs them too; OpenAI
    clients send fields we do not serve, so they are not an error)."""
    extra = request.model_extra
    if not extra:
        return
    new = []
    with _logged_unknown_lock:
        for name in sorted(extra):
            if len(_logged_unknown_fields) >= MAX_LOGGED_UNKNOWN_FIELDS:
                break
            if name not in _logged_unknown_fields:
                _logged_unknown_fields.add(name)
                new.append(name)
        full = len(_logged_unknown_fields) >= MAX_LOGGED_UNKNOWN_FIELDS
    for name in new:
        logger.warning(
            "%s: the request field %r is not known to this server and is ignored (logged once "
            "per field name)",
            where,
            name[:100],
        )
    if new and full:
        logger.warning(
            "%d unknown request field names logged; further ones are not",
            MAX_LOGGED_UNKNOWN_FIELDS,
        )


def validate(model: type[pydantic.BaseModel], body: dict[str, Any], where: str = "") -> Any:
    """``model`` validated from a parsed JSON body; unknown top-level fields are ignored and
    logged (:func:`log_unknown_fields`; ``where`` names the endpoint in the log line).

    Raises:
      APIError: 400 naming the first bad field.
    """
    try:
        request = model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None
    log_unknown_fields(request, where or model.__name__)
    return request


def version() -> str:
    """The installed jaxserve version, or "unknown"."""
    try:
        return importlib.metadata.version("jaxserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class OpenAIServing:
    """The OpenAI-compatible API over one engine client.

    Args:
      engine: the engine that serves (an AsyncLLM, or the Ray replicas' client).
      info: the served model's facts (default: read from ``engine``).
    """

    def __init__(self, engine: EngineClient, info: ServingInfo | None = None) -> None:
        self.engine = engine
        self.info = info or ServingInfo.from_engine(engine)
        # Response id -> the caller that created it, when callers are told apart (several API
        # keys): ledgers are readable by their creator only. Bounded like the ledger history.
        self._owners: collections.OrderedDict[str, str] = collections.OrderedDict()
        history = getattr(getattr(engine, "engine_config", None), "ledger_history", 1000)
        self.max_owners = 2 * max(int(history), 0) + 1024
        self.responses = ResponseStore()  # /v1/responses with store: true, by id
        responses = GENERATION["/v1/responses"]
        self.generation = {
            **GENERATION,
            "/v1/responses": dataclasses.replace(
                responses, prepare=functools.partial(responses.prepare, store=self.responses)
            ),
        }

    # -- generation ----------------------------------------------------------------------------

    def prepare(
        self, url: str, body: dict[str, Any], owner: str | None = None
    ) -> tuple[Generation, Job]:
        """Validates a generating request's body and builds its job: ``(endpoint, job)``;
        ``owner`` as for :meth:`generate`.

        Raises:
          APIError: 404 for an unknown URL or model, 400 for a bad body (naming the field).
        """
        if isinstance(body.get("model"), str):
            self.info.check_model(body["model"])  # before any other work, as OpenAI does
        endpoint = self.generation.get(url)
        if endpoint is None:
            raise APIError(
                f"url {url!r} is not supported (use {' or '.join(GENERATION)})",
                status=404,
                param="url",
                code="not_found",
            )
        require_pooling(self.info, url)
        request = validate(endpoint.request_model, body, url)
        check_priority(request.priority, self.info)
        extra = {"owner": owner} if endpoint.owned else {}
        return endpoint, endpoint.prepare(request, self.info, self.engine.tokenizer, **extra)

    async def generate(
        self, url: str, body: dict[str, Any], owner: str | None = None, large: bool = False
    ) -> Reply:
        """Serves one generating request: prepared off the event loop, then :meth:`start`.

        Args:
          url, body: the endpoint's path and the parsed JSON body.
          owner: who sends it, when callers are told apart (the API key's id); only the same
            owner may read its ledger (:meth:`ledger`) and read, delete or continue its stored
            response (``/v1/responses``). None: anyone may.
          large: the body was large (over ``LARGE_BODY_BYTES``): prepared in the large-body
            lane (:func:`off_loop`).

        Raises:
          APIError: 4xx for bad input, 503 when the engine is dead or its queue is full.
        """
        endpoint, job = await off_loop(self.prepare, url, body, owner, large=large)
        if owner is not None:
            self._remember_owner(job.request_id, owner)
        return await self.start(endpoint, job)

    def _remember_owner(self, response_id: str, owner: str) -> None:
        self._owners[response_id] = owner
        while len(self._owners) > self.max_owners:
            self._owners.popitem(last=False)

    def owner_of(self, request_id: str) -> str | None:
        """The owner recorded for a response id, or for an engine request id
        (``{response_id}-{i}``); None when unknown."""
        owner = self._owners.get(request_id)
        if owner is None:
            response_id, dash, index = request_id.rpartition("-")
            if dash and index.isdigit():
                owner = self._owners.get(response_id)
        return owner

    async def start(self, endpoint: Generation, job: Job) -> Reply:
        """Starts a prepared job on the engine (the Ray ingress picks a replica instead)."""
        return await self.start_on(self.engine, endpoint, job)

    async def start_on(
        self,
        engine: EngineClient,
        endpoint: Generation,
        job: Job,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """Starts a prepared job on ``engine``: the whole response, or the stream once the
        engine holds its requests; ``headers`` go with the reply.

        Raises:
          APIError: 503 ``engine_dead`` or ``server_overloaded`` (``--max-waiting-requests``),
            400 if the engine refused a prompt.
          EngineUnavailableError: ``engine`` cannot take it (nothing started).
        """
        try:
            engine.check_health()
        except EngineDeadError as exc:
            raise engine_error(exc) from None
        if engine.is_sleeping:
            raise engine_error(EngineSleepingError("the engine is asleep (POST /wake_up wakes it)"))
        check_queue(engine, self.info)
        lora_name = self.info.lora_of(getattr(job, "model", None))
        if lora_name is not None:  # "model" names a LoRA adapter (#33)
            engine = AdapterEngine(engine, lora_name)
        if self.info.log_requests:
            log_request(job, self.info, self.engine.tokenizer)
        if job.request.stream:
            streams, chunks = await endpoint.stream(engine, job)
            return StreamReply(chunks, streams, headers, named_events=endpoint.named_events)
        return JSONReply(await endpoint.create(engine, job), headers=headers)

    # -- pooling (embeddings) ------------------------------------------------------------------

    def prepare_pooling(self, url: str, body: dict[str, Any]) -> PoolingJob:
        """Validates a pooling request's body (``/v1/embeddings``, ``/pooling``, ``/v1/score``)
        and tokenizes its inputs.

        Raises:
          APIError: 400 on a generate server (naming ``--runner pooling``) or for a bad body,
            404 for an unknown model.
        """
        if isinstance(body.get("model"), str):
            self.info.check_model(body["model"])
        require_pooling(self.info, url)
        request = validate(REQUEST_MODELS[POOLING_KINDS[url]], body, url)
        check_priority(request.priority, self.info)
        return prepare_pooling(url, request, self.info, self.engine.tokenizer)

    async def pool(
        self, url: str, body: dict[str, Any], owner: str | None = None, large: bool = False
    ) -> JSONReply:
        """Serves one pooling request: prepared off the event loop (``owner`` and ``large`` as
        for :meth:`generate`), then run on the engine.

        Raises:
          APIError: as :meth:`prepare_pooling`; 503 when the engine is dead, asleep or its
            queue full.
        """
        job = await off_loop(self.prepare_pooling, url, body, large=large)
        if owner is not None:
            self._remember_owner(job.request_id, owner)
        engine = self.engine
        try:
            engine.check_health()
        except EngineDeadError as exc:
            raise engine_error(exc) from None
        if engine.is_sleeping:
            raise engine_error(EngineSleepingError("the engine is asleep (POST /wake_up wakes it)"))
        check_queue(engine, self.info)
        if self.info.log_requests:
            log_request(job, self.info, engine.tokenizer)
        return JSONReply(await create_pooling(engine, job))

    async def serve_request(self, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Serves one non-streaming generating or pooling request without a transport
        (``run-batch``).

        Returns:
          ``(status, body)``: 200 and the OpenAI response object, or the error status and
          ``{"error": {...}}`` (400 bad input or ``stream: true``, 404 unknown model or URL, 503
          engine dead). No ``--max-waiting-requests`` check: a batch queues everything at once.

        Raises:
          Nothing for bad input or a dead engine. Other exceptions (bugs) propagate.
        """
        try:
            if not isinstance(body, dict):
                raise bad_request("the request body must be a JSON object")
            if url in POOLING_KINDS:
                pooling_job = self.prepare_pooling(url, body)
                self.engine.check_health()
                return 200, await create_pooling(self.engine, pooling_job)
            endpoint, job = self.prepare(url, body)
            if job.request.stream:
                raise bad_request("stream is not supported here", param="stream")
            self.engine.check_health()
            return 200, await endpoint.create(self.engine, job)
        except APIError as exc:
            return exc.status, exc.body()
        except EngineDeadError as exc:
            error = engine_error(exc)
            return error.status, error.body()

    # -- the rest --------------------------------------------------------------------------------

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        """The served model under ``name`` (default: the served name; an alias of
        ``--served-model-name`` names the same model) in OpenAI's model shape (plus vLLM's
        ``root``, ``max_model_len``)."""
        info = self.info
        return {
            "id": name or info.model_name,
            "object": "model",
            "created": info.created,
            "owned_by": "jaxserve",
            "root": info.model_path,
            "parent": None,
            "max_model_len": info.max_model_len,
        }

    def models(self) -> dict[str, Any]:
        """``GET /v1/models``: the served model, once per name, then each loaded LoRA adapter
        with its ``parent`` (OpenAI's list-models shape)."""
        cards = [self.model_card(n) for n in self.info.model_names]
        return {"object": "list", "data": cards + adapter_cards(self.info, self.model_card())}

    async def load_lora_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/load_lora_adapter`` (vLLM's; ``serving.lora``).

        Raises:
          APIError: 404 without ``--enable-lora``; 400 for a bad body or adapter.
        """
        check_enabled(self.engine, LOAD_PATH)
        request = validate(LoadLoRAAdapterRequest, body, LOAD_PATH)
        return await load_lora_adapter(self.engine, self.info, request)

    async def unload_lora_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/unload_lora_adapter`` (vLLM's; ``serving.lora``).

        Raises:
          APIError: 404 without ``--enable-lora`` or for an adapter not loaded; 400 for a bad
            body or an adapter in use.
        """
        check_enabled(self.engine, UNLOAD_PATH)
        request = validate(UnloadLoRAAdapterRequest, body, UNLOAD_PATH)
        return await unload_lora_adapter(self.engine, self.info, request)

    def model(self, name: str) -> dict[str, Any]:
        """``GET /v1/models/{model}``: the served model's card under one of its names, or a
        loaded LoRA adapter's.

        Raises:
          APIError: 404 ``model_not_found`` for another name.
        """
        if name not in self.info.model_names:
            for card in adapter_cards(self.info, self.model_card()):
                if card["id"] == name:
                    return card
            raise model_not_found(name)
        return self.model_card(name)

    # -- stored responses ----------------------------------------------------------------------

    def stored_response(self, response_id: str, owner: str | None = None) -> dict[str, Any]:
        """``GET /v1/responses/{response_id}``: a stored Response object (``owner``: the
        caller, when callers are told apart; only the one that created it may read it).

        Raises:
          APIError: 404 ``response_not_found`` when never stored (``store: false``), evicted,
            or (with ``owner``) created by another caller.
        """
        stored = self.responses.get(response_id, owner)
        if stored is None:
            raise _response_not_found(response_id)
        return stored.body

    def delete_response(self, response_id: str, owner: str | None = None) -> dict[str, Any]:
        """``DELETE /v1/responses/{response_id}``: forgets a stored response (``owner`` as for
        :meth:`stored_response`).

        Raises:
          APIError: 404 ``response_not_found``.
        """
        if not self.responses.delete(response_id, owner):
            raise _response_not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # -- sleep mode ----------------------------------------------------------------------------

    async def sleep(self, level: str | None = None, mode: str | None = None) -> dict[str, Any]:
        """``POST /sleep?level=1&mode=abort`` (vLLM's): puts the engine to sleep, answering
        once it sleeps; from then on generating requests get a 503 ``engine_sleeping`` with
        ``Retry-After``.

        Args:
          level: the query's level: "0" (refuse requests only), "1" (weights to host memory,
            KV cache freed; the default) or "2" (weights dropped, reloaded at wake-up).
          mode: "abort" (the default: unfinished requests end with a 503 / an error event) or
            "wait" (they finish first).

        Raises:
          APIError: 404 without ``--enable-sleep-mode``; 400 naming a bad level or mode.
        """
        self._check_sleep_mode("/sleep")
        if level is not None and level not in ("0", "1", "2"):  # not int(): " 1", "1_0", "+1"
            raise bad_request(f"level must be 0, 1 or 2, got {level!r}", param="level")
        number = int(level) if level is not None else 1
        try:
            await self.engine.sleep(number, mode if mode is not None else "abort")
        except ValueError as exc:
            raise from_value_error(exc) from None
        except EngineDeadError as exc:
            raise engine_error(exc) from None
        return {"status": "sleeping", "level": number}

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """``POST /wake_up[?tags=weights&tags=kv_cache]`` (vLLM's): puts back what ``tags``
        name (none: everything); ``status`` is "awake" once requests are served again.

        Raises:
          APIError: 404 without ``--enable-sleep-mode``; 400 naming an unknown tag.
        """
        self._check_sleep_mode("/wake_up")
        try:
            awake = await self.engine.wake_up(tags or None)
        except ValueError as exc:
            raise from_value_error(exc) from None
        except EngineDeadError as exc:
            raise engine_error(exc) from None
        return {"status": "awake" if awake else "sleeping", "tags": tags or None}

    def is_sleeping(self) -> dict[str, Any]:
        """``GET /is_sleeping``: ``{"is_sleeping": bool}`` (false without sleep mode)."""
        return {"is_sleeping": self.engine.is_sleeping}

    def _check_sleep_mode(self, path: str) -> None:
        if not self.info.enable_sleep_mode:
            raise APIError(
                f"POST {path} is served only with --enable-sleep-mode",
                status=404,
                code="not_found",
            )

    async def ledger(self, request_id: str, owner: str | None = None) -> dict[str, Any]:
        """``GET /v1/requests/{request_id}/ledger``: a finished request's ledger (engine request
        id or response id).

        Ids are capabilities: 128 random bits, never listed, so whoever holds one may read its
        ledger. When callers are told apart (``owner`` given: several API keys), only the
        caller that created the request may.

        Raises:
          APIError: 404 ``ledger_not_found`` when unknown, past ``--ledger-history``, or (with
            ``owner``) created by another caller or by no known one.
        """
        ledger = None
        if owner is None or self.owner_of(request_id) == owner:
            ledger = await self.engine.get_ledger(request_id)
        if ledger is None:
            raise APIError(
                f"no ledger for request {request_id!r}: unknown, unfinished, older than the "
                "last --ledger-history finished requests, or created with another API key",
                status=404,
                param="request_id",
                code="ledger_not_found",
            )
        return ledger

    def health(self) -> JSONReply:
        """``GET /health``: 200 while the engine serves, 503 with the reason when it does not:
        dead, stalled (no loop turn completed within the step timeout while work is queued) or
        shutting down (the engine's own body when it gives one: the Ray replicas' counts)."""
        health = self.engine.health()
        if health.detail is not None:
            return JSONReply(health.detail, 200 if health.healthy else 503)
        if health.healthy:
            return JSONReply(None)
        if health.code == "engine_dead":
            message = f"the engine is dead: {health.error!r}"
        else:
            message = str(health.error) if health.error is not None else health.code
        return JSONReply(error_body(message, "server_error", code=health.code), 503)

    async def metrics(self) -> tuple[bytes, str]:
        """``GET /metrics``: the Prometheus exposition and its content type."""
        return await self.engine.render_metrics()

    async def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /tokenize``: ``{"prompt"}`` or ``{"messages"}`` -> tokens, count, max_model_len.

        Raises:
          APIError: 400 for a bad body or a text too long to tokenize, 404 for another model.
        """
        request = validate(TokenizeRequest, body, "/tokenize")
        self.info.check_model(request.model)
        # Off the event loop: a long prompt must not stall /health and every other client.
        tokens = await asyncio.to_thread(self._tokenize, request)
        return {"count": len(tokens), "max_model_len": self.info.max_model_len, "tokens": tokens}

    def _tokenize(self, request: TokenizeRequest) -> list[int]:
        """``tokenize``'s work (in a worker thread): the byte-length check, then the tokenizer."""
        tokenizer = self.engine.tokenizer
        try:
            if request.messages is not None:
                messages = messages_as_dicts(request.messages)
                check_prompt_bytes([m["content"] for m in messages], self.info, field="messages")
                return tokenizer.encode_chat(
                    messages, add_generation_prompt=request.add_generation_prompt
                )
            check_prompt_bytes([request.prompt], self.info)
            return tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        except ValueError as exc:
            raise from_value_error(exc) from None

    def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /detokenize``: ``{"tokens"}`` -> ``{"prompt"}``.

        Raises:
          APIError: 400 for a bad body or a token id outside the vocabulary, 404 for another
            model.
        """
        request = validate(DetokenizeRequest, body, "/detokenize")
        self.info.check_model(request.model)
        if request.tokens:
            check_prompt_ids(
                request.tokens,
                dataclasses.replace(
                    self.info, max_model_len=len(request.tokens), enable_chunked_prefill=True
                ),
                field="tokens",
            )
        return {"prompt": self.engine.tokenizer.decode(request.tokens)}


def _response_not_found(response_id: str) -> APIError:
    return APIError(
        f"Response with id {response_id!r} not found (never stored, stored with store: false, "
        "evicted, or created with another API key)",
        status=404,
        param="response_id",
        code="response_not_found",
    )


def log_request(job: Job, info: ServingInfo, tokenizer: Any) -> None:
    """The ``--enable-log-requests`` line of a request: its id, its (first) prompt's text and
    token ids (cut to ``--max-log-len``) and its sampling parameters."""
    ids = job.first_prompt
    cut = info.max_log_len or None
    text = tokenizer.decode(ids[:cut] if cut else ids, skip_special_tokens=False)
    params = getattr(job, "params", None)
    logger.info(
        "request %s: prompt %r (%d tokens): %s, params: %s",
        job.request_id,
        text[:cut],
        len(ids),
        ids[:cut],
        params,
    )


async def serve_request(
    llm: EngineClient, url: str, body: dict[str, Any], info: ServingInfo | None = None
) -> tuple[int, dict[str, Any]]:
    """:meth:`OpenAIServing.serve_request` on ``llm`` (``info``: the served model's facts,
    default read from ``llm``)."""
    return await OpenAIServing(llm, info).serve_request(url, body)
