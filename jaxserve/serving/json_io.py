"""The server's JSON: strict parsing of request bodies and its one compact encoding.

``parse_json_body`` refuses what JSON allows but no model can use (NaN, Infinity, overflowing
numbers, unpaired UTF-16 surrogates) with a 400; ``dumps`` writes compact UTF-8 with no NaN, the
bytes of every response, batch record and SSE event (``JSON_ENCODER`` is the encoder it uses,
shared with the SSE encoder's per-chunk path).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from jaxserve.serving.errors import bad_request

JSON_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
"""Compact, UTF-8 (``ensure_ascii`` off), no NaN: the one configuration of every JSON we write."""


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes (UTF-8, no NaN).

    Raises:
      ValueError: ``obj`` holds NaN or infinity.
      TypeError: ``obj`` is not JSON-serialisable.
      UnicodeEncodeError: a string holds an unpaired surrogate.
    """
    return JSON_ENCODER.encode(obj).encode()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of the range of a float")
    return value


# What can smuggle an unpaired UTF-16 surrogate into a parsed string: a ``\\udXXX`` escape, a
# UTF-8-encoded surrogate (json.loads decodes with "surrogatepass"), or a UTF-16/32 body (NUL bytes).
_SURROGATE_HINT = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]|\x00")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Parses a request body; NaN, Infinity and overflowing numbers are refused (strict JSON), and
    so are unpaired UTF-16 surrogates (``"\\ud83d"`` alone), which no tokenizer can encode and no
    response can carry (RFC 8259 section 8.2 leaves them undefined).

    Raises:
      APIError: 400 for malformed JSON, an unpaired surrogate, or a body that is not an object.
    """
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_parse_float)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    if _SURROGATE_HINT.search(raw):
        try:
            dumps(body)
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start : exc.end]
            raise bad_request(
                f"the request body is not valid JSON: a string holds an unpaired UTF-16 surrogate "
                f"({bad.encode('unicode_escape').decode()}); strings must be valid Unicode"
            ) from None
    return body
