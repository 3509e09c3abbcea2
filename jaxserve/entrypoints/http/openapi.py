"""``GET /openapi.json``: the server's OpenAPI 3.1 document, generated from the request models.

The request bodies' schemas come from the pydantic models in ``protocol`` (one source of truth:
the same models validate the requests), so a fuzzer driven by this document (schemathesis in
``tests/entrypoints/test_openapi_fuzz.py``) sends what the server claims to accept, and
mutations of it. Responses are described by status only, plus OpenAI's error object for 4xx/5xx.
Every route ``build_app`` adds is here (a test compares the two).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from jaxserve.serving.endpoints import GENERATION, version
from jaxserve.serving.protocol import DetokenizeRequest, TokenizeRequest

_BODIES: dict[str, type[BaseModel]] = {
    **{path: endpoint.request_model for path, endpoint in GENERATION.items()},
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
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


# Routes with path or query parameters: (method, path) -> (operationId, parameters, what)
_PARAMETERIZED: dict[tuple[str, str], tuple[str, list[dict[str, Any]], str]] = {
    ("get", "/v1/requests/{request_id}/ledger"): (
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


def openapi_document(model_name: str = "model", root_path: str = "") -> dict[str, Any]:
    """The OpenAPI 3.1 document of the routes ``api_server.build_app`` serves
    (``tests/entrypoints/test_openapi_fuzz.py`` checks it names every one).

    Args:
      model_name: the served model's name (the ``/v1/models/{model}`` example).
      root_path: the ``--root-path`` prefix, named in ``servers``.
    """
    _, defs = models_json_schema(
        [(model, "validation") for model in _BODIES.values()],
        ref_template="#/components/schemas/{model}",
    )
    schemas = dict(defs.get("$defs", {}))
    schemas["Error"] = _ERROR
    paths: dict[str, Any] = {}
    for path, model in _BODIES.items():
        paths[path] = {
            "post": {
                "operationId": path.strip("/").replace("/", "_"),
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}
                        }
                    },
                },
                "responses": _responses("the result"),
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
        paths.setdefault(path, {})[method] = {
            "operationId": operation,
            "parameters": parameters,
            "responses": _responses(what),
        }
    document = {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve OpenAI-compatible API", "version": version()},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if root_path:
        document["servers"] = [{"url": root_path}]
    return document
