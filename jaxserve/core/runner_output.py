"""What the runner hands the scheduler after a step (vLLM V1's ``v1/outputs.py``); the other
direction is ``sched_output``, and what the scheduler then hands the engine is
``engine_core_output``.

Plain dataclasses of ints, floats, lists and dicts; no jax. The runner brings to the host once
per step only the sampled token ids (and logprobs when a request asked for them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass
class TokenLogprobs:
    """Log-probabilities at one position (OpenAI ``logprobs`` / ``top_logprobs``).

    Attributes:
      token_ids: ``[1 + k]`` the chosen token (sampled, or the actual prompt token) first, then
        the top-k alternatives in descending probability (k = the request's ``logprobs`` or
        ``prompt_logprobs``; the chosen token may appear again among them).
      logprobs: ``[1 + k]`` natural-log probabilities of those tokens, float, from the
        distribution after logit_bias and penalties, before temperature/top-k/top-p (vLLM's
        "raw logprobs" of the processed logits).
      rank: 1-based rank of the chosen token in that distribution (1 = most probable).
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class OneTokenEach(Sequence):
    """``[[t] for t in tokens]``, each inner list made when read: ``sampled_token_ids`` of a step
    in which every request sampled one token, without 256 lists a step nobody reads (the
    scheduler's steady-decode update reads ``sampled_flat``). Read-only; equal to any sequence
    with the same items.
    """

    __slots__ = ("tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [[t] for t in self.tokens[i]]
        return [self.tokens[i]]

    def __iter__(self):
        return ([t] for t in self.tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))


@dataclasses.dataclass
class ModelRunnerOutput:
    """The runner's result for one step.

    Attributes:
      req_ids: ids of the requests that ran this step (the keys of
        ``SchedulerOutput.num_scheduled_tokens``, in the runner's batch order).
      req_id_to_index: req_id -> index into the per-request lists below.
      sampled_token_ids: per request, the tokens sampled this step: ``[t]`` when the request
        reached the end of its known tokens, ``[]`` when the step only advanced a prompt chunk;
        with draft tokens, the drafts the sampler agreed with and then its own token (1 to k + 1).
        The scheduler may pass these lists on as ``EngineCoreOutput.new_token_ids``: build
        fresh ones each step and do not mutate them afterwards.
      logprobs: None when no request in the step asked for logprobs; otherwise per request a
        list parallel to ``sampled_token_ids[i]`` (empty for requests that did not ask).
      prompt_logprobs_dict: req_id -> TokenLogprobs of the prompt tokens this step scored, in
        position order, for requests with ``prompt_logprobs`` set. A step computing positions
        ``[s, e)`` scores the prompt tokens at positions ``s+1 .. min(e, prompt_len - 1)`` (a
        token's logprob comes from the logits of the position before it; position 0 has none
        and the engine reports None there).
      sampled_flat: when every request of the step sampled exactly one token, those tokens in
        ``req_ids`` order (``sampled_token_ids[i] == [sampled_flat[i]]``); else None.
      draft_token_ids: speculative decoding (``SchedulerOutput.speculate``): req_id -> the
        proposer's draft tokens for the request's next step, which follow the tokens this step
        sampled for it (possibly empty); None when the step proposed nothing.
      pooler_output: pooling runner: req_id -> the pooled vector (numpy float32
        ``[hidden_size]``, before normalisation) of each request whose prompt this step
        completed; empty otherwise.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: Sequence[list[int]]
    logprobs: list[list[TokenLogprobs]] | None = None
    prompt_logprobs_dict: dict[str, list[TokenLogprobs]] = dataclasses.field(default_factory=dict)
    sampled_flat: list[int] | None = None
    draft_token_ids: dict[str, list[int]] | None = None
    pooler_output: dict = dataclasses.field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
"""For steps that scheduled nothing (do not mutate)."""
