"""A request's token-mask preprocessing, done once and off the engine thread.

    plan = prepare_token_masks(params, tokenizer, wait=False)   # the server's worker thread
    params.token_mask_plan = plan
    await plan.ready()            # AsyncLLM.add_request: the compile ends in its own thread;
                                  # ValueError naming the field if it is refused

Everything in a ``TokenMaskPlan`` grows with the request (the grammar, the allowed ids, the bad
words) and is made here, in time linear in it: the grammar compiled and checked
(``grammar.compile_constraint``), ``allowed_token_ids`` and one-token bad words folded into one
int32 mask row, multi-token bad words tokenized (each with and without a leading space, as
vLLM does) into a :class:`~jaxserve.structured.bad_words.BadWords` automaton. The engine thread
then only copies the template matcher per request (``TokenMaskManager.add_request``) and, per
step, ANDs the fixed row and clears the automaton node's banned ids. A plan is immutable and
shared by a request's ``n`` samples.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.structured.admission import CompiledConstraint, compile_constraint_future
from jaxserve.structured.bad_words import BadWords
from jaxserve.structured.threads import yield_gil

if TYPE_CHECKING:
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.tokenizer import Tokenizer


def _no_plan() -> None:
    """What an unpickled plan becomes (the receiving process prepares its own)."""
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class TokenMaskPlan:
    """The token-mask preprocessing of one request's SamplingParams.

    Attributes:
      tokenizer: the tokenizer it was made with (a manager with another one prepares anew).
      num_words: W = ceil(vocab_size / 32), the width of mask rows.
      constraint: the future of the compiled grammar (structured outputs; resolves to a
        ``CompiledConstraint`` or raises the ValueError that refuses it), or None.
      fixed_row: int32 [W], the tokens ``allowed_token_ids`` allows minus the one-token bad
        words (bit ``t % 32`` of word ``t // 32``); None when it allows every token.
      bad_words: the automaton of the multi-token bad words, or None.
      checks: futures of other compiles the request must pass (a chat's tool schemas).
    """

    tokenizer: Any
    num_words: int
    constraint: concurrent.futures.Future | None
    fixed_row: np.ndarray | None
    bad_words: BadWords | None
    checks: tuple[concurrent.futures.Future, ...] = ()

    def __reduce__(self) -> tuple:
        return (_no_plan, ())

    async def ready(self) -> None:
        """Waits, without holding a thread, until the plan's compiles are done.

        Raises:
          ValueError: a compile refused its constraint (names the field).
        """
        for future in (self.constraint, *self.checks):
            if future is not None:
                await asyncio.wrap_future(future)

    def compiled(self) -> CompiledConstraint | None:
        """The compiled grammar, waited for if it is not done yet (the engine thread gets
        plans whose compile ``ready`` already awaited).

        Raises:
          ValueError: the constraint is refused (names the field).
        """
        return None if self.constraint is None else self.constraint.result()


def _bits(token_ids: Any, words: int) -> np.ndarray:
    """int32 [words] with the bits of ``token_ids`` set (ids past the width are dropped)."""
    ids = np.asarray(token_ids, np.int64).reshape(-1)
    flat = np.zeros(words * 32, np.bool_)
    flat[ids[(ids >= 0) & (ids < words * 32)]] = True
    return np.packbits(flat, bitorder="little").view(np.int32)


def bad_word_token_ids(words: list[str], tokenizer: Tokenizer) -> list[tuple[int, ...]]:
    """The distinct token sequences of ``words``, each tokenized as generated text would be,
    without and with a leading space (vLLM's rule). Linear in the words' length (one
    encode of ``"\\n" + text`` each, the newline's ids cut off)."""
    newline = tokenizer.encode("\n", add_special_tokens=False)
    cut = len(newline)
    seen: dict[tuple[int, ...], None] = {}
    for i, word in enumerate(words):
        if i % 32 == 31:
            yield_gil()
        for text in (word, " " + word):
            ids = tokenizer.encode("\n" + text, add_special_tokens=False)
            if ids[:cut] == newline:
                ids = ids[cut:]
            else:  # the newline merged into the text's first token: no clean cut
                ids = tokenizer.encode(text, add_special_tokens=False)
            if ids:
                seen[tuple(ids)] = None
    return list(seen)


def prepare_token_masks(
    params: SamplingParams,
    tokenizer: Tokenizer | None,
    *,
    bounded_numbers: bool = True,
    field: str = "structured_outputs",
    vocab_size: int = 0,
    wait: bool = True,
    checks: Sequence[concurrent.futures.Future] = (),
) -> TokenMaskPlan | None:
    """The TokenMaskPlan of ``params`` (None when it needs no token mask). Thread-safe; meant
    for a worker thread.

    Args:
      params: validated SamplingParams (their caps bound the work here).
      tokenizer: the model's tokenizer; needed for grammars and bad words.
      bounded_numbers: the engine's default for JSON numbers (see ``grammar.bound_numbers``).
      field: the request field that carries the constraint, for error messages.
      vocab_size: the mask width's vocabulary when there is no tokenizer (the model's).
      wait: wait for the grammar's compile (and ``checks``) here; False returns at once, and
        ``TokenMaskPlan.ready`` awaits them (a refused constraint then raises there).
      checks: futures of other compiles the request must pass (kept on the plan; a plan is
        made for them even when ``params`` need no mask).

    Raises:
      ValueError: no tokenizer where one is needed, or the constraint is refused at admission
        (``grammar.compile_constraint_future``; with ``wait``); the message starts with the
        field.
    """
    if not params.needs_token_mask and not checks:
        return None
    if tokenizer is None and (params.structured_outputs is not None or params.bad_words):
        name = "bad_words" if params.structured_outputs is None else field
        raise ValueError(f"{name}: needs a tokenizer, and this model has none")
    vocab = tokenizer.vocab_size if tokenizer is not None else vocab_size
    words = (vocab + 31) // 32
    constraint = None
    if params.structured_outputs is not None:
        constraint = compile_constraint_future(
            params.structured_outputs, tokenizer, field, bounded_numbers=bounded_numbers
        )
    fixed = None
    if params.allowed_token_ids is not None:
        fixed = _bits(params.allowed_token_ids, words)
    automaton = None
    if params.bad_words:
        sequences = bad_word_token_ids(params.bad_words, tokenizer)
        single = [s[0] for s in sequences if len(s) == 1]
        if single:
            fixed = np.full(words, -1, np.int32) if fixed is None else fixed
            fixed = fixed & ~_bits(single, words)
        if any(len(s) > 1 for s in sequences):
            automaton = BadWords(s for s in sequences if len(s) > 1)
    plan = TokenMaskPlan(tokenizer, words, constraint, fixed, automaton, tuple(checks))
    if wait:
        plan.compiled()
        for future in plan.checks:
            future.result()
    return plan
