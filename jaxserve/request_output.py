"""What users get back: ``RequestOutput`` holding one ``CompletionOutput`` per sample.

Follows vLLM's ``vllm/outputs.py``: a ``RequestOutput`` per (parent) request, whose
``outputs[k]`` is the k-th of its ``n`` samples. Fields are cumulative (the whole text and token
list so far); the ``delta_*`` fields hold what was added since the request's previous output,
which is what a stream sends. A request whose ``SamplingParams.output_kind`` is DELTA (the
server's streams) gets outputs whose text, token ids and logprobs are those deltas too. Logprobs use vLLM's layout: one ``{token_id: Logprob}`` dict per position, holding the
chosen token and the top alternatives. Plain dataclasses, no jax.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Logprob:
    """Log-probability of one token at one position (vLLM's ``Logprob``).

    Attributes:
      logprob: natural-log probability, float.
      rank: 1-based rank of the token in the distribution (1 = most probable).
      decoded_token: the token's text as the tokenizer decodes it alone, or None when the
        engine has no tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated token, the chosen token and its top-k alternatives (OpenAI ``top_logprobs``)."""

PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt token, the same; the first entry is None (no logits precede position 0)."""


@dataclasses.dataclass
class CompletionOutput:
    """One sample (``index`` in ``[0, n)``) of a request.

    Attributes:
      index: which of the request's ``n`` samples this is.
      text: the generated text so far (stop string removed unless
        ``include_stop_str_in_output``).
      token_ids: generated token ids so far (a stop token id / EOS that ended it is kept).
      cumulative_logprob: sum of the sampled tokens' logprobs when logprobs were asked for,
        else None.
      logprobs: per generated token, the chosen token and top-k alternatives, when asked for
        (``SamplingParams.logprobs``), else None.
      finish_reason: None while running, then "stop", "length", "abort" or "error" (OpenAI).
      stop_reason: the stop token id (int) or stop string (str) that ended the sample, else None
        (EOS gives None, like vLLM).
      delta_text, delta_token_ids, delta_logprobs: what the latest engine step appended.
    """

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    delta_logprobs: SampleLogprobs | None = None

    @property
    def finished(self) -> bool:
        """True once ``finish_reason`` is set."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Per-request timing, ``time.monotonic()`` seconds (vLLM's ``RequestMetrics``).

    For ``n > 1`` the times are over all samples: first_* the earliest, finished_time the latest.

    Attributes:
      arrival_time: when the request reached the engine.
      first_scheduled_time: first step that computed any of its tokens, or None.
      first_token_time: when its first output token was sampled (TTFT = this - arrival_time).
      last_token_time: when its latest output token was sampled.
      finished_time: when it finished, or None while running.
      time_in_queue: first_scheduled_time - arrival_time (queueing time), or None.
      num_generation_tokens: output tokens so far, all samples together.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None
    num_generation_tokens: int = 0


@dataclasses.dataclass
class RequestOutput:
    """The state of one request after an engine step (vLLM's ``RequestOutput``).

    Attributes:
      request_id: the id given to ``add_request`` (the parent id for n > 1).
      prompt: the prompt text, or None when the prompt was given as token ids.
      prompt_token_ids: the prompt's token ids.
      prompt_logprobs: per prompt token, when ``SamplingParams.prompt_logprobs`` was set (filled
        as prompt chunks are computed; complete once the first output token exists or the
        request finished), else None.
      outputs: one CompletionOutput per sample, ordered by index.
      finished: True once every sample finished.
      num_cached_tokens: prompt tokens served from the prefix cache (the first sample's count;
        OpenAI ``usage.prompt_tokens_details.cached_tokens``).
      metrics: timing (see RequestMetrics).
      ledgers: on the final output only, one RequestLedger per sample (steps, prefix hits,
        preemptions; ``jaxserve.core.ledger.parent_ledger_dict`` makes it JSON); else None.
      pooled: pooling runner, final output only: the prompt's pooled vector (numpy float32
        ``[hidden_size]``, before normalisation and truncation; ``jaxserve.pooling``); else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    ledgers: list | None = None
    pooled: Any = None


@dataclasses.dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingOutput``).

    Attributes:
      embedding: ``[dimensions or hidden_size]`` floats (normalised unless asked otherwise).
    """

    embedding: list[float]


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's ``EmbeddingRequestOutput``).

    Attributes:
      request_id: the engine request id.
      prompt_token_ids: the prompt's token ids.
      outputs: its EmbeddingOutput.
      finished: always True (returned once done).
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
