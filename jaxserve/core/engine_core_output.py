"""What the scheduler hands the engine after each step (vLLM V1's ``v1/engine/__init__.py``):
each request's news, as an ``EngineCoreOutput``, or one ``DecodeTokens`` for a steady-decode
step. (The scheduler's figures, ``SchedulerStats``, come from ``jaxserve/stats_schema.py``.)

Plain dataclasses; no jax. The engine's output processor turns the news into the user-facing
``RequestOutput`` (``jaxserve/request_output.py``).
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.runner_output import TokenLogprobs


@dataclasses.dataclass(slots=True)
class EngineCoreOutput:
    """One request's news from one step, for the engine (detokenizer, streams, metrics).

    Attributes:
      req_id: the request id.
      new_token_ids: tokens appended this step (usually 0 or 1). A stop token id or EOS that
        ended the request is included (the detokenizer hides special tokens). Read-only: it
        may be the runner's list from ``ModelRunnerOutput.sampled_token_ids``.
      finish_reason: None while running; "stop", "length", "abort" or "error" when finished.
      stop_reason: the ``stop_token_ids`` entry (int) that ended it; None when EOS ended it
        (unless ``ignore_eos``) or for any other finish, as vLLM reports it (stop *strings* are
        found by the engine's detokenizer, which then calls ``Scheduler.finish_requests``).
      new_logprobs: TokenLogprobs parallel to new_token_ids, when the request asked for
        logprobs; else None.
      new_prompt_logprobs: prompt positions scored this step (see ModelRunnerOutput), else None.
      num_cached_tokens: prompt tokens served from the prefix cache at first admission
        (``usage.prompt_tokens_details.cached_tokens``).
    """

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        """True when this step ended the request (``finish_reason`` is set)."""
        return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class DecodeTokens:
    """One steady-decode step's news for the engine, in one object instead of an
    EngineCoreOutput per request (``Scheduler.update_from_output(..., batched=True)``): each
    request appended exactly one token, which ended nothing, without logprobs.

    Attributes:
      req_ids: ``[n]`` the request ids (read-only: the same list object on every step of one
        steady run, so consumers may key per-request caches on its identity).
      token_ids: ``[n]`` the token each appended, in the same order.
    """

    req_ids: list[str]
    token_ids: list[int]
