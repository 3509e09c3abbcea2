"""``/v1/responses``: OpenAI's Responses API, served through the chat path.

Plain functions, no HTTP, like ``chat``:

    job = prepare_responses(request, info, tokenizer, store=store)   # 400s / 404s here
    body = await create_responses(llm, job)                          # the Response object
    streams, events = await stream_responses(llm, job)               # event dicts for SSE

The conversation is ``instructions`` (a system message, for this request only), the stored
conversation of ``previous_response_id`` (its input and output, without its instructions), then
``input``; it is rendered with the chat template and tokenized as chat does
(``Tokenizer.encode_chat``), with the function ``tools`` in chat's shape. The output is parsed
as chat's is (``tool_calls.ToolCallExtractor``): text becomes a ``message`` item with one
``output_text`` part, each tool call a ``function_call`` item whose ``call_id`` a later
``function_call_output`` input item answers.

Streaming sends OpenAI's event sequence, each event named by its ``type`` (SSE ``event:``
lines, no ``[DONE]``): ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, (``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``) or (``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``), ``response.output_item.done``, and last
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it). Every event
carries a ``sequence_number`` counting from 0. If the engine dies or goes to sleep mid-way an
``error`` event ends the stream.

``store`` (default true) keeps the response in the server's :class:`ResponseStore`, a bounded
in-memory LRU (``GET /v1/responses/{id}``, ``previous_response_id``); ``store: false`` keeps
nothing. Stored responses live as long as the server process, at most
``RESPONSE_STORE_ENTRIES`` of them and ``RESPONSE_STORE_BYTES`` of conversation text. When
callers are told apart (several API keys), each stored response belongs to the key that created
it: another key can neither read, delete nor continue it (the 404 of an unknown id), as with
request ledgers.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from jaxserve.engine.protocol import EngineClient, EngineDeadError, RequestOutputStream
from jaxserve.request_output import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.serving.chat import apply_tool_plan, plan_checked_tools
from jaxserve.serving.engine_calls import (
    collect_all,
    engine_error,
    merge_streams,
    random_id,
    start_requests,
)
from jaxserve.serving.errors import APIError, bad_request, from_value_error
from jaxserve.serving.protocol import ResponsesRequest
from jaxserve.serving.tool_calls import ToolPlan, template_tool_call
from jaxserve.serving.validation import (
    ServingInfo,
    check_prompt_bytes,
    check_prompt_ids,
    check_sampler_memory,
    resolve_max_tokens,
)

RESPONSE_STORE_ENTRIES = 1024
"""Most responses :class:`ResponseStore` keeps (least recently used go first)."""
RESPONSE_STORE_BYTES = 64 * 2**20
"""Most bytes of conversation JSON it keeps."""

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
"""The roles an ``input`` message item may have."""
TEXT_PARTS = ("input_text", "output_text", "text")
"""The content part types read as text."""


# ---- the store ---------------------------------------------------------------------------


@dataclasses.dataclass
class StoredResponse:
    """One stored response.

    Attributes:
      body: the Response object as it was returned.
      conversation: the chat messages through this response's output (its instructions left
        out): what a ``previous_response_id`` continues.
      nbytes: the conversation's size as JSON, bytes (what the store's bound counts).
      owner: the caller that created it (the API key's id, when several keys tell callers
        apart), or None.
    """

    body: dict[str, Any]
    conversation: list[dict[str, Any]]
    nbytes: int
    owner: str | None = None


class ResponseStore:
    """Stored responses by id, a bounded LRU in this process's memory.

    Args:
      max_entries: most responses kept.
      max_bytes: most bytes of conversation JSON kept (a response larger than this alone is
        not kept).
    """

    def __init__(
        self, max_entries: int = RESPONSE_STORE_ENTRIES, max_bytes: int = RESPONSE_STORE_BYTES
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """The stored response (now the most recently used), or None; with ``owner``, None
        also when another caller (or none) created it."""
        entry = self._entries.get(response_id)
        if entry is None or (owner is not None and entry.owner != owner):
            return None
        self._entries.move_to_end(response_id)
        return entry

    def put(
        self, body: dict[str, Any], conversation: list[dict[str, Any]], owner: str | None = None
    ) -> None:
        """Keeps a response under ``body["id"]`` (``owner``: who created it), evicting the
        least recently used ones past the bounds."""
        nbytes = len(json.dumps(conversation, ensure_ascii=False))
        if nbytes > self.max_bytes:
            return
        self.delete(body["id"])
        self._entries[body["id"]] = StoredResponse(body, conversation, nbytes, owner)
        self.nbytes += nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def delete(self, response_id: str, owner: str | None = None) -> bool:
        """Forgets a response; False when it was not stored (with ``owner``: or belongs to
        another caller, and is kept)."""
        if self.get(response_id, owner) is None:
            return False
        entry = self._entries.pop(response_id)
        self.nbytes -= entry.nbytes
        return True


# ---- the request side ----------------------------------------------------------------------


@dataclasses.dataclass
class ResponsesJob:
    """A validated Responses request, ready for the engine.

    Attributes:
      request: the parsed body.
      request_id: the response id (``resp_...``); the engine request is ``{request_id}-0``.
      created_at: Unix seconds.
      model: the model name to report.
      conversation: the chat messages of the previous response and this input (no
        instructions); the output is appended to them when stored.
      prompt_ids: the rendered conversation's token ids.
      params: its SamplingParams.
      tools: how tools are served (``tool_calls.ToolPlan``), or None without tools.
      store: where the response is kept when ``request.store``, or None.
      owner: the caller that sent it (``OpenAIServing.generate``'s ``owner``), or None.
    """

    request: ResponsesRequest
    request_id: str
    created_at: int
    model: str
    conversation: list[dict[str, Any]]
    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolPlan | None = None
    store: ResponseStore | None = None
    owner: str | None = None

    @property
    def first_prompt(self) -> list[int]:
        """The prompt's token ids (what a router matches against replicas' caches)."""
        return self.prompt_ids


def _part_text(content: Any, where: str) -> str:
    """A message's content as one string: a string, or text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}.content[{j}] must be a text part ({', '.join(TEXT_PARTS)} with a "
                f"string text); got type {kind!r} (only text input is supported)",
                param="input",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input``: a string is one user message; message
    items keep their role; consecutive ``function_call`` items become one assistant turn's
    ``tool_calls`` (OpenAI's chat shape, ``id`` = ``call_id``), each ``function_call_output``
    a ``tool`` message; ``reasoning`` items are skipped.

    Raises:
      APIError: 400 naming ``input`` and the item for an item of another type or shape.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    calling = False  # the last message is an assistant turn made of function calls
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise bad_request(
                    f"{where}.role must be one of {list(MESSAGE_ROLES)}, got {role!r}",
                    param="input",
                )
            out.append({"role": role, "content": _part_text(item.get("content"), where)})
            calling = False
        elif kind == "function_call":
            fields = [item.get(k) for k in ("call_id", "name", "arguments")]
            if not all(isinstance(f, str) for f in fields):
                raise bad_request(
                    f"{where}: a function_call item needs string call_id, name and arguments",
                    param="input",
                )
            call_id, name, arguments = fields
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            if calling:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                calling = True
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise bad_request(
                    f"{where}: a function_call_output item needs a string call_id", param="input"
                )
            text = _part_text(output, where) if output is not None else None
            if text is None:
                raise bad_request(f"{where}.output is required", param="input")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            calling = False
        elif kind != "reasoning":
            raise bad_request(
                f"{where}.type {kind!r} is not supported (message, function_call, "
                "function_call_output)",
                param="input",
            )
    if not out:
        raise bad_request("input must hold at least one message", param="input")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools in chat's shape (``{"type": "function", "function": {...}}``).

    Raises:
      APIError: 400 naming ``tools`` for a tool of another type or without a name.
    """
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools[{i}].type {tool.get('type')!r} is not supported (only function tools)",
                param="tools",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """A Responses ``tool_choice`` in chat's shape (a named function moves under
    ``function``); anything else is passed on for ``plan_tools`` to check."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a chat template reads them (earlier calls' JSON arguments as objects)."""
    return [
        {**m, "tool_calls": [template_tool_call(c) for c in m["tool_calls"]]}
        if "tool_calls" in m
        else m
        for m in messages
    ]


def prepare_responses(
    request: ResponsesRequest,
    info: ServingInfo,
    tokenizer: Any,
    *,
    store: ResponseStore | None = None,
    owner: str | None = None,
) -> ResponsesJob:
    """Builds the conversation, renders and tokenizes it, and builds its SamplingParams.

    Args:
      store: the server's stored responses (``previous_response_id`` is looked up there, and
        the response kept there when ``request.store``); None: none kept.
      owner: the caller, when callers are told apart: ``previous_response_id`` must be one of
        its own responses, and the response is kept as its own.

    Raises:
      APIError: 404 for an unknown model or ``previous_response_id``; 400 for a bad item,
        tool, length or parameter (naming the field).
    """
    info.check_model(request.model)
    history: list[dict[str, Any]] = []
    if request.previous_response_id is not None:
        stored = store.get(request.previous_response_id, owner) if store is not None else None
        if stored is None:
            raise APIError(
                f"Previous response with id {request.previous_response_id!r} not found (it was "
                "never stored, was stored with store: false, was evicted, or was created with "
                "another API key)",
                status=404,
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = stored.conversation
    conversation = history + input_messages(request.input)
    messages = list(conversation)
    if request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    try:
        constraint = request.structured_outputs_params()
    except ValueError as exc:
        raise from_value_error(exc) from exc
    tools = plan_checked_tools(
        chat_tools(request.tools),
        chat_tool_choice(request.tool_choice),
        request.parallel_tool_calls,
        "text.format" if constraint is not None else "",
        info,
        tokenizer,
    )
    check_prompt_bytes([m["content"] for m in messages], info, field="input")
    try:
        prompt_ids = tokenizer.encode_chat(
            template_messages(messages),
            add_generation_prompt=True,
            tools=None if tools is None else tools.tools,
        )
    except ValueError as exc:  # the chat template refused the conversation
        error = from_value_error(exc)
        error.param = "input"
        raise error from exc
    check_prompt_ids(prompt_ids, info, field="input")
    max_tokens = resolve_max_tokens(request.max_output_tokens, len(prompt_ids), info)
    params = _sampling_params(request, max_tokens, constraint, info)
    check_sampler_memory(params, info)
    params = apply_tool_plan(request, params, tools, tokenizer, info)
    return ResponsesJob(
        request=request,
        request_id=random_id("resp", sep="_"),
        created_at=int(time.time()),
        model=request.model or info.model_name,
        conversation=conversation,
        prompt_ids=prompt_ids,
        params=params,
        tools=tools,
        store=store if request.store else None,
        owner=owner,
    )


def _sampling_params(
    request: ResponsesRequest, max_tokens: int, constraint: Any, info: ServingInfo
) -> SamplingParams:
    """The request's SamplingParams; fields it leaves out come from ``--generation-config``.

    Raises:
      APIError: 400 naming the field out of range.
    """
    kwargs: dict[str, Any] = {
        k: v for k, v in info.default_sampling.items() if k not in ("max_tokens", "n")
    }
    for name in ("temperature", "top_p", "seed"):
        value = getattr(request, name)
        if value is not None:
            kwargs[name] = value
    try:
        params = SamplingParams(max_tokens=max_tokens, structured_outputs=constraint, **kwargs)
        params.check_vocab(info.vocab_size)
    except ValueError as exc:
        raise from_value_error(exc) from exc
    return params


# ---- the response side ---------------------------------------------------------------------


def _usage(output: RequestOutput) -> dict[str, Any]:
    """The Responses ``usage`` object of a finished request."""
    prompt = len(output.prompt_token_ids)
    generated = sum(len(c.token_ids) for c in output.outputs)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": max(0, output.num_cached_tokens)},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }


def response_body(
    job: ResponsesJob,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Response object (OpenAI's shape) in ``status`` ("in_progress", "completed",
    "incomplete") with these output items."""
    request = job.request
    return {
        "id": job.request_id,
        "object": "response",
        "created_at": job.created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": job.model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": request.store,
        "temperature": job.params.temperature,
        "text": request.text or {"format": {"type": "text"}},
        "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
        "tools": request.tools or [],
        "top_p": job.params.top_p,
        "truncation": request.truncation or "disabled",
        "usage": usage,
        "user": request.user,
        "metadata": request.metadata or {},
    }


class OutputItems:
    """Turns one sample's text, as it grows, into Responses output items and the stream's
    events about them (without ``sequence_number``; the caller numbers them).

    Attributes:
      items: the output items so far, in order (the last ones may still be in progress).
    """

    def __init__(self, tools: ToolPlan | None) -> None:
        self.items: list[dict[str, Any]] = []
        self._extractor = tools.extractor() if tools is not None else None
        self._message: dict[str, Any] | None = None  # the message item open, if any
        self._text = ""
        self._blank = ""  # whitespace not sent yet: it opens a message only if text follows
        self._calls: dict[int, dict[str, Any]] = {}  # open function_call items by call index

    def feed(self, delta_text: str, finished: bool) -> list[dict[str, Any]]:
        """The events for ``delta_text`` (and, once ``finished``, those closing every item)."""
        if self._extractor is None:
            delta: dict[str, Any] = {"content": delta_text} if delta_text else {}
        else:
            delta = self._extractor.delta(delta_text, finished)
        events: list[dict[str, Any]] = []
        content = delta.get("content")
        if content:
            if self._message is None and not (self._blank + content).strip():
                self._blank += content  # whitespace alone opens no message (before a call)
            else:
                events += self._add_text(self._blank + content)
                self._blank = ""
        for call in delta.get("tool_calls", ()):
            events += self._add_call(call)
        if finished:
            if not self.items:  # no call: the text (maybe blank or empty) is the message
                events += self._add_text(self._blank)
            events += self._close_message() + self._close_calls()
        return events

    def _index(self, item: dict[str, Any]) -> int:
        return self.items.index(item)

    def _add_text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            events += self._close_calls()
            item = {
                "id": random_id("msg", sep="_"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self.items.append(item)
            self._message, self._text = item, ""
            index = self._index(item)
            events.append(
                {"type": "response.output_item.added", "output_index": index, "item": dict(item)}
            )
            events.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": _text_part(""),
                }
            )
        self._text += text
        if text:
            item = self._message
            events.append(
                {
                    "type": "response.output_text.delta",
                    "item_id": item["id"],
                    "output_index": self._index(item),
                    "content_index": 0,
                    "delta": text,
                    "logprobs": [],
                }
            )
        return events

    def _close_message(self) -> list[dict[str, Any]]:
        item = self._message
        if item is None:
            return []
        self._message = None
        part = _text_part(self._text)
        item["content"], item["status"] = [part], "completed"
        where = {"item_id": item["id"], "output_index": self._index(item), "content_index": 0}
        return [
            {"type": "response.output_text.done", **where, "text": self._text, "logprobs": []},
            {"type": "response.content_part.done", **where, "part": part},
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": item,
            },
        ]

    def _add_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat ``tool_calls`` delta entry: a new call (with ``id``), or more arguments."""
        events = []
        arguments = call.get("function", {}).get("arguments") or ""
        if "id" in call:
            events += self._close_message()
            item = {
                "id": random_id("fc", sep="_"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": "",
            }
            self.items.append(item)
            self._calls[call["index"]] = item
            events.append(
                {
                    "type": "response.output_item.added",
                    "output_index": self._index(item),
                    "item": dict(item),
                }
            )
        item = self._calls[call["index"]]
        if arguments:
            item["arguments"] += arguments
            events.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item["id"],
                    "output_index": self._index(item),
                    "delta": arguments,
                }
            )
        return events

    def _close_calls(self) -> list[dict[str, Any]]:
        events = []
        for item in self._calls.values():
            item["status"] = "completed"
            index = self._index(item)
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
            events.append(
                {"type": "response.output_item.done", "output_index": index, "item": item}
            )
        self._calls = {}
        return events


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _finish(job: ResponsesJob, items: OutputItems, final: RequestOutput) -> dict[str, Any]:
    """The finished Response object; kept in the store when the request asked."""
    (sample,) = final.outputs
    status = "incomplete" if sample.finish_reason == "length" else "completed"
    body = response_body(job, status, items.items, _usage(final))
    if job.store is not None:
        job.store.put(body, job.conversation + _assistant_turns(items.items), job.owner)
    return body


def _assistant_turns(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat messages a later ``previous_response_id`` continues from."""
    out: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            out.append({"role": "assistant", "content": text})
            continue
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        if out and out[-1]["role"] == "assistant":
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    return out


async def create_responses(llm: EngineClient, job: ResponsesJob) -> dict[str, Any]:
    """Runs a non-streaming Responses request to its end and returns the Response object.

    Raises:
      APIError: 400 if the engine refused the prompt, 503 if it died or went to sleep.
    """
    streams = await _start(llm, job)
    (final,) = await collect_all(streams)
    items = OutputItems(job.tools)
    items.feed(final.outputs[0].text, True)
    return _finish(job, items, final)


async def stream_responses(
    llm: EngineClient, job: ResponsesJob
) -> tuple[list[RequestOutputStream], AsyncIterator[dict[str, Any]]]:
    """Starts the engine request and returns it with the async iterator of event dicts (each
    ``type`` names its SSE event).

    Raises:
      APIError: 400 if the engine refused the prompt (nothing started), 503 if it is dead.
    """
    streams = await _start(llm, job)
    return streams, _events(job, streams)


async def _start(llm: EngineClient, job: ResponsesJob) -> list[RequestOutputStream]:
    return await start_requests(
        llm,
        job.request_id,
        [job.prompt_ids],
        [job.params],
        priority=job.request.priority,
        cache_salt=job.request.cache_salt,
    )


async def _events(
    job: ResponsesJob, streams: list[RequestOutputStream]
) -> AsyncIterator[dict[str, Any]]:
    sequence = 0

    def numbered(event: dict[str, Any]) -> dict[str, Any]:
        nonlocal sequence
        event = {"type": event["type"], "sequence_number": sequence, **event}
        sequence += 1
        return event

    started = response_body(job, "in_progress", [])
    yield numbered({"type": "response.created", "response": started})
    yield numbered({"type": "response.in_progress", "response": started})
    items = OutputItems(job.tools)
    final: RequestOutput | None = None
    try:
        async for _, output in merge_streams(streams):
            (sample,) = output.outputs
            for event in items.feed(sample.delta_text, sample.finished):
                yield numbered(event)
            if output.finished:
                final = output
    except EngineDeadError as exc:
        error = engine_error(exc)
        yield numbered(
            {"type": "error", "code": error.code, "message": error.message, "param": None}
        )
        return
    assert final is not None, "a request stream ended without a finished output"
    body = _finish(job, items, final)
    yield numbered({"type": f"response.{body['status']}", "response": body})
