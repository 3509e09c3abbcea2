"""Compiling a constraint and admitting it: once per grammar, off the engine thread.

    future = compile_constraint_future(spec, tokenizer, "response_format")   # at once
    compiled = future.result()         # or: await asyncio.wrap_future(future); ValueError
    matcher = compiled.template.deep_copy()                    # one request's matcher

A constraint is compiled once per distinct grammar text and tokenizer (an LRU of
``MATCHER_CACHE_SIZE`` compiled templates, and of refusals), in the compile threads of
``jaxserve.structured.threads``; concurrent requests for one grammar share its compile, and each
request gets a ``deep_copy`` of the template (microseconds).

Admission checks (each a ``ValueError`` naming the request field, which the server answers with
a 400): the grammar compiles within ``PARSER_LIMITS`` (llguidance's fuel and size limits), a
Lark / GBNF grammar derives at least one finite string (``lark_check``), the first token mask
allows something (a regex such as ``[^\\s\\S]`` matches no text), and a short probe walk
(``PROBE_STEPS`` tokens along the highest allowed token id) stays within the limits and costs
at most ``MAX_MASK_CPU_S`` per mask: lexers that blow up, like ``(a{1000}){1000}``, fail there
instead of mid-generation, and grammars whose every mask is slow do not slow the steps they
share with other requests.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import statistics
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured.grammar import grammar_text, lark_text, ll_tokenizer
from jaxserve.structured.lark_check import derives_finite_string
from jaxserve.structured.threads import compiler

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

PROBE_STEPS = 8
"""Tokens of the admission probe walk (each one mask; well under a millisecond for everyday
grammars)."""


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
        lark = lark_text(spec.grammar)
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
                shared = _pending[key] = compiler.submit(_compile, spec, grammar, tokenizer)
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
            _answer(mine, error, field)

    shared.add_done_callback(relay)
    return mine


def _answer(future: concurrent.futures.Future, found: Any, field: str) -> None:
    """Resolves one caller's future (unless the caller cancelled it: its client left)."""
    try:
        if isinstance(found, str):
            future.set_exception(ValueError(f"{field}: {found}"))
        elif isinstance(found, BaseException):
            future.set_exception(found)
        else:
            future.set_result(found)
    except concurrent.futures.InvalidStateError:
        pass


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
