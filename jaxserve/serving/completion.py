"""``/v1/completions``: a validated CompletionRequest -> engine requests -> OpenAI response or chunks.

Plain functions, no HTTP, so the batch CLI reuses them:

    job = prepare_completion(request, info, tokenizer)        # 400s here (APIError)
    body = await create_completion(llm, job)                  # non-streaming response dict
    streams, chunks = await stream_completion(llm, job)       # chunk dicts for SSE
    build_completion_response(job, final_outputs, tokenizer)  # final RequestOutputs -> dict

Shapes follow the OpenAI API reference ("Completions"): ``{"id": "cmpl-...", "object":
"text_completion", "created", "model", "choices": [{"index", "text", "logprobs",
"finish_reason"}], "usage"}``; choice ``index`` is ``prompt_index * n + sample``. vLLM's
``stop_reason`` (the stop string or token id that ended the sample) rides along in each choice.
Streamed chunks carry one choice each; a choice's text deltas are the engine's ``delta_text``,
which never splits a character or shows a prefix of a stop string that ends up matching.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from jaxserve.core.ledger import response_ledger
from jaxserve.engine.protocol import EngineClient, EngineDeadError, RequestOutputStream
from jaxserve.request_output import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.serving.engine_calls import (
    collect_all,
    engine_error,
    merge_streams,
    random_id,
    start_requests,
    usage,
)
from jaxserve.serving.errors import bad_request, from_value_error
from jaxserve.serving.logprobs import CompletionLogprobs, logprobs_tokenizer
from jaxserve.serving.protocol import CompletionRequest
from jaxserve.serving.validation import (
    ServingInfo,
    check_prompt_bytes,
    check_prompt_ids,
    check_sampler_memory,
    prepare_token_masks_of,
    resolve_max_tokens,
)


@dataclasses.dataclass
class CompletionJob:
    """A validated completions request, ready for the engine.

    Attributes:
      request: the parsed body.
      request_id: the response id (``cmpl-...``); engine requests are ``{request_id}-{i}``.
      created: Unix seconds.
      model: the model name to report.
      prompt_ids: per prompt, its token ids.
      prompt_texts: per prompt, the text echoed with ``echo`` (the string given, or the decode
        of the ids given).
      params: per prompt, its SamplingParams (``max_tokens`` resolved against its length).
      system_fingerprint: OpenAI's ``system_fingerprint`` of the serving configuration.
    """

    request: CompletionRequest
    request_id: str
    created: int
    model: str
    prompt_ids: list[list[int]]
    prompt_texts: list[str]
    params: list[SamplingParams]
    system_fingerprint: str = ""
    return_tokens_as_token_ids: bool = False

    @property
    def first_prompt(self) -> list[int]:
        """The first prompt's token ids (what a router matches against replicas' caches)."""
        return self.prompt_ids[0]


def tokenize_prompts(
    prompt: Any, tokenizer: Any, info: ServingInfo, field: str = "prompt"
) -> tuple[list[list[int]], list[str | None]]:
    """A ``prompt`` (completions) or ``input`` (embeddings) field as token-id prompts: a text,
    texts, one token-id list or several; returns them and the texts given (None for ids).

    Raises:
      APIError: 400 for an empty list or a text too long to tokenize (naming ``field``).
    """
    if isinstance(prompt, str):
        check_prompt_bytes([prompt], info, field=field)
        return [tokenizer.encode(prompt)], [prompt]
    if not prompt:
        raise bad_request(f"{field} must not be empty (it has 0 tokens)", param=field)
    if all(isinstance(p, str) for p in prompt):
        for p in prompt:  # all of them before tokenizing any
            check_prompt_bytes([p], info, field=field)
        return [tokenizer.encode(p) for p in prompt], list(prompt)
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)], [None]
    return [list(p) for p in prompt], [None] * len(prompt)


def prepare_completion(
    request: CompletionRequest, info: ServingInfo, tokenizer: Any
) -> CompletionJob:
    """Tokenizes and checks the prompts and builds each one's SamplingParams.

    Raises:
      APIError: 404 for an unknown model, 400 for an empty, out-of-vocabulary or too long
        prompt, or an out-of-range parameter (naming the field and, for lengths, the numbers).
    """
    info.check_model(request.model)
    prompt_ids, given_texts = tokenize_prompts(request.prompt, tokenizer, info)
    params: list[SamplingParams] = []
    for ids in prompt_ids:
        check_prompt_ids(ids, info)
        max_tokens = resolve_max_tokens(request.max_tokens, len(ids), info)
        try:
            sp = request.to_sampling_params(max_tokens, info.default_sampling)
            sp.check_vocab(info.vocab_size)
            sp.check_max_logprobs(info.max_logprobs)
        except ValueError as exc:
            raise from_value_error(exc) from exc
        check_sampler_memory(sp, info)
        if params:  # the same mask fields for every prompt: one plan
            sp.token_mask_plan = params[0].token_mask_plan
        else:
            prepare_token_masks_of(request, sp, tokenizer, info)
        params.append(sp)
    texts = (
        [
            t if t is not None else tokenizer.decode(ids, skip_special_tokens=False)
            for t, ids in zip(given_texts, prompt_ids)
        ]
        if request.echo
        else [""] * len(prompt_ids)
    )
    return CompletionJob(
        request=request,
        request_id=random_id("cmpl"),
        created=int(time.time()),
        model=request.model or info.model_name,
        prompt_ids=prompt_ids,
        prompt_texts=texts,
        params=params,
        system_fingerprint=info.system_fingerprint,
        return_tokens_as_token_ids=info.return_tokens_as_token_ids,
    )


def _header(job: CompletionJob) -> dict[str, Any]:
    return {
        "id": job.request_id,
        "object": "text_completion",
        "created": job.created,
        "model": job.model,
        "system_fingerprint": job.system_fingerprint,
    }


def build_completion_response(
    job: CompletionJob, outputs: list[RequestOutput], tokenizer: Any
) -> dict[str, Any]:
    """The non-streaming response body from each prompt's final RequestOutput (in prompt order)."""
    request = job.request
    choices = []
    completion_tokens = 0
    for i, output in enumerate(outputs):
        for completion in output.outputs:
            completion_tokens += len(completion.token_ids)
            text = completion.text
            logprobs = None
            if request.echo:
                text = job.prompt_texts[i] + text
            if request.logprobs is not None:
                builder = CompletionLogprobs(tokenizer)
                if request.echo:
                    builder.add(output.prompt_token_ids, output.prompt_logprobs, request.logprobs)
                builder.add(completion.token_ids, completion.logprobs, request.logprobs)
                logprobs = builder.to_dict()
            choices.append(
                {
                    "index": i * request.n + completion.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                }
            )
    choices.sort(key=lambda c: c["index"])
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(max(0, o.num_cached_tokens) for o in outputs)
    body = {
        **_header(job),
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached),
    }
    if request.include_ledger:
        body["ledger"] = response_ledger(
            job.request_id, [(o.request_id, o.ledgers or []) for o in outputs]
        )
    return body


async def create_completion(llm: EngineClient, job: CompletionJob) -> dict[str, Any]:
    """Runs a non-streaming completion to the end and returns the response body.

    Raises:
      APIError: 400 if the engine refused a prompt, 503 if the engine died.
    """
    streams = await start_requests(
        llm,
        job.request_id,
        job.prompt_ids,
        job.params,
        priority=job.request.priority,
        cache_salt=job.request.cache_salt,
    )
    outputs = await collect_all(streams)
    return build_completion_response(
        job, outputs, logprobs_tokenizer(llm.tokenizer, job.return_tokens_as_token_ids)
    )


async def stream_completion(
    llm: EngineClient, job: CompletionJob
) -> tuple[list[RequestOutputStream], AsyncIterator[dict[str, Any]]]:
    """Starts the engine requests and returns them with the async iterator of chunk dicts.

    The caller writes each chunk as an SSE event, then ``data: [DONE]``, and aborts the streams
    (``engine_calls.abort_all``) when it stops early. A chunk ``{"error": {...}}`` ends the
    iterator if the engine dies.

    Raises:
      APIError: 400 if the engine refused a prompt (nothing started), 503 if it is dead.
    """
    streams = await start_requests(
        llm,
        job.request_id,
        job.prompt_ids,
        job.params,
        priority=job.request.priority,
        cache_salt=job.request.cache_salt,
    )
    return streams, _chunks(
        job, streams, logprobs_tokenizer(llm.tokenizer, job.return_tokens_as_token_ids)
    )


async def _chunks(
    job: CompletionJob, streams: list[RequestOutputStream], tokenizer: Any
) -> AsyncIterator[dict[str, Any]]:
    request = job.request
    header = _header(job)
    if request.include_usage:
        header["usage"] = None
    started: set[int] = set()
    finished: set[int] = set()
    builders: dict[int, CompletionLogprobs] = {}
    prompt_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    completion_tokens: dict[int, int] = {}
    ledgers: dict[int, tuple[str, list]] = {}
    try:
        async for i, output in merge_streams(streams):
            if output.finished:
                ledgers[i] = (output.request_id, output.ledgers or [])
            prompt_tokens[i] = len(output.prompt_token_ids)
            cached[i] = max(0, output.num_cached_tokens)
            for completion in output.outputs:
                index = i * request.n + completion.index
                if index in finished or (
                    index not in started and not (completion.token_ids or completion.finished)
                ):
                    continue
                completion_tokens[index] = completion_tokens.get(index, 0) + len(
                    completion.delta_token_ids
                )  # the deltas add up, whatever the output kind
                if index not in started:
                    # First emission: nothing was sent before, so send the cumulative state.
                    started.add(index)
                    text = job.prompt_texts[i] + completion.text
                    new_ids, new_logprobs = completion.token_ids, completion.logprobs
                    if request.logprobs is not None:
                        builder = builders[index] = CompletionLogprobs(tokenizer)
                        if request.echo:
                            builder.add(
                                output.prompt_token_ids, output.prompt_logprobs, request.logprobs
                            )
                else:
                    text = completion.delta_text
                    new_ids, new_logprobs = completion.delta_token_ids, completion.delta_logprobs
                logprobs = None
                if request.logprobs is not None:
                    builder = builders[index]
                    builder.add(new_ids, new_logprobs, request.logprobs)
                    logprobs = builder.to_dict()
                    builders[index] = CompletionLogprobs(tokenizer, builder.offset)
                if completion.finished:
                    finished.add(index)
                elif not text and not (logprobs and logprobs["tokens"]):
                    continue
                yield {
                    **header,
                    "choices": [
                        {
                            "index": index,
                            "text": text,
                            "logprobs": logprobs,
                            "finish_reason": completion.finish_reason,
                            "stop_reason": completion.stop_reason,
                        }
                    ],
                }
    except EngineDeadError as exc:
        yield engine_error(exc).body()
        return
    if request.include_usage or request.include_ledger:
        last: dict[str, Any] = {**header, "choices": []}
        if request.include_usage:
            last["usage"] = usage(
                sum(prompt_tokens.values()), sum(completion_tokens.values()), sum(cached.values())
            )
        if request.include_ledger:
            last["ledger"] = response_ledger(job.request_id, [ledgers[i] for i in sorted(ledgers)])
        yield last
