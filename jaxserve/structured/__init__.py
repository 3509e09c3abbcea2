"""Structured outputs: grammar matchers and the per-step token masks the sampler applies.

A request whose ``SamplingParams`` sets ``structured_outputs`` (a JSON schema, any JSON object,
a regex, a choice of strings or a grammar), ``allowed_token_ids`` or ``bad_words`` gets a row in
the step's token bitmask: bit ``t % 32`` of int32 word ``t // 32`` says whether token ``t`` may
be sampled. The engine makes one call per step, after scheduling and before the model step::

    mask = masks.step_mask(sched_out, scheduler.requests)    # StepTokenMask | None (numpy)
    runner.execute_model(sched_out, token_mask=mask)         # applied inside the jitted sampler

Everything that grows with the request is prepared before the engine thread sees it
(``prepare_token_masks``: the server calls it in its request worker thread and hands the engine
a ``TokenMaskPlan`` on ``SamplingParams.token_mask_plan``): the grammar compiled and checked
(``compile_constraint``: a 400 for one that does not compile within limits, derives no finite
string or matches nothing), the allowed ids and one-token bad words folded into one mask row,
the other bad words into an automaton. Caps on the request fields bound that work
(``jaxserve.sampling_params``: ``MAX_LOGIT_BIAS``, ``MAX_ALLOWED_TOKEN_IDS``,
``MAX_BAD_WORDS``, ``MAX_CHOICES``, ``MAX_CONSTRAINT_CHARS``).

After each step's update the engine calls ``advance``: each matcher consumes the request's new
tokens; a complete grammar ends the request with "stop" on the token that completed it (even
with ``ignore_eos``), a failed matcher with "error". ``step_mask`` then fills the next-token
masks (llguidance's thread pool on larger machines). The sampler sets disallowed logits to -inf
before temperature / top-k / top-p, so every sampled token is allowed.

Grammar engine: llguidance (``pip install jaxserve[structured]``). It ships abi3 wheels that
install on Python 3.12 without torch (xgrammar's Python package depends on torch, which a JAX
server should not pull in), compiles a JSON schema lazily in well under a millisecond, supports
JSON schema, regex, Lark and GBNF grammars behind one matcher type, computes masks from a
token trie with a parallel executor, and is what vLLM and SGLang use as their "guidance"
backend. Module map:

* :mod:`jaxserve.structured.grammar` — our tokenizer as an ``LLTokenizer``, the grammar text
  of a constraint.
* :mod:`jaxserve.structured.json_numbers` — JSON numbers a schema leaves unbounded, bounded.
* :mod:`jaxserve.structured.admission` — compiles once per grammar, admission checks
  (``ValueError`` naming the request field), cached compiled templates (and refusals).
* :mod:`jaxserve.structured.threads` — how preprocessing shares the CPU and the GIL with the
  engine thread (compile threads at low priority, ``yield_gil``).
* :mod:`jaxserve.structured.lark_check` — does a Lark grammar derive any finite string.
* :mod:`jaxserve.structured.bad_words` — the bad-words automaton.
* :mod:`jaxserve.structured.plan` — :class:`TokenMaskPlan` and ``prepare_token_masks``.
* :mod:`jaxserve.structured.manager` — :class:`TokenMaskManager`: per-request state, the
  grammar's end of a request, and the per-step :class:`StepTokenMask`.
"""

from jaxserve.structured.admission import (
    check_structured_outputs,
    compile_constraint,
    compile_constraint_future,
)
from jaxserve.structured.grammar import llguidance_available
from jaxserve.structured.manager import StepTokenMask, TokenMaskManager
from jaxserve.structured.plan import TokenMaskPlan, prepare_token_masks

__all__ = [
    "StepTokenMask",
    "TokenMaskManager",
    "TokenMaskPlan",
    "check_structured_outputs",
    "compile_constraint",
    "compile_constraint_future",
    "llguidance_available",
    "prepare_token_masks",
]
