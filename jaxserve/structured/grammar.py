"""Constraints -> llguidance grammar text, against the model's tokenizer.

    llt = ll_tokenizer(tokenizer)                        # cached per tokenizer object
    grammar = grammar_text(spec, "response_format")      # ValueError naming the field

The tokenizer bridge (each token's bytes, EOS; text tokenized as a continuation) and the
grammar of each constraint kind: JSON schemas with their numbers bounded
(``jaxserve.structured.json_numbers``) and ``JSON_OPTIONS``' layout, regexes, choices as one
escaped alternation, Lark and GBNF grammars. Compiling and admitting a constraint is
``jaxserve.structured.admission``.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured.json_numbers import schema_and_bounding

if TYPE_CHECKING:
    from jaxserve.tokenizer import Tokenizer

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


_REGEX_ESCAPES = str.maketrans({c: "\\" + c for c in "\\.+*?()|[]{}^$#&-~"})
"""Backslash before each character the Rust ``regex`` syntax reads as an operator."""


def _choice_regex(choices: tuple[str, ...]) -> str:
    """A regex (Rust ``regex`` syntax) that matches exactly one of ``choices``: escaped in
    one ``translate`` over the joined text (per choice it took 48 ms for 16k choices, held
    the GIL throughout, and stalled the engine thread)."""
    joined = "\x00".join(choices)
    if joined.count("\x00") != len(choices) - 1:  # a choice holds NUL itself
        return "|".join(c.translate(_REGEX_ESCAPES) for c in choices)
    return joined.translate(_REGEX_ESCAPES).replace("\x00", "|")


def _json_schema_grammar(schema: Any) -> str:
    """What ``LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)`` returns (the
    schema's own ``x-guidance`` options over ours), made with ``json.dumps``: 3 ms for 128 tool
    schemas where that call took 18-38 ms holding the GIL, stalling the engine thread."""
    if isinstance(schema, dict):
        options = schema.get("x-guidance")
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **(options or {})}}
    grammar = {"name": "json_schema", "json_schema": schema, "lark_grammar": None}
    return json.dumps({"grammars": [grammar], "max_tokens": None}, separators=(",", ":"))


def grammar_text(spec: StructuredOutputsParams, field: str, bounded_numbers: bool = True) -> str:
    """The llguidance grammar (its JSON text) of a constraint.

    ``choice`` compiles to one regex alternation (a single lexeme: 16k entries compile in
    ~0.1 s, where a Lark rule of alternatives exceeds llguidance's 2,000 Earley items per row
    at about 2,000 entries). ``bounded_numbers`` is the default for JSON constraints that do
    not say (see :func:`bound_numbers`).

    Raises:
      ValueError: the JSON schema is not JSON, or a GBNF grammar does not convert (names
        ``field``).
    """
    llg = _require_llguidance(field)
    matcher = llg.LLMatcher
    kind = spec.kind
    try:
        if kind in ("json_object", "json"):
            schema, _ = schema_and_bounding(spec, bounded_numbers)
            return _json_schema_grammar(schema)
        if kind == "regex":
            return matcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return matcher.grammar_from_regex(_choice_regex(spec.choice))
        return llg.grammar_from("grammar", spec.grammar)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None


def lark_text(grammar: str) -> str | None:
    """Lark text of a ``grammar`` constraint (GBNF converted as llguidance converts it)."""
    try:
        from llguidance.gbnf_to_lark import any_to_lark

        return any_to_lark(grammar)
    except Exception:  # noqa: BLE001 - the compile step reports what is wrong with it
        return None
