"""``GET /openapi.json``: the server's OpenAPI 3.1 document, generated from the request models.

The request bodies' schemas come from the pydantic models in ``protocol`` (one source of truth:
the same models validate the requests), so a fuzzer driven by this document (schemathesis in
``tests/entrypoints/test_openapi_fuzz.py``) sends what the server claims to accept, and
mutations of it. Responses are described by status only, plus OpenAI's error object for 4xx/5xx.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from jaxserve.serving.endpoints import GENERATION, version
from jaxserve.serving.pooling import POOLING_KINDS, REQUEST_MODELS
from jaxserve.serving.protocol import DetokenizeRequest, TokenizeRequest

_BODIES: dict[str, type[BaseModel]] = {
    **{path: endpoint.request_model for path, endpoint in GENERATION.items()},
    **{path: REQUEST_MODELS[kind] for path, kind in POOLING_KINDS.items()},
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
_GETS = {
    "/v1/models": "the served model (OpenAI's list-models shape)",
    "/health": "200 while the engine serves, 503 when it is dead or the server is draining",
    "/version": "the jaxserve version",
    "/metrics": "Prometheus text exposition",
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


def openapi_document(model_name: str = "model") -> dict[str, Any]:
    """The OpenAPI 3.1 document of the routes ``api_server.build_app`` serves.

    Args:
      model_name: the served model's name (the ``/v1/models/{model}`` example).
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
            "parameters": [
                {
                    "name": "model",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string"},
                    "example": model_name,
                }
            ],
            "responses": _responses("the model's card"),
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve OpenAI-compatible API", "version": version()},
        "paths": paths,
        "components": {"schemas": schemas},
    }
