"""Server-sent-event encoding of the server's streamed responses, cheap on the per-token path.

``jaxserve.serving.json_io.dumps`` is the server's one JSON encoding (compact, UTF-8, no NaN).
A streamed response sends one ``data: {chunk}\\n\\n`` event per chunk, and at rate inf that is
one event per token per stream, so :class:`SSEEncoder` makes the same bytes with less Python
work than ``dumps``: the header fields every chunk of a response repeats (``id``, ``object``,
``created``, ``model``, ...) are encoded once, and a choice holding only strings, ints, None and
dicts of those (every per-token choice) is written directly instead of through
``json.JSONEncoder``. The output is byte-identical to ``b"data: " + dumps(chunk) + b"\\n\\n"``.
"""

from __future__ import annotations

import json
from typing import Any

from jaxserve.serving.json_io import JSON_ENCODER, dumps

_encode_str = json.encoder.encode_basestring  # what JSON_ENCODER uses for strings (no ASCII)

DONE_EVENT = b"data: [DONE]\n\n"
"""The event that ends an OpenAI stream."""


def _flat_json(obj: dict) -> str | None:
    """``obj`` as ``dumps`` would write it, when it holds only str keys and str / int / None /
    dict-of-the-same values; None otherwise (the caller falls back to the encoder)."""
    parts = []
    for key, value in obj.items():
        if type(key) is not str:
            return None
        kind = type(value)
        if kind is str:
            text = _encode_str(value)
        elif value is None:
            text = "null"
        elif kind is int:
            text = int.__repr__(value)
        elif kind is dict:
            text = _flat_json(value)
            if text is None:
                return None
        else:
            return None
        parts.append(_encode_str(key) + ":" + text)
    return "{" + ",".join(parts) + "}"


_IMMUTABLE = (str, int, float, bool, type(None))


def _same_head(head: list[tuple[str, Any]], cached: list[tuple[str, Any]] | None) -> bool:
    """True when ``head`` holds the very same keys and immutable values, in the same order, as
    the header encoded last (identity, not equality: ``1 == True`` but they encode apart)."""
    if cached is None or len(head) != len(cached):
        return False
    for (key, value), (old_key, old_value) in zip(head, cached):
        if key is not old_key or value is not old_value or type(value) not in _IMMUTABLE:
            return False
    return True


class SSEEncoder:
    """Encodes one response's chunks as SSE events (see the module docstring).

    Use one encoder per response: it keeps the last header it saw (every key but ``choices``)
    and its encoding, and re-encodes the header when a chunk's differs (the final usage chunk)
    or holds a mutable value.
    """

    def __init__(self) -> None:
        self._head: list[tuple[str, Any]] | None = None  # in order: key order is output
        self._prefix = b""

    def event(self, chunk: dict[str, Any]) -> bytes:
        """``b"data: " + dumps(chunk) + b"\\n\\n"``, with the same errors."""
        choices = chunk.get("choices")
        if type(choices) is not list or next(reversed(chunk)) != "choices":
            return b"data: " + dumps(chunk) + b"\n\n"
        head = [item for item in chunk.items() if item[0] != "choices"]
        if not _same_head(head, self._head):
            self._head = head
            self._prefix = (
                b"data: " + dumps(dict(head))[:-1] + b',"choices":'
                if head
                else b'data: {"choices":'
            )
        parts = []
        for choice in choices:
            text = _flat_json(choice) if type(choice) is dict else None
            parts.append(JSON_ENCODER.encode(choice) if text is None else text)
        return self._prefix + ("[" + ",".join(parts) + "]}").encode() + b"\n\n"
