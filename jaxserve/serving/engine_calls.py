"""A response's engine requests: their ids, starting them, collecting their final outputs,
merging their streams, and the ``usage`` they add up to.

One OpenAI request may carry several prompts (``/v1/completions`` with a list); each becomes one
engine request ``{response_id}-{prompt_index}`` whose ``n`` samples the engine fans out itself.
All of them are handed to the engine before the HTTP response starts, so a refusal is still a
400; from then on the caller owns the streams and must ``abort_all`` them when it stops early.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from jaxserve.engine.protocol import EngineClient, EngineDeadError, RequestOutputStream
from jaxserve.request_output import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.serving.errors import APIError, from_value_error


def random_id(prefix: str, sep: str = "-") -> str:
    """An OpenAI-style id: ``cmpl-<32 hex>``, ``chatcmpl-<32 hex>``; the Responses API's objects use ``sep="_"``
    (``resp_<32 hex>``, ``msg_``, ``fc_``)."""
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` object, with ``prompt_tokens_details.cached_tokens`` (prefix caching)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


SLEEP_RETRY_AFTER_S = 5
"""``Retry-After`` of a request refused or ended because the engine sleeps, seconds."""


def engine_error(exc: EngineDeadError) -> APIError:
    """The 503 a client sees when the engine died under its request, with the error's ``code``
    ("engine_dead"; a subclass's own, such as "replica_died", with its own message); a
    sleeping engine's ("engine_sleeping") comes with ``Retry-After``."""
    message = f"the engine stopped serving: {exc}" if exc.code == "engine_dead" else str(exc)
    headers = {"Retry-After": str(SLEEP_RETRY_AFTER_S)} if exc.code == "engine_sleeping" else None
    return APIError(message, status=503, type="server_error", code=exc.code, headers=headers)


async def start_requests(
    llm: EngineClient,
    request_id: str,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    *,
    priority: int = 0,
    cache_salt: str | None = None,
) -> list[RequestOutputStream]:
    """Adds one engine request per prompt (ids ``{request_id}-{i}``) and returns their streams.

    Raises:
      APIError: 400 if the engine refused one (the others are aborted), 503 if it is dead.
    """
    streams: list[RequestOutputStream] = []
    try:
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            streams.append(
                await llm.add_request(
                    f"{request_id}-{i}", prompt, sp, priority=priority, cache_salt=cache_salt
                )
            )
    except BaseException as exc:
        abort_all(streams)
        if isinstance(exc, EngineDeadError):
            raise engine_error(exc) from exc
        if isinstance(exc, ValueError):
            raise from_value_error(exc) from exc
        raise
    return streams


def abort_all(streams: Sequence[RequestOutputStream]) -> None:
    """Aborts every stream that has not finished (idempotent)."""
    for stream in streams:
        stream.abort()


async def collect_final(stream: RequestOutputStream) -> RequestOutput:
    """Consumes a stream and returns its final RequestOutput with every sample's latest state.

    Each sample's cumulative fields are kept from its latest appearance, so the result is whole
    even if a step's output listed only the samples that changed.
    """
    latest: dict[int, CompletionOutput] = {}
    last: RequestOutput | None = None
    prompt_logprobs = None
    async for output in stream:
        last = output
        for completion in output.outputs:
            latest[completion.index] = completion
        if output.prompt_logprobs is not None:
            prompt_logprobs = output.prompt_logprobs
    assert last is not None and last.finished, "a request stream ended without a finished output"
    return dataclasses.replace(
        last, outputs=[latest[i] for i in sorted(latest)], prompt_logprobs=prompt_logprobs
    )


async def collect_all(streams: Sequence[RequestOutputStream]) -> list[RequestOutput]:
    """``collect_final`` of every stream, concurrently; aborts them all if interrupted.

    Raises:
      APIError: 503 if the engine died meanwhile.
    """
    try:
        return list(await asyncio.gather(*(collect_final(s) for s in streams)))
    except EngineDeadError as exc:
        raise engine_error(exc) from exc
    finally:
        abort_all(streams)


async def merge_streams(
    streams: Sequence[RequestOutputStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields ``(prompt_index, output)`` from several streams as outputs arrive.

    A single stream is iterated directly; several are read by one task each into a shared
    queue. Closing the iterator cancels the tasks (the caller aborts the requests).

    Raises:
      EngineDeadError: the engine died.
    """
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestOutputStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))
            return
        queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
