"""Chat tool calling: checking ``tools`` / ``tool_choice``, forcing calls with the grammar, and
turning the model's text into OpenAI ``tool_calls`` (whole, or as streamed deltas).

``tool_choice``:

* ``"none"``: tools are shown to the chat template, the text is returned as content.
* ``"auto"`` (the default with tools): the model may write tool calls in its own format; the
  server's ``--tool-call-parser`` finds them (``llama3_json``: ``{"name": ..., "parameters":
  ...}`` objects, optionally after ``<|python_tag|>``, ``;``-separated; ``hermes`` (Qwen2.5 /
  Qwen3): ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks after optional text;
  ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]``). Without a parser it is
  a 400 (vLLM's rule).
* ``"required"``: the grammar forces a JSON array of one or more ``{"name", "parameters"}``
  objects (one, when ``parallel_tool_calls`` is false), each naming a tool and matching its
  parameter schema; no parser needed.
* ``{"type": "function", "function": {"name": N}}``: the grammar forces N's arguments (its
  parameter schema); the whole output is the arguments.

Streaming: forced calls ("required" and named) stream as OpenAI does: a first delta with the
call's index, id and name, then its ``arguments`` text token by token (a small scanner follows
the forced JSON: ``[{"name": N, "parameters": ARGS}, ...]``, keys in that order, no free
whitespace). With "auto" the text is re-parsed as it grows (outputs are short); content is sent
as soon as it cannot be the start of a tool call, and each call is sent as one ``tool_calls``
delta when its JSON is complete.

A forced call cut by ``max_tokens`` (finish reason "length") is returned as text content, never
as ``tool_calls`` with broken JSON; streamed, its deltas are already out, and the finish reason
"length" says the arguments are incomplete (as OpenAI's do).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jaxserve.sampling_params import StructuredOutputsParams

_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128
"""Most tools one request may list (OpenAI's limit); each schema is compiled at admission."""
_EMPTY_PARAMS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}`` (with
        ``index`` for a streamed delta)."""
        body: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return body if index is None else {"index": index, **body}


def _call_from(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _json_objects(text: str, sep: str) -> tuple[list[Any], int]:
    """Complete JSON values at the start of ``text`` separated by whitespace and ``sep``; returns
    them and how many characters they (and the separators) took."""
    decoder = json.JSONDecoder()
    values, pos = [], 0
    while True:
        start = pos
        while start < len(text) and (text[start].isspace() or text[start] == sep):
            start += 1
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            return values, pos
        values.append(value)
        pos = end


def _array_calls(text: str, args_keys: tuple[str, ...]) -> list[ToolCall]:
    """Calls in a (possibly unfinished) JSON array ``[{...}, {...}`` at the start of ``text``."""
    body = text.lstrip()
    if not body.startswith("["):
        return []
    values, _ = _json_objects(body[1:], ",")
    calls = [_call_from(v, args_keys) for v in values]
    return [c for c in calls if c is not None]


@dataclasses.dataclass
class Extraction:
    """What a parser found in a (possibly partial) text: content and the complete calls."""

    content: str
    calls: list[ToolCall]
    holdback: int = 0  # trailing content characters that may still turn into a call


class ToolParser:
    """Base: a marker that starts the tool-call section; subclasses parse the section."""

    marker = ""
    args_keys: tuple[str, ...] = ("arguments", "parameters")
    needs_special_tokens = False  # the marker is a special token (kept in the text)

    def extract(self, text: str) -> Extraction:
        """Content before the marker and the calls after it (only complete ones)."""
        at = text.find(self.marker)
        if at < 0:
            return Extraction(text, [], _partial_suffix(text, self.marker))
        return Extraction(text[:at], self.parse_section(text[at + len(self.marker) :]))

    def parse_section(self, section: str) -> list[ToolCall]:
        raise NotImplementedError


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser(ToolParser):
    """Qwen2.5 / Qwen3 (Hermes) ``<tool_call>{json}</tool_call>`` blocks."""

    marker = "<tool_call>"

    def parse_section(self, section: str) -> list[ToolCall]:
        calls = []
        for block in ("<tool_call>" + section).split("<tool_call>")[1:]:
            body, closed, _ = block.partition("</tool_call>")
            if not closed:
                break
            values, _ = _json_objects(body, ",")
            call = _call_from(values[0], self.args_keys) if values else None
            if call is not None:
                calls.append(call)
        return calls


class MistralParser(ToolParser):
    """Mistral ``[TOOL_CALLS][{"name", "arguments"}, ...]``."""

    marker = "[TOOL_CALLS]"
    needs_special_tokens = True

    def parse_section(self, section: str) -> list[ToolCall]:
        return _array_calls(section, self.args_keys)


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calls: the answer is ``{"name", "parameters"}`` objects
    (``;``-separated), optionally after ``<|python_tag|>``."""

    marker = "<|python_tag|>"
    needs_special_tokens = True

    def extract(self, text: str) -> Extraction:
        body = text
        if body.lstrip().startswith(self.marker):
            body = body.lstrip()[len(self.marker) :]
        elif not body.lstrip().startswith("{"):
            held = len(text) if self.marker.startswith(text.lstrip()) else 0
            return Extraction(text, [], held)
        values, _ = _json_objects(body, ";")
        calls = [_call_from(v, self.args_keys) for v in values]
        if values and all(c is not None for c in calls):
            return Extraction("", calls)
        if values:  # JSON that is not a call: plain content
            return Extraction(text, [])
        return Extraction(text, [], len(text))  # an unfinished object: wait


PARSERS: dict[str, type[ToolParser]] = {
    "llama3_json": Llama3JsonParser,
    "hermes": HermesParser,
    "mistral": MistralParser,
}


# ---- request side ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How one chat request handles tools.

    Attributes:
      mode: "none", "auto", "required" or "named".
      tools: the ``tools`` list as the chat template receives it (OpenAI shape).
      named: the forced function's name (mode "named").
      parser: the text parser (mode "auto").
      constraint: the grammar that forces calls (modes "required" and "named").
      checks: futures of the tools' parameter-schema compiles (the serving layer's; each
        resolves, or raises the ValueError that refuses its schema).
    """

    mode: str
    tools: list[dict[str, Any]]
    named: str | None = None
    parser: ToolParser | None = None
    constraint: StructuredOutputsParams | None = None
    checks: tuple[Any, ...] = ()

    def extractor(self) -> ToolCallExtractor | None:
        """A fresh per-choice extractor, or None when the text is plain content."""
        return None if self.mode == "none" else ToolCallExtractor(self)


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool,
    parser_name: str,
) -> ToolPlan | None:
    """Checks ``tools`` / ``tool_choice`` and decides how the request is served.

    Returns:
      None without tools (and ``tool_choice`` absent or "none").

    Raises:
      ValueError: more than ``MAX_TOOLS`` tools or a malformed one (message starts with
        ``tools``), or a ``tool_choice`` that names no tool, needs tools, or needs a
        ``--tool-call-parser`` (starts with ``tool_choice``).
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice: needs a non-empty tools list")
        return None
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools has {len(tools)} tools; at most {MAX_TOOLS} are allowed")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(
                f'tools: tools[{i}] must be {{"type": "function", "function": {{...}}}}'
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(
                f"tools: tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}"
            )
        if name in names:
            raise ValueError(f"tools: two tools are named {name!r}")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools: tools[{i}].function.parameters must be a JSON schema object")
        names.append(name)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or name not in names:
            raise ValueError(
                f"tool_choice: names function {name!r}, which is not among the tools {names}"
            )
        schema = _params_of(tools[names.index(name)])
        return ToolPlan("named", tools, name, constraint=StructuredOutputsParams(json=schema))
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "required":
        item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": n}, "parameters": _params_of(t)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for n, t in zip(names, tools)
            ]
        }
        schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, constraint=StructuredOutputsParams(json=schema))
    if choice == "auto":
        if not parser_name:
            raise ValueError(
                'tool_choice: "auto" needs the server to run with --tool-call-parser '
                '(or send tool_choice "required", "none" or a named function)'
            )
        return ToolPlan("auto", tools, parser=PARSERS[parser_name]())
    raise ValueError(
        f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}'
    )


def _params_of(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _EMPTY_PARAMS


def template_tool_call(call: Any) -> Any:
    """An earlier assistant tool call as a chat template reads it: OpenAI's call with its JSON
    ``arguments`` string parsed to an object (HF templates render ``arguments | tojson``)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass
    return {**call, "function": fn}


# ---- response side --------------------------------------------------------------------------


class ToolCallExtractor:
    """One choice's text -> content and tool calls, whole (``final``) or as stream deltas."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self._content_sent = 0
        self._calls_sent = 0
        self._named_started = False
        self._required = _ForcedCallStream()

    def extract(self, text: str) -> Extraction:
        """Content and complete calls of the text so far."""
        plan = self.plan
        if plan.mode == "named":
            try:
                json.loads(text)
            except json.JSONDecodeError:
                return Extraction("", [])
            return Extraction("", [ToolCall(plan.named, text)])
        if plan.mode == "required":
            return Extraction("", _array_calls(text, ("parameters", "arguments")))
        return plan.parser.extract(text)

    def final(
        self, text: str, finish_reason: str | None = None
    ) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) of a finished choice. A forced call cut by ``max_tokens``
        (``finish_reason`` "length") is content: its JSON may be incomplete."""
        if finish_reason == "length" and self.plan.mode in ("named", "required"):
            return text, []
        found = self.extract(text)
        return (found.content or None) if found.calls else text, found.calls

    def delta(self, delta_text: str, finished: bool) -> dict[str, Any]:
        """The chat ``delta`` fields for ``delta_text`` (may be empty)."""
        self.text += delta_text
        out: dict[str, Any] = {}
        if self.plan.mode == "required":
            calls = self._required.feed(delta_text)
            self._calls_sent = self._required.num_calls
            return {"tool_calls": calls} if calls else {}
        if self.plan.mode == "named":
            calls: list[dict[str, Any]] = []
            if not self._named_started:
                self._named_started = True
                call = ToolCall(self.plan.named, "").as_openai(0)
                calls.append(call)
            if delta_text:
                if calls:
                    calls[0]["function"]["arguments"] = delta_text
                else:
                    calls.append({"index": 0, "function": {"arguments": delta_text}})
            self._calls_sent = 1
            return {"tool_calls": calls} if calls else {}
        found = self.extract(self.text)
        end = len(found.content) - (0 if finished else found.holdback)
        if not found.calls and finished and self.plan.mode != "auto":
            end = 0
        if end > self._content_sent:
            out["content"] = found.content[self._content_sent : end]
            self._content_sent = end
        new = found.calls[self._calls_sent :]
        if new:
            out["tool_calls"] = [c.as_openai(self._calls_sent + i) for i, c in enumerate(new)]
            self._calls_sent += len(new)
        return out

    @property
    def num_calls_sent(self) -> int:
        """Tool calls sent so far as deltas."""
        return self._calls_sent


_CALL_HEAD = re.compile(r'\{"name": "([a-zA-Z0-9_-]{1,64})", "parameters": ')


class _ForcedCallStream:
    """Streams the calls of a "required" tool choice's forced JSON, ``[{"name": N,
    "parameters": ARGS}, ...]`` (the grammar fixes the key order and the separators), as OpenAI
    deltas: ``{index, id, type, function: {name, arguments: ""}}`` once a call's name is
    complete, then ``{index, function: {arguments: piece}}`` for each piece of ARGS's text.
    Each character is scanned once."""

    def __init__(self) -> None:
        self.text = ""
        self.num_calls = 0
        self._pos = 0  # scanned up to here
        self._in_args = False
        self._depth = 0  # nesting of ARGS (objects and arrays)
        self._in_string = False
        self._escape = False

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """Delta entries for ``piece``, the next text of the output."""
        self.text += piece
        out: list[dict[str, Any]] = []
        while self._pos < len(self.text):
            if not self._in_args:
                head = _CALL_HEAD.search(self.text, self._pos)
                if head is None:
                    return out  # the next call's head is not complete yet
                out.append(ToolCall(head.group(1), "").as_openai(self.num_calls))
                self.num_calls += 1
                self._pos = head.end()
                self._in_args, self._depth = True, 0
                self._in_string = self._escape = False
                continue
            start = self._pos
            end = self._scan_args()
            if end > start:
                args = self.text[start:end]
                if out and out[-1]["index"] == self.num_calls - 1 and "id" in out[-1]:
                    out[-1]["function"]["arguments"] += args
                else:
                    out.append({"index": self.num_calls - 1, "function": {"arguments": args}})
        return out

    def _scan_args(self) -> int:
        """Moves over ARGS's text; returns where the text of ARGS scanned so far ends (the
        value's end once it closes, after which the next call's head is looked for)."""
        text = self.text
        i = self._pos
        while i < len(text):
            c = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:  # a string value: it ends here
                        self._in_args = False
                        self._pos = i + 1
                        return i + 1
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]" or (c == "," and self._depth == 0):
                if self._depth == 0:  # a scalar value ended before this character
                    self._in_args = False
                    self._pos = i
                    return i
                self._depth -= 1
                if self._depth == 0:
                    self._in_args = False
                    self._pos = i + 1
                    return i + 1
            i += 1
        self._pos = i
        return i
