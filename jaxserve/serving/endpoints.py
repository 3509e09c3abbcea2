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
import dataclasses
import importlib.metadata
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import pydantic

from jaxserve.engine.protocol import EngineClient, EngineDeadError, RequestOutputStream
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
    TokenizeRequest,
)
from jaxserve.serving.validation import (
    ServingInfo,
    check_priority,
    check_prompt_bytes,
    check_prompt_ids,
    check_queue,
)

Chunks = AsyncIterator[dict[str, Any]]


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
    """

    request_model: type[pydantic.BaseModel]
    prepare: Callable[[Any, ServingInfo, Any], Job]
    create: Callable[[EngineClient, Any], Awaitable[dict[str, Any]]]
    stream: Callable[[EngineClient, Any], Awaitable[tuple[list[RequestOutputStream], Chunks]]]


GENERATION: dict[str, Generation] = {
    "/v1/completions": Generation(
        CompletionRequest, prepare_completion, create_completion, stream_completion
    ),
    "/v1/chat/completions": Generation(
        ChatCompletionRequest, prepare_chat, create_chat, stream_chat
    ),
}
"""The generating endpoints by URL path."""


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
    """

    chunks: Chunks
    streams: Sequence[RequestOutputStream]
    headers: dict[str, str] | None = None
    on_close: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    async def close(self) -> None:
        """Aborts the engine requests still running, closes ``chunks``, runs ``on_close``."""
        try:
            abort_all(self.streams)
            await self.chunks.aclose()  # type: ignore[attr-defined]
        finally:
            for callback in self.on_close:
                callback()


Reply = JSONReply | StreamReply


def validate(model: type[pydantic.BaseModel], body: dict[str, Any]) -> Any:
    """``model`` validated from a parsed JSON body.

    Raises:
      APIError: 400 naming the first bad field.
    """
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None


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

    # -- generation ----------------------------------------------------------------------------

    def prepare(self, url: str, body: dict[str, Any]) -> tuple[Generation, Job]:
        """Validates a generating request's body and builds its job: ``(endpoint, job)``.

        Raises:
          APIError: 404 for an unknown URL or model, 400 for a bad body (naming the field).
        """
        if isinstance(body.get("model"), str):
            self.info.check_model(body["model"])  # before any other work, as OpenAI does
        endpoint = GENERATION.get(url)
        if endpoint is None:
            raise APIError(
                f"url {url!r} is not supported (use {' or '.join(GENERATION)})",
                status=404,
                param="url",
                code="not_found",
            )
        require_pooling(self.info, url)
        request = validate(endpoint.request_model, body)
        check_priority(request.priority, self.info)
        return endpoint, endpoint.prepare(request, self.info, self.engine.tokenizer)

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
        request = validate(REQUEST_MODELS[POOLING_KINDS[url]], body)
        check_priority(request.priority, self.info)
        return prepare_pooling(url, request, self.info, self.engine.tokenizer)

    async def pool(self, url: str, body: dict[str, Any]) -> JSONReply:
        """Serves one pooling request: prepared off the event loop, run on the engine.

        Raises:
          APIError: as :meth:`prepare_pooling`; 503 when the engine is dead or its queue full.
        """
        job = await asyncio.to_thread(self.prepare_pooling, url, body)
        engine = self.engine
        try:
            engine.check_health()
        except EngineDeadError as exc:
            raise engine_error(exc) from None
        check_queue(engine, self.info)
        return JSONReply(await create_pooling(engine, job))

    async def generate(self, url: str, body: dict[str, Any]) -> Reply:
        """Serves one generating request: prepared off the event loop, then :meth:`start`.

        Raises:
          APIError: 4xx for bad input, 503 when the engine is dead or its queue is full.
        """
        endpoint, job = await asyncio.to_thread(self.prepare, url, body)
        return await self.start(endpoint, job)

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
        check_queue(engine, self.info)
        if job.request.stream:
            streams, chunks = await endpoint.stream(engine, job)
            return StreamReply(chunks, streams, headers)
        return JSONReply(await endpoint.create(engine, job), headers=headers)

    async def serve_request(self, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Serves one non-streaming generating request without a transport (``run-batch``).

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

    def model_card(self) -> dict[str, Any]:
        """The served model in OpenAI's model shape (plus vLLM's ``root``, ``max_model_len``)."""
        info = self.info
        return {
            "id": info.model_name,
            "object": "model",
            "created": info.created,
            "owned_by": "jaxserve",
            "root": info.model_path,
            "parent": None,
            "max_model_len": info.max_model_len,
        }

    def models(self) -> dict[str, Any]:
        """``GET /v1/models``: the served model (OpenAI's list-models shape)."""
        return {"object": "list", "data": [self.model_card()]}

    def model(self, name: str) -> dict[str, Any]:
        """``GET /v1/models/{model}``: the served model's card.

        Raises:
          APIError: 404 ``model_not_found`` for another name.
        """
        if name != self.info.model_name:
            raise model_not_found(name)
        return self.model_card()

    async def ledger(self, request_id: str) -> dict[str, Any]:
        """``GET /v1/requests/{request_id}/ledger``: a finished request's ledger (engine request
        id or response id).

        Raises:
          APIError: 404 ``ledger_not_found`` when unknown or past ``--ledger-history``.
        """
        ledger = await self.engine.get_ledger(request_id)
        if ledger is None:
            raise APIError(
                f"no ledger for request {request_id!r}: unknown, unfinished, or older than the "
                "last --ledger-history finished requests",
                status=404,
                param="request_id",
                code="ledger_not_found",
            )
        return ledger

    def health(self) -> JSONReply:
        """``GET /health``: 200 while the engine serves, 503 with the reason when it does not
        (the engine's own body when it gives one: the Ray replicas' counts)."""
        health = self.engine.health()
        if health.detail is not None:
            return JSONReply(health.detail, 200 if health.healthy else 503)
        if health.healthy:
            return JSONReply(None)
        message = f"the engine is dead: {health.error!r}"
        return JSONReply(error_body(message, "server_error", code="engine_dead"), 503)

    async def metrics(self) -> tuple[bytes, str]:
        """``GET /metrics``: the Prometheus exposition and its content type."""
        return await self.engine.render_metrics()

    async def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /tokenize``: ``{"prompt"}`` or ``{"messages"}`` -> tokens, count, max_model_len.

        Raises:
          APIError: 400 for a bad body or a text too long to tokenize, 404 for another model.
        """
        request = validate(TokenizeRequest, body)
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
        request = validate(DetokenizeRequest, body)
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


async def serve_request(
    llm: EngineClient, url: str, body: dict[str, Any], info: ServingInfo | None = None
) -> tuple[int, dict[str, Any]]:
    """:meth:`OpenAIServing.serve_request` on ``llm`` (``info``: the served model's facts,
    default read from ``llm``)."""
    return await OpenAIServing(llm, info).serve_request(url, body)
