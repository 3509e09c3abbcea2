"""``/v1/chat/completions``: messages -> chat template -> engine request -> OpenAI response or chunks.

Plain functions, no HTTP (the batch CLI reuses them), like ``completion``:

    job = prepare_chat(request, info, tokenizer)          # 400s here (APIError)
    body = await create_chat(llm, job)                    # non-streaming response dict
    streams, chunks = await stream_chat(llm, job)         # chunk dicts for SSE
    build_chat_response(job, final_output, tokenizer)     # final RequestOutput -> dict

The prompt is the tokenizer's chat template rendered with ``add_generation_prompt`` and
tokenized without a second BOS (``Tokenizer.encode_chat``, vLLM's chat serving). Shapes follow
the OpenAI API reference ("Chat Completions"): ``{"id": "chatcmpl-...", "object":
"chat.completion", "created", "model", "choices": [{"index", "message": {"role": "assistant",
"content"}, "logprobs", "finish_reason"}], "usage"}``. Streamed chunks (``"object":
"chat.completion.chunk"``) start with one ``{"role": "assistant", "content": ""}`` delta per
choice, sent with the engine's first output (as vLLM does), then content deltas; a choice's last chunk carries its ``finish_reason``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from jaxserve.core.ledger import response_ledger
from jaxserve.engine.protocol import EngineClient, EngineDeadError, RequestOutputStream
from jaxserve.request_output import RequestOutput
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.serving.engine_calls import (
    collect_all,
    engine_error,
    merge_streams,
    random_id,
    start_requests,
    usage,
)
from jaxserve.serving.errors import APIError, from_value_error
from jaxserve.serving.logprobs import chat_logprobs, logprobs_tokenizer
from jaxserve.serving.protocol import ChatCompletionRequest, ChatMessage
from jaxserve.serving.tool_calls import ToolPlan, plan_tools, template_tool_call
from jaxserve.serving.validation import (
    ServingInfo,
    check_prompt_bytes,
    check_prompt_ids,
    check_sampler_memory,
    prepare_token_masks_of,
    resolve_max_tokens,
)


@dataclasses.dataclass
class ChatJob:
    """A validated chat request, ready for the engine.

    Attributes:
      request: the parsed body.
      request_id: the response id (``chatcmpl-...``); the engine request is ``{request_id}-0``.
      created: Unix seconds.
      model: the model name to report.
      prompt_ids: the rendered conversation's token ids.
      params: its SamplingParams.
      system_fingerprint: OpenAI's ``system_fingerprint`` of the serving configuration.
      tools: how tools are served (``tool_calls.ToolPlan``), or None without tools.
    """

    request: ChatCompletionRequest
    request_id: str
    created: int
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolPlan | None = None
    system_fingerprint: str = ""
    return_tokens_as_token_ids: bool = False

    @property
    def first_prompt(self) -> list[int]:
        """The prompt's token ids (what a router matches against replicas' caches)."""
        return self.prompt_ids


def messages_as_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the plain dicts a chat template reads (content flattened to a string; an
    assistant turn's ``tool_calls`` with their JSON ``arguments`` as objects, as HF templates
    expect, and a tool turn's ``tool_call_id``)."""
    out = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls is not None:
            item["tool_calls"] = [template_tool_call(c) for c in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        out.append(item)
    return out


def _chat_field_error(exc: ValueError, max_tokens_field: str) -> APIError:
    """The 400 of a SamplingParams error, naming the field as the chat request spelled it.

    Chat sends SamplingParams' ``logprobs`` (a count) as ``top_logprobs`` and its ``max_tokens``
    possibly as ``max_completion_tokens``; the message and ``param`` use the client's name.
    """
    error = from_value_error(exc)
    renamed = {"logprobs": "top_logprobs", "max_tokens": max_tokens_field}.get(error.param or "")
    if renamed and renamed != error.param and error.message.startswith(error.param):
        error.message = renamed + error.message[len(error.param) :]
        error.param = renamed
    return error


def prepare_chat(request: ChatCompletionRequest, info: ServingInfo, tokenizer: Any) -> ChatJob:
    """Renders and tokenizes the conversation and builds its SamplingParams.

    Raises:
      APIError: 404 for an unknown model; 400 when the template rejects the messages, the
        prompt is empty or too long, or a parameter is out of range (naming the field).
    """
    info.check_model(request.model)
    tools = _plan_tools(request, info, tokenizer)
    messages = messages_as_dicts(request.messages)
    check_prompt_bytes([m["content"] for m in messages], info, field="messages")
    try:
        prompt_ids = tokenizer.encode_chat(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            tools=None if tools is None else tools.tools,
        )
    except ValueError as exc:  # malformed messages, or the chat template refused them
        error = from_value_error(exc)
        error.param = "messages"
        raise error from exc
    check_prompt_ids(prompt_ids, info, field="messages")
    field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(request.requested_max_tokens, len(prompt_ids), info)
    try:
        params = request.to_sampling_params(max_tokens, info.default_sampling)
        params.check_vocab(info.vocab_size)
        params.check_max_logprobs(info.max_logprobs)
    except ValueError as exc:
        raise _chat_field_error(exc, field) from exc
    check_sampler_memory(params, info)
    params = apply_tool_plan(request, params, tools, tokenizer, info)
    return ChatJob(
        request=request,
        request_id=random_id("chatcmpl"),
        created=int(time.time()),
        model=request.model or info.model_name,
        prompt_ids=prompt_ids,
        params=params,
        system_fingerprint=info.system_fingerprint,
        return_tokens_as_token_ids=info.return_tokens_as_token_ids,
        tools=tools,
    )


def apply_tool_plan(
    request: Any, params: SamplingParams, tools: ToolPlan | None, tokenizer: Any, info: ServingInfo
) -> SamplingParams:
    """``params`` with the tool plan applied (:func:`with_tool_plan`), after starting the request's
    token-mask preparation (the forced-call grammar or the request's own constraint, and the
    tool schemas' compile checks; ``validation.prepare_token_masks_of``). Chat and Responses share it.

    Raises:
      APIError: 400 from ``prepare_token_masks_of``.
    """
    params = with_tool_plan(params, tools)
    forced = tools is not None and tools.constraint is not None
    checks = tools.checks if tools is not None else ()
    prepare_token_masks_of(request, params, tokenizer, info, "tools" if forced else None, checks)
    return params


def with_tool_plan(params: SamplingParams, tools: ToolPlan | None) -> SamplingParams:
    """``params`` as ``tools`` needs them: the grammar that forces calls, and special tokens
    kept in the text when the parser's call marker is one."""
    if tools is not None and tools.constraint is not None:
        params = params.clone(structured_outputs=tools.constraint)
    if tools is not None and tools.parser is not None and tools.parser.needs_special_tokens:
        params = params.clone(skip_special_tokens=False)
    return params


def _plan_tools(request: ChatCompletionRequest, info: ServingInfo, tokenizer: Any) -> Any:
    """The request's ToolPlan (:func:`plan_checked_tools`).

    Raises:
      APIError: 400 naming ``tools`` or ``tool_choice``.
    """
    fmt = request.response_format
    constrained = (fmt is not None and fmt.type != "text") or bool(request.structured_outputs)
    return plan_checked_tools(
        request.tools,
        request.tool_choice,
        request.parallel_tool_calls,
        "response_format / structured_outputs" if constrained else "",
        info,
        tokenizer,
    )


def plan_checked_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool,
    constraint_field: str,
    info: ServingInfo,
    tokenizer: Any,
) -> ToolPlan | None:
    """A request's ToolPlan (``tool_calls.plan_tools``; chat-shaped ``tools``), with the
    compile of every tool's parameter schema started (``ToolPlan.checks``: the engine call
    awaits them, through ``validation.prepare_token_masks_of``).

    Args:
      constraint_field: the field of an output constraint the request also has ("" = none);
        a required or named tool choice cannot be combined with it.

    Raises:
      APIError: 400 naming ``tools`` or ``tool_choice``.
    """
    from jaxserve.structured import compile_constraint_future
    from jaxserve.structured.threads import yield_gil

    try:
        plan = plan_tools(tools, tool_choice, parallel_tool_calls, info.auto_tool_parser)
        if plan is None:
            return None
        if plan.constraint is not None and constraint_field:
            raise ValueError(
                "tool_choice: a required or named tool choice cannot be combined with "
                f"{constraint_field}"
            )
        checks = []
        # "required" compiles every tool's schema into its constraint: no separate checks.
        for tool in plan.tools if plan.mode != "required" else ():
            yield_gil()
            schema = tool["function"].get("parameters")
            if schema is not None:
                spec = StructuredOutputsParams(json=schema)
                checks.append(
                    compile_constraint_future(spec, tokenizer, "tools", info.bounded_numbers)
                )
        if plan.mode == "auto" and not tokenizer.template_shows_tools():
            raise ValueError(
                'tool_choice: "auto" cannot make tool calls with this model: its chat template '
                "does not show the tools to the model (they would be dropped and the answer "
                'would be prose); send tool_choice "required" or a named function (the grammar '
                'forces the call), or "none", or serve a model whose template renders tools '
                "(see the README's tool-calling table)"
            )
    except ValueError as exc:
        raise from_value_error(exc) from exc
    return dataclasses.replace(plan, checks=tuple(checks))


def _tool_finish(finish_reason: str | None, num_calls: int) -> str | None:
    """OpenAI's ``tool_calls`` finish reason for a sample that stopped after making calls."""
    return "tool_calls" if finish_reason == "stop" and num_calls else finish_reason


def _header(job: ChatJob, obj: str) -> dict[str, Any]:
    return {
        "id": job.request_id,
        "object": obj,
        "created": job.created,
        "model": job.model,
        "system_fingerprint": job.system_fingerprint,
    }


def build_chat_response(job: ChatJob, output: RequestOutput, tokenizer: Any) -> dict[str, Any]:
    """The non-streaming response body from the request's final RequestOutput."""
    request = job.request
    choices = []
    for completion in output.outputs:
        logprobs = None
        if request.logprobs:
            logprobs = chat_logprobs(
                completion.token_ids, completion.logprobs, request.top_logprobs or 0, tokenizer
            )
        message: dict[str, Any] = {
            "role": "assistant",
            "content": completion.text,
            "refusal": None,
        }
        finish_reason = completion.finish_reason
        extractor = job.tools.extractor() if job.tools is not None else None
        if extractor is not None:
            message["content"], calls = extractor.final(completion.text, finish_reason)
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
                finish_reason = _tool_finish(finish_reason, len(calls))
        choices.append(
            {
                "index": completion.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": completion.stop_reason,
            }
        )
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    body = {
        **_header(job, "chat.completion"),
        "choices": choices,
        "usage": usage(
            len(output.prompt_token_ids), completion_tokens, max(0, output.num_cached_tokens)
        ),
    }
    if request.include_ledger:
        body["ledger"] = response_ledger(
            job.request_id, [(output.request_id, output.ledgers or [])]
        )
    return body


async def create_chat(llm: EngineClient, job: ChatJob) -> dict[str, Any]:
    """Runs a non-streaming chat completion to the end and returns the response body.

    Raises:
      APIError: 400 if the engine refused the prompt, 503 if the engine died.
    """
    streams = await start_requests(
        llm,
        job.request_id,
        [job.prompt_ids],
        [job.params],
        priority=job.request.priority,
        cache_salt=job.request.cache_salt,
    )
    (output,) = await collect_all(streams)
    return build_chat_response(
        job, output, logprobs_tokenizer(llm.tokenizer, job.return_tokens_as_token_ids)
    )


async def stream_chat(
    llm: EngineClient, job: ChatJob
) -> tuple[list[RequestOutputStream], AsyncIterator[dict[str, Any]]]:
    """Starts the engine request and returns it with the async iterator of chunk dicts.

    Same contract as ``completion.stream_completion``.
    """
    streams = await start_requests(
        llm,
        job.request_id,
        [job.prompt_ids],
        [job.params],
        priority=job.request.priority,
        cache_salt=job.request.cache_salt,
    )
    return streams, _chunks(
        job, streams, logprobs_tokenizer(llm.tokenizer, job.return_tokens_as_token_ids)
    )


async def _chunks(
    job: ChatJob, streams: list[RequestOutputStream], tokenizer: Any
) -> AsyncIterator[dict[str, Any]]:
    request = job.request
    header = _header(job, "chat.completion.chunk")
    if request.include_usage:
        header["usage"] = None
    num_top = request.top_logprobs or 0

    def chunk(
        index: int,
        delta: dict[str, Any],
        logprobs: Any = None,
        finish_reason: str | None = None,
        stop_reason: Any = None,
    ) -> dict[str, Any]:
        return {
            **header,
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": stop_reason,
                }
            ],
        }

    finished: set[int] = set()
    extractors = {i: job.tools.extractor() for i in range(request.n)} if job.tools else {}
    prompt_tokens = cached = 0
    completion_tokens: dict[int, int] = {}
    ledgers: list[tuple[str, list]] = []
    first = True
    try:
        async for _, output in merge_streams(streams):
            if first:  # with the engine's first output, as vLLM: time-to-first-token means it
                first = False
                for index in range(request.n):
                    yield chunk(index, {"role": "assistant", "content": ""})
            if output.finished:
                ledgers = [(output.request_id, output.ledgers or [])]
            prompt_tokens = len(output.prompt_token_ids)
            cached = max(0, output.num_cached_tokens)
            for completion in output.outputs:
                if completion.index in finished:
                    continue
                completion_tokens[completion.index] = completion_tokens.get(
                    completion.index, 0
                ) + len(completion.delta_token_ids)  # the deltas add up, whatever the kind
                logprobs = None
                if request.logprobs and completion.delta_token_ids:
                    logprobs = chat_logprobs(
                        completion.delta_token_ids, completion.delta_logprobs, num_top, tokenizer
                    )
                text = completion.delta_text
                delta: dict[str, Any] = {"content": text} if text else {}
                finish_reason = completion.finish_reason
                extractor = extractors.get(completion.index)
                if extractor is not None:
                    delta = extractor.delta(text, completion.finished)
                    finish_reason = _tool_finish(finish_reason, extractor.num_calls_sent)
                if completion.finished:
                    finished.add(completion.index)
                elif not delta and logprobs is None:
                    continue
                yield chunk(
                    completion.index, delta, logprobs, finish_reason, completion.stop_reason
                )
    except EngineDeadError as exc:
        yield engine_error(exc).body()
        return
    if request.include_usage or request.include_ledger:
        last: dict[str, Any] = {**header, "choices": []}
        if request.include_usage:
            last["usage"] = usage(prompt_tokens, sum(completion_tokens.values()), cached)
        if request.include_ledger and ledgers:
            last["ledger"] = response_ledger(job.request_id, ledgers)
        yield last
