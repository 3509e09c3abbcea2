"""Constraints -> llguidance grammars and matchers, checked against the model's tokenizer.

    llt = ll_tokenizer(tokenizer)                         # cached per tokenizer object
    check_structured_outputs(spec, tokenizer, "response_format")   # ValueError naming the field
    matcher = new_matcher(spec, tokenizer)                # a fresh LLMatcher (copy of a cached one)

A constraint is compiled once per distinct grammar text and tokenizer (an LRU of
``MATCHER_CACHE_SIZE`` template matchers); each request gets a ``deep_copy`` of the template
(microseconds), so ``n > 1`` and many requests with one schema pay the compile once.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from jaxserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from jaxserve.tokenizer import Tokenizer

MATCHER_CACHE_SIZE = 256
"""Compiled template matchers kept (distinct grammars x tokenizers)."""

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON layout the grammar enforces: ``json.dumps``'s default separators, no other whitespace
(a schema's own ``x-guidance`` options override it). Free whitespace lets a weak model pad
the output with newlines instead of finishing it."""


def llguidance_available() -> bool:
    """True when the optional ``llguidance`` package is installed."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _require_llguidance(field: str):
    try:
        import llguidance
    except ImportError:
        raise ValueError(
            f"{field}: structured outputs need the llguidance package "
            "(pip install 'jaxserve[structured]')"
        ) from None
    return llguidance


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet: each byte is shown as one printable character
    (printable Latin-1 bytes as themselves, the others shifted to U+0100 onwards)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """The UTF-8 bytes each token id stands for inside generated text, ``[vocab_size]``.

    Sentencepiece-style pieces map "▁" to a space and ``<0xXX>`` to that byte; byte-level BPE
    pieces ("Ġthe") go through the GPT-2 byte alphabet. Special tokens are empty (a grammar
    never produces them; EOS is allowed separately when the grammar is complete).
    """
    pieces = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
    byte_level = sum("Ġ" in p for p in pieces) > len(pieces) // 100
    decoder = _byte_level_decoder()
    special = tokenizer.special_id_set
    out = []
    for i, piece in enumerate(pieces):
        if i in special:
            out.append(b"")
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        elif byte_level and all(c in decoder for c in piece):
            out.append(bytes(decoder[c] for c in piece))
        else:
            out.append(piece.replace("▁", " ").encode("utf-8"))
    return out


def continuation_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as it would be generated after other text: without the
    sentencepiece dummy-prefix space that ``encode`` adds at the start of a text."""
    prefix = tokenizer.encode("\n", add_special_tokens=False)
    ids = tokenizer.encode("\n" + text, add_special_tokens=False)
    if ids[: len(prefix)] == prefix:
        return ids[len(prefix) :]
    return tokenizer.encode(text, add_special_tokens=False)


class _TokenizerShim:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, EOS/BOS, and a tokenize call that
    tokenizes text as a continuation (no sentencepiece dummy-prefix space)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self.tokens = token_bytes(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_id_set)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return continuation_ids(self._tok, text)


@functools.lru_cache(maxsize=4)
def ll_tokenizer(tokenizer: Tokenizer) -> Any:
    """The ``llguidance.LLTokenizer`` of ``tokenizer`` (built once per tokenizer object, ~50 ms
    for a 4k vocabulary).

    Raises:
      ValueError: llguidance is not installed, or the tokenizer has no EOS token.
    """
    llg = _require_llguidance("structured_outputs")
    if tokenizer.eos_token_id is None:
        raise ValueError("structured_outputs: the tokenizer has no EOS token to end a grammar")
    return llg.LLTokenizer(llg.TokenizerWrapper(_TokenizerShim(tokenizer)))


def grammar_text(spec: StructuredOutputsParams, field: str) -> str:
    """The llguidance grammar (its JSON text) of a constraint.

    Raises:
      ValueError: the JSON schema is not JSON, or a GBNF grammar does not convert (names
        ``field``).
    """
    llg = _require_llguidance(field)
    matcher = llg.LLMatcher
    kind = spec.kind
    try:
        if kind == "json_object":
            return matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if kind == "json":
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "regex":
            return matcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return matcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in spec.choice)
            )
        return llg.grammar_from("grammar", spec.grammar)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None


_lock = threading.Lock()
_templates: OrderedDict[tuple[int, str], Any] = OrderedDict()


def _template(spec: StructuredOutputsParams, tokenizer: Tokenizer, field: str) -> Any:
    grammar = grammar_text(spec, field)
    llt = ll_tokenizer(tokenizer)
    key = (id(llt), grammar)
    with _lock:
        found = _templates.get(key)
        if found is not None:
            _templates.move_to_end(key)
            return found
    import llguidance

    template = llguidance.LLMatcher(llt, grammar, log_level=0)
    if template.is_error():
        error = template.get_error().splitlines()[0]
        raise ValueError(f"{field}: the {spec.kind} constraint does not compile: {error}")
    with _lock:
        _templates[key] = template
        while len(_templates) > MATCHER_CACHE_SIZE:
            _templates.popitem(last=False)
    return template


def check_structured_outputs(
    spec: StructuredOutputsParams, tokenizer: Tokenizer | None, field: str = "structured_outputs"
) -> None:
    """Compiles ``spec`` against ``tokenizer`` (cached), so a bad one is refused up front.

    Raises:
      ValueError: llguidance missing, no tokenizer, or the constraint does not compile; the
        message starts with ``field`` (e.g. ``response_format``).
    """
    if tokenizer is None:
        raise ValueError(f"{field}: structured outputs need a tokenizer, and this model has none")
    _template(spec, tokenizer, field)


def new_matcher(spec: StructuredOutputsParams, tokenizer: Tokenizer) -> Any:
    """A fresh ``llguidance.LLMatcher`` for one request (a copy of the cached template).

    Raises:
      ValueError: as :func:`check_structured_outputs`.
    """
    return _template(spec, tokenizer, "structured_outputs").deep_copy()
