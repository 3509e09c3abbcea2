"""Request bodies of the OpenAI-compatible API as pydantic v2 models, and their SamplingParams.

Source: the OpenAI API reference for ``/v1/completions`` and ``/v1/chat/completions`` (field
names, defaults, shapes) and vLLM's ``entrypoints/openai/protocol.py`` for the extensions
(top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens,
include_stop_str_in_output, skip_special_tokens, priority, cache_salt, prompt_logprobs) and for
the ``/tokenize`` and ``/detokenize`` bodies.

Types are strict (``"max_tokens": "10"`` is a 400, booleans are not integers) and non-finite
floats are refused (a JSON number with a zero fraction, ``2.0``, reaches these models as the
integer it equals: ``json_io.parse_json_body``, as JSON Schema counts it); unknown fields are accepted and ignored, as OpenAI clients send
fields we do not serve. Ranges are checked once, by :class:`~jaxserve.sampling_params.SamplingParams`,
so the range rules live in one place; the models here only check types and shapes.

Boundaries (the "top-p-boundaries" case): ``temperature`` is in [0, 2], 0 meaning greedy;
``top_p`` is in [0, 1], 1 meaning off (same tokens as not sending it) and 0 meaning "keep only the
most probable token" (greedy among ties, broken by token id; vLLM refuses 0).
Values outside are a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jaxserve.sampling_params import (
    STRUCTURED_KINDS,
    STRUCTURED_OPTIONS,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    check_stop_caps,
)

_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

_STRICT = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _drop_nulls(model: type[BaseModel], data: Any, keep: tuple[str, ...] = ()) -> Any:
    """``data`` without the ``null``s of optional fields that have a non-null default (those
    mean the default), except the fields in ``keep``."""
    if not isinstance(data, dict):
        return data
    fields = model.model_fields
    return {
        key: value
        for key, value in data.items()
        if not (
            value is None
            and key in fields
            and key not in keep
            and not fields[key].is_required()
            and fields[key].default is not None
        )
    }


def _check_salt(value: str | None) -> str | None:
    # vLLM's rule: an empty salt would silently share the unsalted prefix cache.
    if value is not None and not value:
        raise ValueError("cache_salt must be a non-empty string if given")
    return value


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds one last chunk with empty choices and the usage."""

    model_config = _STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: a named JSON schema (``strict`` is accepted; the
    grammar always enforces the schema)."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.json_schema is None
        ):
            raise ValueError("json_schema.schema is required when type is json_schema")
        return self


class _SamplingRequest(BaseModel):
    """Fields completions and chat share (OpenAI's plus vLLM's sampling extensions)."""

    model_config = _STRICT

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, le=_INT32_MAX)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, le=_INT32_MAX)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    cache_salt: str | None = None
    user: str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    include_ledger: bool = False  # jaxserve: the request's ledger in the response ("ledger")
    structured_outputs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """``null`` for an optional field with a default means the default (OpenAI marks ``n``,
        ``stream``, ``echo``, chat's ``logprobs`` ... "or null"; vLLM's models accept it). The
        completions ``max_tokens: null`` keeps its own meaning (no cap but max_model_len)."""
        return _drop_nulls(cls, data, keep=("max_tokens",))

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("stop")
    @classmethod
    def _stop_caps(cls, value: str | list[str] | None) -> str | list[str] | None:
        check_stop_caps(value)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_digits(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        # Token ids in decimal ASCII digits (``int`` would also read " 5", "+5" and other
        # scripts' digits, which the OpenAPI document does not allow).
        for key in value or ():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(
                    f"logit_bias keys must be token ids in decimal digits, got {key!r}"
                )
        return value

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, value: str | None) -> str | None:
        return _check_salt(value)

    @field_validator("stream_options")
    @classmethod
    def _no_options_without_stream(
        cls, value: StreamOptions | None, info: Any
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("response_format")
    @classmethod
    def _one_constraint(cls, value: ResponseFormat | None, info: Any) -> ResponseFormat | None:
        given = info.data.get("structured_outputs") or {}
        if value is not None and value.type != "text" and set(given) - set(STRUCTURED_OPTIONS):
            raise ValueError(
                "response_format: give response_format or structured_outputs, not both "
                f"(structured_outputs may then carry only {list(STRUCTURED_OPTIONS)})"
            )
        return value

    @property
    def constraint_field(self) -> str:
        """The request field that carries the output constraint (for error messages)."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            return "response_format"
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint of ``response_format`` or vLLM's ``structured_outputs`` (whose
        options, ``bounded_numbers``, also apply to ``response_format``).

        Raises:
          ValueError: ``structured_outputs`` names an unknown key or a bad value (message
            starts with ``structured_outputs``).
        """
        known = {k: v for k, v in (self.structured_outputs or {}).items() if v is not None}
        unknown = sorted(set(known) - set(STRUCTURED_KINDS) - set(STRUCTURED_OPTIONS))
        if unknown:
            raise ValueError(
                f"structured_outputs: unknown keys {unknown}; expected one of "
                f"{list(STRUCTURED_KINDS)} and the options {list(STRUCTURED_OPTIONS)}"
            )
        options = {k: v for k, v in known.items() if k in STRUCTURED_OPTIONS}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True, **options)
        if fmt is not None and fmt.type == "json_schema":
            return StructuredOutputsParams(json=fmt.json_schema.json_schema, **options)
        if self.structured_outputs is None or known.keys() <= set(STRUCTURED_OPTIONS):
            return None
        return StructuredOutputsParams(**known)

    def _sampling_kwargs(self, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """SamplingParams keywords of the fields this base class holds; a field left out (None)
        takes its value from ``defaults`` (``--generation-config``) when that has one."""
        kwargs: dict[str, Any] = {
            "n": self.n,
            "stop": self.stop if self.stop is not None else [],
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "logit_bias": dict(self.logit_bias or {}),
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "seed": self.seed,
            "structured_outputs": self.structured_outputs_params(),
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": list(self.bad_words or []),
            # a stream reads what is new at each step: nothing cumulative is copied for it
            "output_kind": RequestOutputKind.DELTA if self.stream else RequestOutputKind.CUMULATIVE,
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is None and defaults:
                value = defaults.get(name)
            if value is not None:
                kwargs[name] = value
        return kwargs

    @property
    def include_usage(self) -> bool:
        """True when a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions`` (OpenAI legacy completions).

    ``prompt`` is a string, a list of strings, a list of token ids, or a list of token-id lists;
    each prompt yields ``n`` choices, indexed ``prompt_index * n + k``. ``logprobs`` (0..20) asks
    for that many top alternatives per token; with ``echo`` the prompt's logprobs come too.
    ``max_tokens`` defaults to 16 (OpenAI) and may be 0 with ``echo`` to score a prompt.
    """

    prompt: Any
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    prompt_logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            if all(isinstance(p, str) for p in value) and value:
                return value
            if all(_is_int(t) for t in value):
                return value
            if value and all(isinstance(p, list) and all(_is_int(t) for t in p) for p in value):
                return value
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, value: int | None, info: Any) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of is not supported (only best_of == n)")
        return value

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    def to_sampling_params(
        self, max_tokens: int | None, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """The SamplingParams of this request.

        Args:
          max_tokens: the resolved output cap (this request's, or what max_model_len leaves).
          defaults: values for the sampling fields the request leaves out (the server's
            ``--generation-config``).

        Raises:
          ValueError: a value is out of range; the message starts with the field's name.
        """
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs
        return SamplingParams(
            max_tokens=max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=prompt_logprobs,
            **self._sampling_kwargs(defaults),
        )


class TextPart(BaseModel):
    """One ``{"type": "text", "text": ...}`` part of a message's content."""

    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; ``content`` is a string, a list of text parts, or null (assistant)."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's earlier calls
    tool_call_id: str | None = None  # a tool turn answers this call

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(p, dict) for p in value):
            # Any JSON value can arrive as "type"; only its string form is compared (a dict or a
            # list there is the client's mistake, not a reason to fail hashing it).
            kinds = [p.get("type") for p in value]
            if not all(isinstance(kind, str) for kind in kinds):
                raise ValueError('content parts need a string "type" (only "text" is supported)')
            other = sorted(set(kinds) - {"text"})
            if other:
                raise ValueError(f"content parts of type {other} are not supported (only text)")
            return value
        raise ValueError("content must be a string, a list of text parts, or null")

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        """Only an assistant turn may have null content (OpenAI: one that made tool calls); the
        chat template's normalisation refuses it for every other role."""
        if self.content is None and self.role != "assistant":
            raise ValueError(
                f"content: a {self.role} message needs content (null is only for assistant)"
            )
        return self

    def text(self) -> str:
        """The content as one string (text parts joined with newlines, null as "")."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``.

    ``max_completion_tokens`` (current name) wins over ``max_tokens`` (deprecated); with neither,
    the answer may run to max_model_len. ``logprobs`` is a bool and ``top_logprobs`` (0..20) the
    number of alternatives, allowed only with ``logprobs: true`` (OpenAI's rule).
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: Any) -> int | None:
        if value is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` if given, else ``max_tokens``."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def to_sampling_params(
        self, max_tokens: int | None, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """The SamplingParams of this request (see :meth:`CompletionRequest.to_sampling_params`)."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, **self._sampling_kwargs(defaults)
        )


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a ``prompt`` string, or chat ``messages`` rendered by the template."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (OpenAI's Responses API; ``serving.responses`` reads it).

    ``input`` is a string (one user message) or a list of items: messages (``role`` +
    ``content``, a string or ``input_text`` / ``output_text`` parts), ``function_call`` items
    (an earlier call of the model) and ``function_call_output`` items (their results). Items
    are checked when the conversation is built, each error naming ``input``. ``tools`` are
    Responses function tools (``{"type": "function", "name", "parameters", ...}``);
    ``tool_choice`` is "none", "auto", "required" or ``{"type": "function", "name"}``;
    ``text.format`` is ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``).
    ``seed``, ``priority`` and ``cache_salt`` are vLLM's extensions; ``background`` is refused.
    """

    model_config = _STRICT

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    metadata: dict[str, str] | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    seed: int | None = None
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    cache_salt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """``null`` for a field with a non-null default means that default (as the other
        request models do)."""
        return _drop_nulls(cls, data)

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool) -> bool:
        if value:
            raise ValueError("background: background responses are not supported")
        return value

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, value: str | None) -> str | None:
        return _check_salt(value)

    @property
    def constraint_field(self) -> str:
        """The request field that carries the output constraint (for error messages)."""
        return "text"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint of ``text.format``, or None for plain text.

        Raises:
          ValueError: an unknown format type or a ``json_schema`` without a schema (the
            message starts with ``text``).
        """
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            schema = fmt.get("schema")
            if not isinstance(schema, dict):
                raise ValueError("text.format.schema must be a JSON schema object")
            return StructuredOutputsParams(json=schema)
        raise ValueError(f"text.format.type must be text, json_object or json_schema, got {kind!r}")


PoolingInput = str | list[str] | list[int] | list[list[int]]
"""An embeddings input: a text, texts, one token-id prompt, or token-id prompts."""


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings`` (OpenAI's) and ``POST /pooling`` (vLLM's): ``input`` as a string,
    a list of strings, a token-id list or a list of them; ``encoding_format`` "float" or
    "base64" (little-endian float32 bytes); ``dimensions`` keeps that many leading values
    (Matryoshka) before normalising; vLLM's ``normalize`` overrides the model's default."""

    model_config = _STRICT
    model: str | None = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    user: str | None = None
    normalize: bool | None = None
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """``null`` for a field with a non-null default means that default (as the other
        request models do)."""
        return _drop_nulls(cls, data)

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: PoolingInput) -> PoolingInput:
        if isinstance(value, list) and not value:
            raise ValueError("input: give at least one text or token-id prompt")
        return value


class ScoreRequest(BaseModel):
    """``POST /v1/score`` (vLLM's): the cosine of the embeddings of ``text_1`` and ``text_2``:
    one against one, one against each of a list, or pairwise between two lists of one length."""

    model_config = _STRICT
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """``null`` for a field with a non-null default means that default."""
        return _drop_nulls(cls, data)

    @model_validator(mode="after")
    def _shapes(self) -> ScoreRequest:
        one, two = self.text_1, self.text_2
        if (isinstance(one, list) and not one) or (isinstance(two, list) and not two):
            raise ValueError("text_1: text_1 and text_2 must not be empty lists")
        if isinstance(one, list) and len(one) > 1:
            if not isinstance(two, list) or len(two) != len(one):
                raise ValueError(
                    "text_2: with several text_1 items, text_2 must be a list of the same length"
                )
        return self
