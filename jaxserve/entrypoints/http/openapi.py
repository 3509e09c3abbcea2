"""``GET /openapi.json``: the server's OpenAPI 3.1 document, generated from the request models.

The request bodies' schemas come from the pydantic models in ``protocol`` (the same models
validate the requests), refined with what the server checks beyond types (:func:`refine`):
the ranges ``SamplingParams`` enforces (:func:`sampling_ranges`; a test probes each bound
against it), ``null`` wherever it is accepted (it means the default), token ids below this
model's vocabulary, lengths up to its ``max_model_len``, ``priority`` 0 under fcfs, and the
cross-field rules JSON Schema can say (``stream_options`` needs ``stream: true``, ``/tokenize``
takes ``prompt`` or ``messages``, only assistant messages may omit ``content``). So a fuzzer
driven by it (schemathesis with its strict checks, ``tests/entrypoints/test_openapi_fuzz.py``)
finds the server accepting what the document allows and refusing the rest.
What it cannot say is in :data:`UNEXPRESSED` (and the document's description). Bodies are JSON
in UTF-8 (``Content-Type: application/json``, or none); other media types are a 415.
Responses are described by status only, plus OpenAI's error object for 4xx/5xx.
Every route ``build_app`` adds is here (a test compares the two); a route this server's runner
does not answer (the pooling routes on a generate server, the generating ones on a
``--runner pooling`` server: a 400 naming ``--runner``) takes no body (``{"not": {}}``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from jaxserve.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    STRUCTURED_KINDS,
)
from jaxserve.serving.endpoints import GENERATION, version
from jaxserve.serving.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from jaxserve.serving.pooling import POOLING_KINDS, REQUEST_MODELS
from jaxserve.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ResponsesRequest,
    ScoreRequest,
    TokenizeRequest,
)
from jaxserve.serving.responses import MESSAGE_ROLES, TEXT_PARTS
from jaxserve.serving.tool_calls import MAX_TOOLS
from jaxserve.serving.validation import ServingInfo

_BODIES: dict[str, type[BaseModel]] = {
    **{path: endpoint.request_model for path, endpoint in GENERATION.items()},
    **{path: REQUEST_MODELS[kind] for path, kind in POOLING_KINDS.items()},
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest,
}
_GETS = {
    "/v1/models": "the served model (OpenAI's list-models shape)",
    "/health": "200 while the engine serves, 503 when it is dead or the server is draining",
    "/version": "the jaxserve version",
    "/metrics": "Prometheus text exposition",
    "/openapi.json": "this document",
    "/is_sleeping": '{"is_sleeping": bool} (sleep mode)',
}


def _path_param(name: str, example: str | None = None) -> dict[str, Any]:
    param: dict[str, Any] = {
        "name": name,
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
    }
    if example is not None:
        param["example"] = example
    return param


def _query(name: str, schema: dict[str, Any], what: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": what}


LEDGER_PATH = "/v1/requests/{request_id}/ledger"

# Routes with path or query parameters: (method, path) -> (operationId, parameters, what)
_PARAMETERIZED: dict[tuple[str, str], tuple[str, list[dict[str, Any]], str]] = {
    ("get", LEDGER_PATH): (
        "v1_request_ledger",
        [_path_param("request_id")],
        "a finished request's ledger (404 once past --ledger-history)",
    ),
    ("get", "/v1/responses/{response_id}"): (
        "v1_responses_get",
        [_path_param("response_id")],
        "a stored response (404 when not stored)",
    ),
    ("delete", "/v1/responses/{response_id}"): (
        "v1_responses_delete",
        [_path_param("response_id")],
        "forgets a stored response",
    ),
    ("post", "/sleep"): (
        "sleep",
        [
            _query(
                "level", {"type": "integer", "minimum": 0, "maximum": 2, "default": 1}, "0, 1 or 2"
            ),
            _query("mode", {"type": "string", "enum": ["abort", "wait"]}, "unfinished requests"),
        ],
        "the engine sleeps (404 without --enable-sleep-mode)",
    ),
    ("post", "/wake_up"): (
        "wake_up",
        [
            _query(
                "tags",
                {
                    "type": "array",
                    "items": {"type": "string", "enum": ["weights", "kv_cache", "scheduling"]},
                },
                "what to put back (none: everything)",
            )
        ],
        "the engine woke up (status awake), or partly (status sleeping)",
    ),
}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _responses(ok: str) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {
        "200": {"description": ok},
        "4XX": {"description": "the client's mistake (OpenAI error object)", **error},
        "503": {"description": "engine dead, overloaded or shutting down", **error},
    }


INT32_MAX = 2**31 - 1

UNEXPRESSED = (
    "the prompt must leave room in max_model_len tokens (max_tokens beyond it is clamped)",
    "min_tokens <= max_tokens",
    "best_of, when given, equals n",
    "top_logprobs needs logprobs: true",
    "tool names are unique; tool parameter schemas, structured_outputs and response_format "
    "schemas, regexes and grammars must compile (llguidance)",
    'tool_choice "auto" needs --enable-auto-tool-choice, --tool-call-parser and a chat template '
    "that renders tools",
    "the chat template may refuse a conversation (e.g. roles out of order)",
    "a request's sampler buffers must fit the free memory (n, logprobs)",
    "/v1/score: a text_1 list of several texts needs a text_2 list of as many",
    "/v1/embeddings, /pooling: dimensions at most the model's hidden size",
    "/v1/embeddings, /pooling, /v1/score: each input at most max_model_len tokens",
)
"""Rules the server checks that this document cannot express in JSON Schema."""


def _range(kind: str, lo: float | None = None, hi: float | None = None, **kw: Any) -> dict:
    out: dict[str, Any] = {"type": kind, **kw}
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    return out


def digits_up_to(hi: int) -> str:
    """A regex of the decimal strings of the integers in ``[0, hi]`` (leading zeros allowed,
    as ``int()`` reads them): what a ``logit_bias`` key may be."""
    text = str(hi)
    shorter = f"[0-9]{{1,{len(text) - 1}}}" if len(text) > 1 else None
    alternatives = [shorter] if shorter else []
    for i, digit in enumerate(text):  # same length: a prefix of hi, then a smaller digit
        d = int(digit)
        if d > 0:
            rest = len(text) - i - 1
            tail = f"[0-9]{{{rest}}}" if rest else ""
            alternatives.append(f"{text[:i]}[0-{d - 1}]{tail}")
    alternatives.append(text)
    return "^0*(" + "|".join(alternatives) + ")$"


def sampling_ranges(info: ServingInfo) -> dict[str, dict[str, Any]]:
    """Field -> the JSON Schema of its accepted non-null values, for the fields both generating
    endpoints share (the ranges ``SamplingParams`` checks; token ids and lengths of this model)."""
    token = _range("integer", 0, max(info.vocab_size - 1, 0))
    stop_string = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}
    priority = (
        _range("integer", -(2**63), 2**63 - 1)
        if info.scheduling_policy == "priority"
        else {"const": 0, "description": "non-zero needs --scheduling-policy priority"}
    )
    return {
        "n": _range("integer", 1, 128),
        "temperature": _range("number", 0, 2),
        "top_p": _range("number", 0, 1),
        "top_k": _range("integer", -1, INT32_MAX),
        "min_p": _range("number", 0, 1),
        "presence_penalty": _range("number", -2, 2),
        "frequency_penalty": _range("number", -2, 2),
        "repetition_penalty": _range("number", None, 2.0**31, exclusiveMinimum=0),
        "seed": _range("integer", -(2**63), 2**64 - 1),
        "stop": {
            "anyOf": [
                stop_string,
                {"type": "array", "items": stop_string, "maxItems": MAX_STOP_STRINGS},
            ]
        },
        "stop_token_ids": {"type": "array", "items": token},
        "min_tokens": _range("integer", 0, INT32_MAX),
        "logit_bias": {
            "type": "object",
            "propertyNames": {"pattern": digits_up_to(max(info.vocab_size - 1, 0))},
            "additionalProperties": _range("number", -100, 100),
        },
        "allowed_token_ids": {"type": "array", "items": token, "minItems": 1},
        "bad_words": {"type": "array", "items": {"type": "string", "minLength": 1}},
        "priority": priority,
        "cache_salt": {"type": "string", "minLength": 1},
        "max_tokens": _range("integer", 0, info.max_model_len),
    }


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _accepts_null(model: type[BaseModel], name: str) -> bool:
    """``null`` is accepted for an optional field: its default is None, or (the sampling
    requests) null means the default (``_null_means_default``)."""
    field = model.model_fields[name]
    return not field.is_required()


def _refine_fields(schema: dict[str, Any], model: type[BaseModel], fields: dict[str, dict]) -> None:
    props = schema["properties"]
    for name, value in fields.items():
        if name not in props:
            continue
        keep = {k: props[name][k] for k in ("default", "title", "description") if k in props[name]}
        props[name] = {**(_nullable(value) if _accepts_null(model, name) else value), **keep}


def refine(schemas: dict[str, Any], info: ServingInfo) -> None:
    """Adds to the request models' schemas what the server checks beyond types (see the module
    docstring); ``schemas`` is the document's ``components.schemas``, changed in place."""
    ranges = sampling_ranges(info)
    token = ranges["stop_token_ids"]["items"]
    ids = {"type": "array", "items": token, "minItems": 1}
    texts = {"type": "array", "items": {"type": "string"}, "minItems": 1}
    logprobs = _range("integer", 0, MAX_LOGPROBS)
    length = _range("integer", 0, info.max_model_len)
    stream_needed = {
        "stream_options": {"required": ["stream"], "properties": {"stream": {"const": True}}}
    }
    kinds = {
        "json": {"type": ["object", "string"]},
        "regex": {"type": "string", "minLength": 1},
        "choice": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "grammar": {"type": "string", "minLength": 1},
        "json_object": {"const": True},
    }
    structured = {  # exactly one kind set (null or false is unset)
        "type": "object",
        "properties": {
            k: _nullable(v) if k != "json_object" else {"type": ["boolean", "null"]}
            for k, v in kinds.items()
        },
        "additionalProperties": False,
        "oneOf": [{"required": [k], "properties": {k: v}} for k, v in kinds.items()],
    }
    assert set(kinds) == set(STRUCTURED_KINDS), "a new structured_outputs kind needs its schema"
    ranges = {**ranges, "structured_outputs": structured}
    for model in (CompletionRequest, ChatCompletionRequest):
        schema = schemas[model.__name__]
        _refine_fields(schema, model, ranges)
        for name in model.model_fields:  # the rest of the optional fields: null means default
            prop = schema["properties"][name]
            if _accepts_null(model, name) and "anyOf" not in prop and "type" in prop:
                keep = {k: prop.pop(k) for k in ("default", "title", "description") if k in prop}
                schema["properties"][name] = {**_nullable(prop), **keep}
        schema["dependentSchemas"] = stream_needed
    _refine_fields(
        schemas["CompletionRequest"],
        CompletionRequest,
        {
            "prompt": {
                "anyOf": [
                    {"type": "string"},
                    texts,
                    ids,
                    {"type": "array", "items": ids, "minItems": 1},
                ]
            },
            "logprobs": logprobs,
            "prompt_logprobs": logprobs,
            "suffix": {"const": ""},
            "best_of": _range("integer", 1, 128),
        },
    )
    _refine_fields(
        schemas["ChatCompletionRequest"],
        ChatCompletionRequest,
        {"top_logprobs": logprobs, "max_completion_tokens": length},
    )
    schemas["ChatCompletionRequest"]["dependentSchemas"] = {
        **stream_needed,
        "top_logprobs": {  # a count of alternatives needs logprobs: true
            "anyOf": [
                {"properties": {"top_logprobs": {"type": "null"}}},
                {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
            ]
        },
    }
    message = schemas["ChatMessage"]
    message["anyOf"] = [  # only an assistant turn may leave content out (or null)
        {"properties": {"role": {"const": "assistant"}}},
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
    ]
    tokenize = schemas["TokenizeRequest"]
    tokenize["oneOf"] = [  # exactly one of prompt and messages
        {
            "required": ["prompt"],
            "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}},
        },
        {
            "required": ["messages"],
            "properties": {
                "messages": {"type": "array", "minItems": 1},
                "prompt": {"type": "null"},
            },
        },
    ]
    schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] = token
    _refine_responses(schemas, ranges, length)
    _refine_pooling(schemas, ranges, ids, texts)


def _refine_responses(schemas: dict[str, Any], ranges: dict[str, dict], length: dict) -> None:
    """``ResponsesRequest``: the sampling ranges it shares with chat, the shapes of ``input``
    items, ``tools``, ``tool_choice`` and ``text.format`` that ``serving.responses`` checks,
    and ``tool_choice`` (other than "none") only with tools."""
    schema = schemas["ResponsesRequest"]
    string = {"type": "string"}
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"enum": list(TEXT_PARTS)}, "text": string},
    }
    content = {"anyOf": [string, {"type": "array", "items": text_part}]}
    reasoning = {"required": ["type"], "properties": {"type": {"const": "reasoning"}}}
    item = {
        "type": "object",
        "anyOf": [
            {  # a message (``type`` may be left out)
                "required": ["role", "content"],
                "properties": {
                    "type": {"const": "message"},
                    "role": {"enum": list(MESSAGE_ROLES)},
                    "content": content,
                },
            },
            {
                "required": ["type", "call_id", "name", "arguments"],
                "properties": {
                    "type": {"const": "function_call"},
                    "call_id": string,
                    "name": string,
                    "arguments": string,
                },
            },
            {
                "required": ["type", "call_id", "output"],
                "properties": {
                    "type": {"const": "function_call_output"},
                    "call_id": string,
                    "output": content,
                },
            },
            reasoning,  # accepted and skipped
        ],
    }
    tool = {
        "type": "object",
        "required": ["type", "name"],
        "properties": {
            "type": {"const": "function"},
            "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
            "parameters": {"type": "object"},
        },
    }
    formats = [
        {"required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {
            "required": ["type", "schema"],
            "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}},
        },
    ]
    fields = {
        **{k: ranges[k] for k in ("temperature", "top_p", "seed", "priority", "cache_salt")},
        "max_output_tokens": {**length, "minimum": 1},
        "input": {
            "anyOf": [
                string,
                {"type": "array", "items": item, "contains": {"not": reasoning}},
            ]
        },
        "tools": {"type": "array", "items": tool, "maxItems": MAX_TOOLS},
        "tool_choice": {
            "anyOf": [
                {"enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "required": ["type", "name"],
                    "properties": {"type": {"const": "function"}, "name": string},
                },
            ]
        },
        "text": {
            "type": "object",
            "properties": {"format": {"type": "object", "anyOf": formats}},
        },
        "background": {"const": False, "description": "background responses are not served"},
    }
    _refine_fields(schema, ResponsesRequest, fields)
    for name in ResponsesRequest.model_fields:  # the rest of the optional fields: null = default
        prop = schema["properties"][name]
        if _accepts_null(ResponsesRequest, name) and "anyOf" not in prop and "type" in prop:
            keep = {k: prop.pop(k) for k in ("default", "title", "description") if k in prop}
            schema["properties"][name] = {**_nullable(prop), **keep}
    schema["dependentSchemas"] = {
        "tool_choice": {  # a tool choice other than "none" needs tools
            "anyOf": [
                {"properties": {"tool_choice": {"enum": [None, "none"]}}},
                {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
            ]
        }
    }


def _null_means_default(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """The optional fields not refined yet accept ``null`` (it means the default)."""
    for name in model.model_fields:
        prop = schema["properties"][name]
        if _accepts_null(model, name) and "anyOf" not in prop and "type" in prop:
            keep = {k: prop.pop(k) for k in ("default", "title", "description") if k in prop}
            schema["properties"][name] = {**_nullable(prop), **keep}


def _refine_pooling(
    schemas: dict[str, Any], ranges: dict[str, dict], ids: dict, texts: dict
) -> None:
    """``EmbeddingRequest`` (``/v1/embeddings``, ``/pooling``) and ``ScoreRequest``
    (``/v1/score``): the inputs' shapes and token ids, ``dimensions`` from 1, ``priority`` as
    for generation, and a ``text_1`` of several texts only with a ``text_2`` list."""
    string = {"type": "string"}
    embedding = schemas["EmbeddingRequest"]
    _refine_fields(
        embedding,
        EmbeddingRequest,
        {
            "input": {
                "anyOf": [string, texts, ids, {"type": "array", "items": ids, "minItems": 1}]
            },
            "dimensions": _range("integer", 1, INT32_MAX),
            "priority": ranges["priority"],
        },
    )
    _null_means_default(embedding, EmbeddingRequest)
    score = schemas["ScoreRequest"]
    side = {"anyOf": [string, texts]}
    _refine_fields(
        score, ScoreRequest, {"text_1": side, "text_2": side, "priority": ranges["priority"]}
    )
    _null_means_default(score, ScoreRequest)
    score["anyOf"] = [  # one text_1 against one or each; several pairwise (as many: UNEXPRESSED)
        {"properties": {"text_1": {"anyOf": [string, {"type": "array", "maxItems": 1}]}}},
        {"properties": {"text_2": {"type": "array"}}},
    ]


def _runner_serves(info: ServingInfo | str | None, path: str) -> bool:
    """The server's runner answers ``path``: a generate server does not embed (400 naming
    ``--runner pooling``), a pooling server does not generate."""
    if not isinstance(info, ServingInfo) or path not in (*GENERATION, *POOLING_KINDS):
        return True
    return (path in POOLING_KINDS) == (info.runner == "pooling")


def openapi_document(
    info: ServingInfo | str | None = None, root_path: str = "", ledger_route: bool = True
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the routes ``api_server.build_app`` serves
    (``tests/entrypoints/test_openapi_fuzz.py`` checks it names every one).

    Args:
      info: the served model's facts (its name is the ``/v1/models/{model}`` example; its
        vocabulary, ``max_model_len`` and scheduling policy bound the refined schemas); a bare
        model name, or None, documents the types only.
      root_path: the ``--root-path`` prefix, named in ``servers``.
      ledger_route: the ledger route is served (``--no-ledger-route``: left out).
    """
    _, defs = models_json_schema(
        [(model, "validation") for model in _BODIES.values()],
        ref_template="#/components/schemas/{model}",
    )
    schemas = dict(defs.get("$defs", {}))
    schemas["Error"] = _ERROR
    model_name = info if isinstance(info, str) else (info.model_name if info else "model")
    if isinstance(info, ServingInfo):
        refine(schemas, info)
    paths: dict[str, Any] = {}
    for path, model in _BODIES.items():
        body: dict[str, Any] = {"$ref": f"#/components/schemas/{model.__name__}"}
        responses = _responses("the result")
        if not _runner_serves(info, path):  # the route is there, and refuses every body
            other = "--runner pooling" if path in POOLING_KINDS else "--runner generate"
            body = {"not": {}, "description": f"this server does not serve it: {other} does"}
            responses = {k: v for k, v in responses.items() if k != "200"}
        paths[path] = {
            "post": {
                "operationId": path.strip("/").replace("/", "_"),
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": body}},
                },
                "responses": responses,
            }
        }
    for path, what in _GETS.items():
        paths[path] = {
            "get": {"operationId": path.strip("/").replace("/", "_"), "responses": _responses(what)}
        }
    paths["/v1/models/{model}"] = {
        "get": {
            "operationId": "v1_model",
            "parameters": [_path_param("model", model_name)],
            "responses": _responses("the model's card"),
        }
    }
    for (method, path), (operation, parameters, what) in _PARAMETERIZED.items():
        if path == LEDGER_PATH and not ledger_route:
            continue
        paths.setdefault(path, {})[method] = {
            "operationId": operation,
            "parameters": parameters,
            "responses": _responses(what),
        }
    description = (
        "Request bodies are JSON objects in UTF-8 (Content-Type: application/json, or none; "
        "other media types are a 415). Unknown fields are accepted, ignored and logged. "
        "Rules the schemas cannot express: " + "; ".join(UNEXPRESSED) + "."
    )
    document = {
        "openapi": "3.1.0",
        "info": {
            "title": "jaxserve OpenAI-compatible API",
            "version": version(),
            "description": description,
        },
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if root_path:
        document["servers"] = [{"url": root_path}]
    return document
