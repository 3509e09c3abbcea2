"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Source: the OpenAI API reference ("Error codes") and the bodies its servers send, e.g. a 404
``{"error": {"message": "The model `x` does not exist ...", "type": "invalid_request_error",
"param": null, "code": "model_not_found"}}``. Every user mistake becomes an :class:`APIError` with
a 4xx status; only faults of the server itself become a 500 (see ``api_server``'s middleware).
"""

from __future__ import annotations

import re
from typing import Any

import pydantic

_FIELD_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*)\b")


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """The JSON body of an OpenAI error response."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    """A request the server answers with an OpenAI-style error instead of a result.

    Args:
      message: human-readable reason; names the offending field and, for lengths, the numbers.
      status: HTTP status (400 bad input, 401 bad key, 404 unknown model, 503 overloaded or the
        engine is down, 500 internal).
      type: OpenAI's error ``type`` ("invalid_request_error", "authentication_error",
        "server_error").
      param: the request field at fault, or None.
      code: OpenAI's machine-readable ``code`` ("model_not_found", "invalid_api_key", ...).
      headers: extra HTTP headers (``Retry-After`` for 503).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The response body, ``{"error": {...}}``."""
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(message, status=400, param=param, code=code)


def model_not_found(name: str) -> APIError:
    """The 404 OpenAI sends for a model it does not serve."""
    return APIError(
        f"The model `{name}` does not exist.", status=404, param="model", code="model_not_found"
    )


def from_value_error(exc: ValueError) -> APIError:
    """A 400 from a ``ValueError`` raised by validation (SamplingParams, prompt checks).

    By the house convention the message starts with the field's name, which becomes ``param``.
    """
    message = str(exc) or "invalid request"
    match = _FIELD_RE.match(message)
    param = match.group(1) if match and match.group(1).islower() else None
    return bad_request(message, param=param)


def from_validation_error(exc: pydantic.ValidationError) -> APIError:
    """A 400 from a pydantic validation error: the first problem, with its field path as ``param``.

    Messages read ``"max_tokens: Input should be a valid integer (got str '10')"``.
    """
    errors = exc.errors(include_url=False)
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ())]
    param = ".".join(loc) or None
    got = first.get("input")
    detail = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        message = f"{param}: field required"
    elif first.get("type") == "value_error" and "error" in first.get("ctx", {}):
        # Our own validators' messages already name the field.
        message = str(first["ctx"]["error"])
        if param and not message.startswith(loc[-1]):
            message = f"{param}: {message}"
    else:
        shown = repr(got)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        message = f"{param}: {detail} (got {type(got).__name__} {shown})" if param else detail
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return bad_request(message, param=param)
