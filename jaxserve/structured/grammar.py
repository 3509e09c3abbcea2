"""Constraints -> llguidance grammars and matchers, checked against the model's tokenizer.

    llt = ll_tokenizer(tokenizer)                               # cached per tokenizer object
    compiled = compile_constraint(spec, tokenizer, "response_format")   # ValueError naming it
    matcher = compiled.template.deep_copy()                     # one request's matcher

A constraint is compiled once per distinct grammar text and tokenizer (an LRU of
``MATCHER_CACHE_SIZE`` compiled templates, and of refusals); each request gets a ``deep_copy``
of the template (microseconds), so ``n > 1`` and many requests with one schema (or one
refused grammar) pay the compile once, concurrent ones included.

Admission checks (each a ``ValueError`` naming the request field, which the server answers with
a 400): the grammar compiles within ``PARSER_LIMITS`` (llguidance's fuel and size limits), a
Lark / GBNF grammar derives at least one finite string (``lark_check``), the first token mask
allows something (a regex such as ``[^\\s\\S]`` matches no text), and a short probe walk
(``PROBE_STEPS`` tokens along the highest allowed token id) stays within the limits and costs
at most ``MAX_MASK_CPU_S`` per mask: lexers that blow up, like ``(a{1000}){1000}``, fail there
instead of mid-generation, and grammars whose every mask is slow do not slow the steps they
share with other requests. All of it runs where the caller runs it: in the server's request
worker thread, not on the engine thread (llguidance releases the GIL while it compiles and
computes masks), in ``COMPILE_SLOTS`` low-priority threads (``COMPILE_NICE``).

JSON numbers (``bound_numbers``): a schema's ``integer`` without bounds gets int64's
(``INT_BOUND``), a ``number`` without bounds gets ``FLOAT_BOUND`` and without ``multipleOf``
gets ``FLOAT_DECIMALS`` decimals, so a weak model cannot write digits until ``max_tokens``
(``json_object`` gets an any-JSON schema whose numbers are bounded the same way). On by default
(``--structured-outputs-bounded-numbers``); a request turns it off with
``structured_outputs.bounded_numbers: false`` or ``"x-guidance": {"bounded_numbers": false}``
at the top of its schema.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import statistics
import sys
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured.lark_check import derives_finite_string

if TYPE_CHECKING:
    from jaxserve.tokenizer import Tokenizer

MATCHER_CACHE_SIZE = 256
"""Compiled template matchers kept (distinct grammars x tokenizers)."""

PARSER_LIMITS: dict[str, Any] = {}
"""llguidance ``LLParserLimits`` overrides; none: its defaults (lexer fuel 1M at compile and
200k per mask, 2,000 Earley items per row, 50k items and 250k lexer states per mask, grammars
of 500k symbols). Lower compile fuel would refuse real tool schemas (50 tools of 8 parameters
need more than 200k)."""

MAX_MASK_CPU_S = 0.002
"""Most CPU seconds (median over the probe walk, the first mask left out) one token mask of an
admitted grammar may take; above it the constraint is refused at admission. Everyday grammars
take far less (JSON schemas, tool schemas, word regexes: 0.01-0.05 ms at 4k and 49k
vocabularies); nested counted repeats cost 0.9 / 3.5 / 9 ms (``(a{100}){100}``, 200, 300 at
4k; 3 / 12 / 31 ms at 49k) and would slow every request that shares their steps."""

COMPILE_SLOTS = max(1, (os.cpu_count() or 2) // 2)
"""Threads that compile constraints (callers wait for theirs): compiles release the GIL, so
without a bound a burst of heavy grammars takes every core from the engine."""

COMPILE_NICE = 10
"""Nice value of those threads on Linux: a compile gets the CPU the engine and its device
threads leave (CFS weight 110 against 1024), so a 0.3 s compile of 50 tool schemas does not
slow the requests being served; it only delays its own request."""

PROBE_STEPS = 8
"""Tokens of the admission probe walk (each one mask; well under a millisecond for everyday
grammars)."""

INT_BOUND = 2**63 - 1024
"""Bound put on JSON integers a schema leaves unbounded: |n| <= 2**63 - 1024, inside int64
(llguidance reads bounds as doubles, and 2**63 - 1 would round out of int64)."""

FLOAT_BOUND = 1e15
"""Bound put on JSON numbers a schema leaves unbounded: |x| <= 1e15 (no exponent)."""

FLOAT_DECIMALS = 9
"""Most decimals of a JSON number whose schema has no ``multipleOf`` (``multipleOf: 1e-9``)."""

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


_INT_REF = {"$ref": "#/$defs/jaxserve_int"}
_NUMBER_REF = {"$ref": "#/$defs/jaxserve_number"}


def _bounded_defs() -> dict[str, Any]:
    """The ``$defs`` :func:`bound_numbers` refers to: one bounded integer, one bounded number
    and any JSON value built from them (one lexeme each, however many properties use them:
    inline bounds cost ~4 ms of compile per property, 50 tools of 8 numeric parameters 1.4 s)."""
    ref = {"$ref": "#/$defs/jaxserve_any"}
    return {
        "jaxserve_int": {"type": "integer", "minimum": -INT_BOUND, "maximum": INT_BOUND},
        "jaxserve_number": {
            "type": "number",
            "minimum": -FLOAT_BOUND,
            "maximum": FLOAT_BOUND,
            "multipleOf": 10.0**-FLOAT_DECIMALS,
        },
        "jaxserve_any": {
            "anyOf": [
                {"type": "null"},
                {"type": "boolean"},
                _NUMBER_REF,
                {"type": "string"},
                {"type": "array", "items": ref},
                {"type": "object", "additionalProperties": ref},
            ]
        },
    }


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else")
_ANNOTATIONS = frozenset(("type", "title", "description", "default", "examples", "$comment"))


def _bounded(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The bounded replacement of a schema whose only constraint is its ``type`` list with
    ``integer`` / ``number`` in it (refs to the shared definitions), else None."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not set(schema) <= _ANNOTATIONS:
        return None
    if "integer" not in types and "number" not in types:
        return None
    parts: list[dict[str, Any]] = []
    for t in dict.fromkeys(types):
        if t == "integer":
            parts.append(dict(_INT_REF))
        elif t == "number":
            parts.append(dict(_NUMBER_REF))
        elif isinstance(t, str):
            parts.append({"type": t})
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def _bound_inline(schema: dict[str, Any]) -> None:
    """Adds the missing bounds to a numeric schema that has other constraints too."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    has_min = "minimum" in schema or "exclusiveMinimum" in schema
    has_max = "maximum" in schema or "exclusiveMaximum" in schema
    if "number" in types:
        bound = FLOAT_BOUND
        if "multipleOf" not in schema:
            schema["multipleOf"] = 10.0**-FLOAT_DECIMALS
    elif "integer" in types:
        bound = INT_BOUND
    else:
        return
    if not has_min:
        schema["minimum"] = -bound
    if not has_max:
        schema["maximum"] = bound


def yield_gil() -> None:
    """Lets other threads take the GIL now: a request's preprocessing loops call it every few
    dozen items, so the engine thread, which takes the GIL back many times per step, waits for
    it a fraction of a millisecond instead of the 5 ms switch interval each time."""
    time.sleep(0)


def _bound_in_place(schema: Any, depth: int = 0) -> Any:
    """``schema`` with its numbers bounded (changed in place where it can be; returns the
    schema to use in its place)."""
    if not isinstance(schema, dict) or depth > 256:
        return schema
    if depth == 2:  # each property / item / alternative of the root
        yield_gil()
    replacement = _bounded(schema)
    if replacement is not None:
        return replacement
    _bound_inline(schema)
    for key in _SUBSCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, value in sub.items():
                sub[name] = _bound_in_place(value, depth + 1)
    for key in _SUBSCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            sub[:] = [_bound_in_place(value, depth + 1) for value in sub]
    for key in _SUBSCHEMA_ONE:
        if key in schema:
            schema[key] = _bound_in_place(schema[key], depth + 1)
    return schema


def bound_numbers(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of a JSON schema whose unbounded numbers are bounded: an ``integer`` without a
    minimum / maximum gets ``-INT_BOUND`` / ``INT_BOUND``, a ``number`` ``-FLOAT_BOUND`` /
    ``FLOAT_BOUND`` and, without ``multipleOf``, ``multipleOf: 1e-FLOAT_DECIMALS``. A schema
    that is only its type becomes a ``$ref`` to one shared bounded definition (``$defs``
    ``jaxserve_int`` / ``jaxserve_number``, added at the root). Bounds the schema sets are kept.
    Free-form values (``{}``, undeclared properties) are left alone."""
    out = _bound_in_place(json.loads(json.dumps(schema)))  # a copy, at C speed
    if not isinstance(out, dict):
        return out
    defs = out.get("$defs")
    out["$defs"] = {**(defs if isinstance(defs, dict) else {}), **_bounded_defs()}
    return out


def _schema_and_bounding(spec: StructuredOutputsParams, default: bool) -> tuple[Any, bool]:
    """The JSON schema of a json / json_object constraint (our ``x-guidance`` key taken out)
    and whether its numbers are bounded."""
    bounded = default if spec.bounded_numbers is None else spec.bounded_numbers
    if spec.kind == "json_object":
        if not bounded:
            return {"type": "object"}, False
        return {
            "$defs": _bounded_defs(),
            "type": "object",
            "additionalProperties": {"$ref": "#/$defs/jaxserve_any"},
        }, True
    schema = spec.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    if isinstance(schema, dict) and isinstance(schema.get("x-guidance"), dict):
        options = dict(schema["x-guidance"])
        if "bounded_numbers" in options:
            flag = options.pop("bounded_numbers")
            if not isinstance(flag, bool):
                raise ValueError("x-guidance.bounded_numbers must be a boolean")
            if spec.bounded_numbers is None:
                bounded = flag
            schema = {**schema, "x-guidance": options}
            if not options:
                del schema["x-guidance"]
    if bounded and isinstance(schema, dict):
        schema = bound_numbers(schema)
    return schema, bounded


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
            schema, _ = _schema_and_bounding(spec, bounded_numbers)
            return _json_schema_grammar(schema)
        if kind == "regex":
            return matcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return matcher.grammar_from_regex(_choice_regex(spec.choice))
        return llg.grammar_from("grammar", spec.grammar)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None


def _lark_text(grammar: str) -> str | None:
    """Lark text of a ``grammar`` constraint (GBNF converted as llguidance converts it)."""
    try:
        from llguidance.gbnf_to_lark import any_to_lark

        return any_to_lark(grammar)
    except Exception:  # noqa: BLE001 - the compile step reports what is wrong with it
        return None


def _allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in an int32 [W] mask row."""
    return np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size])[0]


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledConstraint:
    """A constraint compiled against one tokenizer and checked at admission.

    Attributes:
      template: an ``llguidance.LLMatcher`` at the start of the output; requests take a
        ``deep_copy`` (never consume tokens on it).
      kind: the constraint kind (``StructuredOutputsParams.kind``).
    """

    template: Any
    kind: str


_lock = threading.Lock()
# (LLTokenizer id, grammar) -> the compiled constraint, or why it was refused (without the field)
_templates: OrderedDict[tuple[int, str], CompiledConstraint | str] = OrderedDict()
_pending: dict[tuple[int, str], concurrent.futures.Future] = {}  # compiles under way


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "unknown error"


@functools.lru_cache(maxsize=4)
def _vocab_and_eos(tokenizer: Tokenizer) -> tuple[int, int | None]:
    return tokenizer.vocab_size, tokenizer.eos_token_id


def _check_start(template: Any, tokenizer: Tokenizer, kind: str) -> None:
    """The admission probe: the first mask allows some text, and a short walk along the
    highest allowed token ids stays within the limits and within ``MAX_MASK_CPU_S`` per mask.

    Raises:
      ValueError: the constraint matches no text, the walk hit a limit, or its masks cost too
        much.
    """
    import llguidance.numpy as lln

    vocab, eos = _vocab_and_eos(tokenizer)
    row = np.zeros((1, (vocab + 31) // 32), np.int32)
    probe = template.deep_copy()
    costs = []
    for step in range(PROBE_STEPS + 1):
        if not probe.is_error():
            t0 = time.thread_time()
            lln.fill_next_token_bitmask(probe, row, 0)
            if step:
                costs.append(time.thread_time() - t0)
        ids = _allowed_ids(row[0], vocab)
        text_ids = ids[ids != eos] if eos is not None else ids
        if probe.is_error():
            if step == 0 and not len(text_ids):
                raise ValueError(f"the {kind} constraint matches no text")
            raise ValueError(
                f"the {kind} constraint does not compile within limits: "
                f"{_first_line(probe.get_error())}"
            )
        if not len(text_ids) or probe.is_stopped():
            break
        if not probe.consume_tokens([int(text_ids[-1])]):
            raise ValueError(
                f"the {kind} constraint does not compile within limits: "
                f"{_first_line(probe.get_error())}"
            )
    if costs and statistics.median(costs) > MAX_MASK_CPU_S:
        raise ValueError(
            f"the {kind} constraint is too costly: each token mask takes about "
            f"{1e3 * statistics.median(costs):.0f} ms of CPU, more than the limit of "
            f"{1e3 * MAX_MASK_CPU_S:.0f} ms (simplify it, e.g. nested counted repeats)"
        )


def _lower_priority() -> None:
    """Runs in each compile thread as it starts: lowers its own scheduling priority."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
        except OSError:
            pass


_compiler = concurrent.futures.ThreadPoolExecutor(
    COMPILE_SLOTS, thread_name_prefix="jaxserve-grammar", initializer=_lower_priority
)


def _compile(
    spec: StructuredOutputsParams, grammar: str, tokenizer: Tokenizer
) -> CompiledConstraint:
    """Compiles and probes one constraint (in a compile thread).

    Raises:
      ValueError: why the constraint is refused (the message does not name the field).
    """
    import llguidance

    kind = spec.kind
    if kind == "grammar":
        lark = _lark_text(spec.grammar)
        if lark is not None and derives_finite_string(lark) is False:
            raise ValueError(
                "the grammar derives no finite string (its start rule never ends, "
                'e.g. start: "a" start), so no answer could ever be complete'
            )
    limits = llguidance.LLParserLimits(**PARSER_LIMITS)
    template = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0, limits=limits)
    if template.is_error():
        error = _first_line(template.get_error())
        raise ValueError(f"the {kind} constraint does not compile: {error}")
    _check_start(template, tokenizer, kind)
    return CompiledConstraint(template, kind)


def _settle(key: tuple[int, str], done: concurrent.futures.Future) -> None:
    """When a compile ends (in its thread): keeps its template, or why it was refused (a
    repeated heavy grammar then costs nothing), and forgets it as pending."""
    error = done.exception()
    if error is not None and not isinstance(error, ValueError):
        result = None  # a bug: not kept, the next request tries again
    else:
        result = str(error) if error is not None else done.result()
    with _lock:
        _pending.pop(key, None)
        if result is not None:
            _templates[key] = result
            while len(_templates) > MATCHER_CACHE_SIZE:
                _templates.popitem(last=False)


def compile_constraint_future(
    spec: StructuredOutputsParams,
    tokenizer: Tokenizer,
    field: str = "structured_outputs",
    bounded_numbers: bool = True,
) -> concurrent.futures.Future:
    """Starts compiling ``spec`` against ``tokenizer`` with the admission checks, and returns
    at once: a future of the :class:`CompiledConstraint`, or of the ``ValueError`` that refuses
    it (message starting with ``field``). Cached per grammar and tokenizer; concurrent
    requests for one grammar share its compile. Thread-safe; the caller never waits for
    another request's compile unless it asks its future (``await asyncio.wrap_future(f)``
    does not hold a thread).

    Args:
      spec: the constraint.
      tokenizer: the model's tokenizer.
      field: the request field named in errors (``response_format``, ``tools``, ...).
      bounded_numbers: the default for JSON constraints that do not say (the engine's
        ``--structured-outputs-bounded-numbers``).

    Raises:
      ValueError: llguidance missing, no tokenizer, or the grammar text cannot be made
        (before any compile; names ``field``). The future carries the others: the constraint
        does not compile within ``PARSER_LIMITS``, derives no finite string, matches no text,
        or its masks cost more than ``MAX_MASK_CPU_S``.
    """
    if tokenizer is None:
        raise ValueError(f"{field}: structured outputs need a tokenizer, and this model has none")
    grammar = grammar_text(spec, field, bounded_numbers)
    key = (id(ll_tokenizer(tokenizer)), grammar)
    mine: concurrent.futures.Future = concurrent.futures.Future()
    started = False
    with _lock:
        found = _templates.get(key)
        if found is not None:
            _templates.move_to_end(key)
        else:
            shared = _pending.get(key)
            if shared is None:
                shared = _pending[key] = _compiler.submit(_compile, spec, grammar, tokenizer)
                started = True
    if found is not None:
        _answer(mine, found, field)
        return mine
    if started:  # outside the lock: a callback of a finished future runs here at once
        shared.add_done_callback(functools.partial(_settle, key))

    def relay(done: concurrent.futures.Future) -> None:
        error = done.exception()
        if error is None:
            _answer(mine, done.result(), field)
        elif isinstance(error, ValueError):
            _answer(mine, str(error), field)
        else:
            mine.set_exception(error)

    shared.add_done_callback(relay)
    return mine


def _answer(future: concurrent.futures.Future, found: Any, field: str) -> None:
    if isinstance(found, str):
        future.set_exception(ValueError(f"{field}: {found}"))
    else:
        future.set_result(found)


def compile_constraint(
    spec: StructuredOutputsParams,
    tokenizer: Tokenizer,
    field: str = "structured_outputs",
    bounded_numbers: bool = True,
) -> CompiledConstraint:
    """:func:`compile_constraint_future`, waited for (off the engine thread where possible).

    Raises:
      ValueError: as :func:`compile_constraint_future` and its future.
    """
    return compile_constraint_future(spec, tokenizer, field, bounded_numbers).result()


def check_structured_outputs(
    spec: StructuredOutputsParams,
    tokenizer: Tokenizer | None,
    field: str = "structured_outputs",
    bounded_numbers: bool = True,
) -> None:
    """:func:`compile_constraint` for its checks only (a bad constraint is refused up front).

    Raises:
      ValueError: as :func:`compile_constraint`.
    """
    compile_constraint(spec, tokenizer, field, bounded_numbers)
