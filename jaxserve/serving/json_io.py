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


def _parse_float(text: str) -> float | int:
    """A JSON number written with a fraction or an exponent: a float, or the integer it equals
    when its fraction is zero (JSON has one number type, and JSON Schema, which the OpenAPI
    document speaks, counts ``2.0`` as an integer: ``"n": 2.0`` is ``n`` 2)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of the range of a float")
    return int(value) if value.is_integer() else value


# What can smuggle an unpaired UTF-16 surrogate into a parsed string once the body decoded as
# UTF-8 (which refuses UTF-8-encoded surrogates): a ``\\udXXX`` escape. Searched for only when
# the body has a ``\\u`` at all (a plain byte search; a regex over a 16 MB body holds the GIL
# for ~0.4 s, which stalled every other request: #38).
_SURROGATE_HINT = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Parses a request body; bytes that are not UTF-8 (a UTF-16 body), NaN, Infinity and
    overflowing numbers are refused (strict JSON), and so are unpaired UTF-16 surrogates (``"\\ud83d"`` alone), which no tokenizer can encode and no
    response can carry (RFC 8259 section 8.2 leaves them undefined).

    Raises:
      APIError: 400 for malformed JSON, a body that is not UTF-8, an unpaired surrogate, or a
        body that is not an object.
    """
    try:
        text = raw.decode("utf-8")  # RFC 8259: JSON between systems is UTF-8 (json.loads would
    except UnicodeDecodeError as exc:  # also take UTF-16/32 bytes; the OpenAPI document says UTF-8)
        raise bad_request(
            f"the request body is not valid JSON: it must be UTF-8 text of valid Unicode (no "
            f"UTF-16, no unpaired surrogate; {exc.reason} at byte {exc.start})"
        ) from None
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_parse_float)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    if b"\\u" in raw and _SURROGATE_HINT.search(raw):
        try:
            dumps(body)
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start : exc.end]
            raise bad_request(
                f"the request body is not valid JSON: a string holds an unpaired UTF-16 surrogate "
                f"({bad.encode('unicode_escape').decode()}); strings must be valid Unicode"
            ) from None
    return body
