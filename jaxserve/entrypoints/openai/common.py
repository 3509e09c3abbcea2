"""What completions and chat serving share: the served model's facts, prompt checks, ids, usage.

Prompt checks follow vLLM's ``OpenAIServing._validate_input``: a prompt must be non-empty, its
token ids inside the vocabulary, and no longer than ``max_model_len``; ``max_tokens`` is clamped
to what max_model_len leaves (the engine's length policy). With chunked prefill off, a prompt
must also fit the scheduler's token budget whole (it could never be scheduled otherwise).
Violations are ``APIError`` 400s that name the field and the lengths.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from jaxserve.entrypoints.openai.errors import APIError, bad_request, model_not_found


@dataclasses.dataclass(frozen=True)
class ServingInfo:
    """Facts about the served model that request validation needs.

    Attributes:
      model_name: the name clients send as ``model``.
      model_path: the weights' directory (``/v1/models``'s ``root``).
      max_model_len: longest prompt + output, tokens.
      vocab_size: token ids must be in ``[0, vocab_size)`` (the smaller of the model's and the
        tokenizer's vocabularies).
      max_num_batched_tokens: the scheduler's token budget per step.
      enable_chunked_prefill: when False a prompt must fit the budget whole.
      max_waiting_requests: 503 above this many waiting requests (0 = no cap).
      scheduling_policy: "fcfs" or "priority"; a non-zero request ``priority`` needs "priority".
      created: server start, Unix seconds (``/v1/models``'s ``created``).
    """

    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_waiting_requests: int = 0
    scheduling_policy: str = "fcfs"
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @classmethod
    def from_engine(cls, llm: Any) -> ServingInfo:
        """Reads the facts off an AsyncLLM (its ``engine_config`` and ``tokenizer``)."""
        cfg = llm.engine_config
        # Token ids must be known to both the model and the tokenizer (the detokenizer decodes them).
        vocab = min(
            v for v in (llm.tokenizer.vocab_size, getattr(llm.engine, "vocab_size", None)) if v
        )
        return cls(
            model_name=cfg.model.served_model_name,
            model_path=cfg.model.model,
            max_model_len=cfg.scheduler.max_model_len,
            vocab_size=vocab,
            max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
            enable_chunked_prefill=cfg.scheduler.enable_chunked_prefill,
            max_waiting_requests=cfg.scheduler.max_waiting_requests,
            scheduling_policy=cfg.scheduler.policy,
        )

    def check_model(self, name: Any) -> None:
        """Raises the 404 ``model_not_found`` unless ``name`` is None or the served name."""
        if name is not None and name != self.model_name:
            raise model_not_found(str(name))


def check_priority(priority: int, info: ServingInfo) -> None:
    """Refuses a non-zero ``priority`` unless the server schedules by priority (vLLM's rule:
    under "fcfs" it would be silently ignored).

    Raises:
      APIError: 400 naming ``priority``.
    """
    if priority != 0 and info.scheduling_policy != "priority":
        raise bad_request(
            f"priority {priority} needs priority scheduling, but this server runs --scheduling-policy "
            f"{info.scheduling_policy} (send priority 0 or omit it)",
            param="priority",
        )


def random_id(prefix: str) -> str:
    """An OpenAI-style id: ``cmpl-<32 hex>``, ``chatcmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def check_prompt_ids(ids: list[int], info: ServingInfo, field: str = "prompt") -> None:
    """Checks one prompt's token ids: non-empty, inside the vocabulary, short enough.

    Raises:
      APIError: 400 naming ``field`` (and the lengths / the bad id).
    """
    if not ids:
        raise bad_request(f"{field} must not be empty (it has 0 tokens)", param=field)
    for token in ids:
        if not 0 <= token < info.vocab_size:
            raise bad_request(
                f"{field} token id {token} is outside the vocabulary [0, {info.vocab_size})",
                param=field,
            )
    if len(ids) > info.max_model_len:
        raise bad_request(
            f"{field} is too long: this model's maximum context length (max_model_len) is "
            f"{info.max_model_len} tokens, but the prompt has {len(ids)} tokens",
            param=field,
        )
    if not info.enable_chunked_prefill and len(ids) > info.max_num_batched_tokens:
        raise bad_request(
            f"{field} is too long: with chunked prefill off a prompt must fit the token budget "
            f"(max_num_batched_tokens) of {info.max_num_batched_tokens} tokens, but it has {len(ids)} tokens",
            param=field,
        )


def resolve_max_tokens(
    requested: int | None, prompt_len: int, info: ServingInfo, field: str = "max_tokens"
) -> int:
    """The output cap of one prompt: ``requested`` clamped to what max_model_len leaves.

    Length policy (the engine's, see ``jaxserve.engine.llm_engine``): a ``max_tokens`` beyond
    what max_model_len leaves is clamped, and the sample then ends with "length" there; this
    keeps the server, the batch CLI and the offline API alike. (OpenAI and vLLM's server answer
    400 instead.) A missing ``max_tokens`` means "up to max_model_len". ``max_tokens: 0`` is
    allowed (score the prompt only).

    Raises:
      APIError: 400 when the prompt leaves no room for the tokens asked for (names both
        lengths); a negative or non-integer ``requested`` is left to SamplingParams.
    """
    room = info.max_model_len - prompt_len
    if requested == 0:
        return 0
    if room <= 0:
        raise bad_request(
            f"prompt leaves no room to generate: this model's maximum context length (max_model_len) "
            f"is {info.max_model_len} tokens and the prompt has {prompt_len} tokens",
            param="prompt",
        )
    if requested is None:
        return room
    if isinstance(requested, int) and not isinstance(requested, bool) and requested > room:
        return room
    return requested


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` object, with ``prompt_tokens_details.cached_tokens`` (prefix caching)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def check_queue(llm: Any, info: ServingInfo) -> None:
    """Raises a 503 with ``Retry-After`` when the waiting queue is at ``max_waiting_requests``."""
    if info.max_waiting_requests and llm.num_waiting_requests >= info.max_waiting_requests:
        raise APIError(
            f"the server is overloaded: {llm.num_waiting_requests} requests are waiting "
            f"(max_waiting_requests={info.max_waiting_requests}); retry later",
            status=503,
            type="server_error",
            code="server_overloaded",
            headers={"Retry-After": "1"},
        )
