"""Structured outputs: grammar matchers and the per-step token masks the sampler applies.

A request whose ``SamplingParams`` sets ``structured_outputs`` (a JSON schema, any JSON object,
a regex, a choice of strings or a grammar), ``allowed_token_ids`` or ``bad_words`` gets a row in
the step's token bitmask: bit ``t % 32`` of int32 word ``t // 32`` says whether token ``t`` may
be sampled. The engine makes one call per step, after scheduling and before the model step::

    mask = masks.step_mask(sched_out, scheduler.requests)    # StepTokenMask | None (numpy)
    runner.execute_model(sched_out, token_mask=mask)         # applied inside the jitted sampler

``step_mask`` first advances each constrained request's matcher over the tokens it sampled
since the last step (its ``output_token_ids``, so preemption and recompute need nothing
special), then fills the next-token masks of all of them at once (llguidance's thread pool).
The sampler sets disallowed logits to -inf before temperature / top-k / top-p, so every sampled
token is allowed; when the grammar is complete only EOS is allowed and the sample ends with
``stop``. With async scheduling (planned) this one call is what moves off the critical path.

Grammar engine: llguidance (``pip install jaxserve[structured]``). It ships abi3 wheels that
install on Python 3.12 without torch (xgrammar's Python package depends on torch, which a JAX
server should not pull in), compiles a JSON schema lazily in well under a millisecond, supports
JSON schema, regex, Lark and GBNF grammars behind one matcher type, computes masks from a
token trie with a parallel executor, and is what vLLM and SGLang use as their "guidance"
backend. Module map:

* :mod:`jaxserve.structured.grammar` — our tokenizer as an ``LLTokenizer``, grammar text of a
  constraint, compile checks (``ValueError`` naming the request field), cached matchers.
* :mod:`jaxserve.structured.manager` — :class:`TokenMaskManager`: per-request state and the
  per-step :class:`StepTokenMask`.
"""

from jaxserve.structured.grammar import check_structured_outputs, llguidance_available
from jaxserve.structured.manager import StepTokenMask, TokenMaskManager

__all__ = [
    "StepTokenMask",
    "TokenMaskManager",
    "check_structured_outputs",
    "llguidance_available",
]
