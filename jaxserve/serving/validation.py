"""Request checks before the engine: the served model's facts (``ServingInfo``) and the checks that use them.

Prompt checks follow vLLM's ``OpenAIServing._validate_input``: a prompt must be non-empty, its
token ids inside the vocabulary, and no longer than ``max_model_len``; a ``max_tokens`` beyond
what max_model_len leaves is clamped to it (vLLM 0.32's ``get_max_tokens``). With chunked
prefill off, a prompt must also fit the scheduler's token budget whole (it could never be scheduled otherwise).
Violations are ``APIError`` 400s that name the field and the lengths.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxserve import sampling_params as caps
from jaxserve.engine.protocol import EngineClient
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.serving.errors import APIError, bad_request, from_value_error, model_not_found


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
      tool_call_parser: ``--tool-call-parser`` ("" = none; chat's ``tool_choice: "auto"`` is
        then refused).
      created: server start, Unix seconds (``/v1/models``'s ``created``).
      max_prompt_bytes: a prompt string longer than this (UTF-8 bytes) is refused before it is
        tokenized, as it surely has more than max_model_len tokens (see
        :func:`max_prompt_bytes`); 0 = no early check.
      max_num_seqs: most sequences per step (rows of the sampler's buffers).
      memory_probe: returns the bytes of memory free for a request's sampler buffers now, or
        None when the step's memory is reserved up front (accelerators: the profiled peak
        already holds ``max_num_seqs`` rows with the most logprobs).
      system_fingerprint: OpenAI's ``system_fingerprint``, a hash of the version and the
        model's serving configuration.
      runner: "generate" or "pooling" (``--runner``): which endpoints the model answers.
      pooling_normalize: pooling runner: embeddings are L2-normalised unless a request says.
      bounded_numbers: ``--structured-outputs-bounded-numbers`` (JSON numbers a schema leaves
        unbounded are bounded unless the request says otherwise).
      model_aliases: further names clients may send as ``model`` (``--served-model-name``).
      default_sampling: sampling values for the fields a request leaves out, and
        ``max_tokens`` as a cap (``--generation-config``; ``ServingConfig.default_sampling_params``).
      max_logprobs: most logprobs alternatives a request may ask for (``--max-logprobs``).
      enable_auto_tool_choice: chat's ``tool_choice: "auto"`` is served (with the parser).
      return_tokens_as_token_ids: logprobs name tokens ``"token_id:{id}"``.
      log_requests: log each request (``--enable-log-requests``), prompts cut to
        ``max_log_len`` characters / ids (0 = whole).
      enable_sleep_mode: the sleep routes may put the engine to sleep.
      lora_adapters: returns the engine's loaded LoRA adapters, name -> ``base_model_name``
        (``EngineClient.lora_adapters``; live: adapters load and unload at run time).
    """

    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_waiting_requests: int = 0
    scheduling_policy: str = "fcfs"
    tool_call_parser: str = ""
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    max_prompt_bytes: int = 0
    max_num_seqs: int = 256
    memory_probe: Callable[[], int | None] = lambda: None
    system_fingerprint: str = ""
    runner: str = "generate"
    pooling_normalize: bool = True
    bounded_numbers: bool = True
    model_aliases: tuple[str, ...] = ()
    default_sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_logprobs: int = MAX_LOGPROBS
    enable_auto_tool_choice: bool = False
    return_tokens_as_token_ids: bool = False
    log_requests: bool = False
    max_log_len: int = 0
    enable_sleep_mode: bool = False
    lora_adapters: Callable[[], dict[str, str | None]] = dict

    @classmethod
    def from_engine(cls, llm: EngineClient) -> ServingInfo:
        """Reads the facts off an engine (its ``engine_config``, ``tokenizer`` and ``vocab_size``)."""
        cfg = llm.engine_config
        import jax  # local: the server imports it anyway; keeps this module light for tests

        on_cpu = jax.default_backend() == "cpu"
        return cls(
            max_prompt_bytes=max_prompt_bytes(llm.tokenizer, cfg.scheduler.max_model_len),
            max_num_seqs=cfg.scheduler.max_num_seqs,
            memory_probe=cached_probe(free_host_memory) if on_cpu else (lambda: None),
            system_fingerprint=fingerprint(cfg),
            model_name=cfg.model.served_model_name,
            model_path=cfg.model.model,
            max_model_len=cfg.scheduler.max_model_len,
            vocab_size=llm.vocab_size,
            max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
            enable_chunked_prefill=cfg.scheduler.enable_chunked_prefill,
            max_waiting_requests=cfg.scheduler.max_waiting_requests,
            scheduling_policy=cfg.scheduler.policy,
            tool_call_parser=cfg.model.tool_call_parser,
            runner=cfg.model.runner,
            pooling_normalize=cfg.model.pooling_normalize,
            bounded_numbers=cfg.model.structured_outputs_bounded_numbers,
            model_aliases=cfg.model.served_model_aliases,
            default_sampling=cfg.serving.default_sampling_params(cfg.model.model),
            max_logprobs=cfg.serving.max_logprobs,
            enable_auto_tool_choice=cfg.serving.enable_auto_tool_choice,
            return_tokens_as_token_ids=cfg.serving.return_tokens_as_token_ids,
            log_requests=cfg.serving.enable_log_requests,
            max_log_len=cfg.serving.max_log_len,
            enable_sleep_mode=cfg.model.enable_sleep_mode,
            lora_adapters=llm.lora_adapters,
        )

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name clients may send as ``model``: the served name, then the aliases."""
        return (self.model_name, *self.model_aliases)

    @property
    def auto_tool_parser(self) -> str:
        """The parser chat's ``tool_choice: "auto"`` uses: ``tool_call_parser`` when
        ``enable_auto_tool_choice`` is on, else "" (auto refused)."""
        return self.tool_call_parser if self.enable_auto_tool_choice else ""

    def check_model(self, name: Any) -> None:
        """Raises the 404 ``model_not_found`` unless ``name`` is None, a served name or a
        loaded LoRA adapter's."""
        if name is not None and name not in self.model_names and name not in self.lora_adapters():
            raise model_not_found(str(name))

    def lora_of(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` selects, or None (the base model)."""
        return name if name is not None and name in self.lora_adapters() else None


NORMALIZATION_SHRINK = 4
"""How many times shorter (in UTF-8 bytes) Unicode normalization can make a text: NFKC composes
at most three code points into one of no fewer bytes (Hangul jamo L+V+T, 9 bytes -> 3), so 4 is
a safe round-up."""


def max_prompt_bytes(tokenizer: Any, max_model_len: int) -> int:
    """UTF-8 bytes above which a prompt string surely has more than ``max_model_len`` tokens.

    Every token covers at most ``L`` bytes of normalized text, where ``L`` is the longest
    vocabulary string's UTF-8 length (an upper bound: sentencepiece's "▁" is 3 bytes for a
    1-byte space, byte-fallback "<0xF0>" 6 bytes for one, byte-level BPE's "Ġ" 2 for one), and
    normalization shrinks text at most ``NORMALIZATION_SHRINK`` times. So a text of
    ``B > max_model_len * L * NORMALIZATION_SHRINK`` bytes has more than max_model_len tokens,
    and can be refused without tokenizing. (A tokenizer that folds runs of whitespace into one
    breaks this bound; none of the supported backends' bundled models does.)

    Returns:
      The bound, bytes; 0 when the vocabulary cannot be read (no early check).
    """
    try:
        tokens = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
        longest = max(len(t.encode("utf-8", "surrogatepass")) for t in tokens if t is not None)
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: no early check
        return 0
    return max_model_len * max(longest, 1) * NORMALIZATION_SHRINK


def check_prompt_bytes(texts: Sequence[str], info: ServingInfo, field: str = "prompt") -> None:
    """Refuses, before tokenizing, text that surely has more than max_model_len tokens.

    Args:
      texts: the prompt strings of one prompt (their bytes are summed: one chat's messages).

    Raises:
      APIError: 400 naming ``field``, the byte length and the bound.
    """
    if not info.max_prompt_bytes:
        return
    total = 0
    for text in texts:
        total += len(text.encode("utf-8", "surrogatepass"))
        if total > info.max_prompt_bytes:
            raise bad_request(
                f"{field} is too long: it has more than {info.max_prompt_bytes} bytes of UTF-8 "
                f"text, which is surely more than this model's maximum context length "
                f"(max_model_len) of {info.max_model_len} tokens",
                param=field,
            )


JSON_BYTES_PER_TEXT_BYTE = 6
"""Most bytes of JSON one byte of UTF-8 text can take in a string: a control character is
``\\u0001`` (6 bytes); a non-ASCII character written as escapes takes at most 3x its UTF-8
length (2 bytes -> ``\\uXXXX``, 4 bytes -> a surrogate pair, 12)."""

BODY_FIELDS_ALLOWANCE = 64 * 2**10
"""Bytes allowed for a request's scalar fields, keys and punctuation beside what the caps bound."""

BODY_SLACK = 2
"""The body limit is this many times the derived need: room for whitespace, unknown fields a
client sends along, chat messages' wrapping, tool descriptions, and a batch of a few prompts."""


def request_body_limit(info: ServingInfo, ceiling: int) -> int:
    """Bytes above which no request body can be one this server would serve, so it is refused
    (413) from its ``Content-Length`` without being read (``api_server``).

    The need of the largest valid request, in JSON at its most escaped
    (``JSON_BYTES_PER_TEXT_BYTE`` bytes per byte of text): one prompt of ``max_prompt_bytes``
    (longer text is refused as surely more than max_model_len tokens) or of max_model_len token
    ids; a structured-output constraint and the tools' schemas of ``MAX_CONSTRAINT_CHARS`` each
    (``tool_choice: "required"`` compiles all of them as one constraint; with ``auto`` they are
    rendered into the prompt); the bad words, stop strings, logit bias and allowed token ids at
    their caps; ``BODY_FIELDS_ALLOWANCE`` for everything else. The limit is ``BODY_SLACK``
    times that, at most ``ceiling``; ``ceiling`` itself when the prompt bound is unknown
    (``max_prompt_bytes`` 0).

    Not covered (so refused above the limit although each part is valid): a /v1/completions
    batch of many long prompts (send fewer per request, or use ``jaxserve run-batch``), and
    megabytes of unknown fields or whitespace.
    """
    if not info.max_prompt_bytes:
        return ceiling
    token_id = len(str(max(info.vocab_size - 1, 0))) + 2  # digits, a comma and a space
    text = JSON_BYTES_PER_TEXT_BYTE
    need = (
        max(text * info.max_prompt_bytes, token_id * info.max_model_len)
        + text * 2 * caps.MAX_CONSTRAINT_CHARS
        + text * caps.MAX_BAD_WORDS_CHARS
        + 4 * caps.MAX_BAD_WORDS
        + caps.MAX_STOP_STRINGS * (text * caps.MAX_STOP_STRING_CHARS + 4)
        + caps.MAX_LOGIT_BIAS * (token_id + 32)  # "id": a float
        + caps.MAX_ALLOWED_TOKEN_IDS * token_id
        + BODY_FIELDS_ALLOWANCE
    )
    return min(ceiling, BODY_SLACK * need)


SAMPLER_ROW_BUFFERS = 8
"""f32 ``[rows, vocab]`` buffers the sampler may hold at once for logits, log-softmax, ranks and
top-k (a conservative count; the profiled accelerator step measures its own)."""


def free_host_memory() -> int | None:
    """Bytes of host memory free now: ``MemAvailable`` of /proc/meminfo, lowered to the cgroup
    v2 limit's headroom when there is one; None when neither can be read."""
    free: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            room = int(limit) - used
            free = room if free is None else min(free, room)
    except (OSError, ValueError):
        pass
    return free


def cached_probe(probe: Callable[[], int | None], ttl_s: float = 0.25) -> Callable[[], int | None]:
    """``probe`` re-read at most every ``ttl_s`` seconds (a burst of requests shares one
    /proc read: reading it per request was ~8% of the server's Python time at rate inf)."""
    last: list = [float("-inf"), None]

    def read() -> int | None:
        now = time.monotonic()
        if now - last[0] >= ttl_s:
            last[0], last[1] = now, probe()
        return last[1]

    return read


def check_sampler_memory(params: Any, info: ServingInfo) -> None:
    """Refuses a request whose sampler buffers cannot fit the memory free now.

    A step holds ``SAMPLER_ROW_BUFFERS`` f32 ``[rows, vocab]`` buffers for the request's
    ``min(n, max_num_seqs)`` rows (plus the prompt-logprobs head's ``PROMPT_LOGPROBS_CHUNK``
    rows when it asks for prompt logprobs); more than half the free memory is a 400 naming
    ``n`` (or ``logprobs`` when n is 1), never an allocation that kills the engine.

    Raises:
      APIError: 400 as above.
    """
    free = info.memory_probe()
    if free is None:
        return
    rows = min(params.n, info.max_num_seqs)
    if params.prompt_logprobs is not None:
        rows += 256  # the model runner's PROMPT_LOGPROBS_CHUNK
    need = rows * info.vocab_size * 4 * SAMPLER_ROW_BUFFERS
    if need > free // 2:
        field = "n" if params.n > 1 else "logprobs"
        raise bad_request(
            f"{field}: this request's sampler buffers need about {need / 2**20:.0f} MiB "
            f"({rows} rows x {info.vocab_size} vocabulary x {SAMPLER_ROW_BUFFERS} f32 buffers), "
            f"more than half of the {free / 2**20:.0f} MiB of memory free now; lower n "
            f"(or prompt_logprobs)",
            param=field,
        )


def fingerprint(cfg: Any) -> str:
    """OpenAI's ``system_fingerprint``: ``fp_`` and 10 hex digits of a hash of the jaxserve
    version and the model's serving configuration (what changes outputs for the same seed)."""
    try:
        version = importlib.metadata.version("jaxserve")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    parts = [version, cfg.model.model, str(cfg.model.dtype), str(cfg.scheduler.max_model_len)]
    return "fp_" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:10]


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


def prepare_token_masks_of(
    request: Any,
    params: Any,
    tokenizer: Any,
    info: ServingInfo,
    field: str | None = None,
    checks: Any = (),
) -> Any:
    """Attaches the request's token-mask plan to ``params`` (``SamplingParams.token_mask_plan``):
    bad words tokenized, allowed ids as a mask row, the output constraint's compile started.
    Called in the request's worker thread, so the engine thread only copies the plan; the
    compile ends in a compile thread and ``AsyncLLM.add_request`` awaits it, so a constraint
    the engine cannot use is a 400 before anything runs, and a slow compile holds no worker
    thread. Returns ``params``.

    Args:
      field: the field that carries the constraint (default the request's
        ``constraint_field``).
      checks: futures of other compiles the request must pass (a chat's tool schemas).

    Raises:
      APIError: 400 naming the field the client used (``response_format``,
        ``structured_outputs``, ``tools``, ``bad_words``) when that shows before compiling.
    """
    if not params.needs_token_mask and not checks:
        return params
    from jaxserve.structured import prepare_token_masks

    field = field or request.constraint_field
    try:
        params.token_mask_plan = prepare_token_masks(
            params,
            tokenizer,
            bounded_numbers=info.bounded_numbers,
            field=field,
            wait=False,
            checks=checks,
        )
    except ValueError as exc:
        raise from_value_error(exc) from exc
    return params


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


def resolve_max_tokens(requested: int | None, prompt_len: int, info: ServingInfo) -> int:
    """The output cap of one prompt: ``requested``, or what max_model_len leaves when None.

    Length policy of the server and the batch CLI, vLLM's (0.32, ``get_max_tokens``): a
    ``max_tokens`` beyond what max_model_len leaves after the prompt is clamped to what it
    leaves (the request ends with ``finish_reason: "length"`` there), as the offline ``LLM``
    API does; a prompt that leaves no room is a 400. (OpenAI answers 400 to both; vLLM's
    clients, the benchmark among them, send ``max_tokens`` without counting the prompt's
    tokens as the server will.) A missing ``max_tokens`` means "up to max_model_len".
    A ``max_new_tokens`` in the generation config (``--generation-config``) caps both, as in
    vLLM.
    ``max_tokens: 0`` is allowed (score the prompt only).

    Raises:
      APIError: 400 when the prompt leaves no room (names the lengths); a negative or
        non-integer ``requested`` is left to SamplingParams.
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
    cap = info.default_sampling.get("max_tokens")  # generation_config's max_new_tokens
    limit = room if cap is None else min(room, cap)  # vLLM caps requests at it too
    if requested is None:
        return limit
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 0:
        return requested  # SamplingParams names the field
    return min(requested, limit)


def check_queue(llm: EngineClient, info: ServingInfo) -> None:
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
