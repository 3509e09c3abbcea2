"""Sampling parameters of one request, with OpenAI/vLLM semantics.

Every field is checked in ``__post_init__``; a bad value raises ``ValueError`` whose message
starts with the field's name, so the server can turn it into an OpenAI-style 400 with ``param``
set (see :func:`jaxserve.serving.protocol`). Source: the OpenAI API reference for
completions/chat (ranges of temperature, top_p, penalties, logprobs, logit_bias) and vLLM's
``SamplingParams`` for the extensions (top_k, min_p, repetition_penalty, min_tokens,
stop_token_ids, ignore_eos, include_stop_str_in_output).

Order in which the sampler applies the knobs (documented contract, tested against a NumPy
reference): logit_bias -> repetition, presence, frequency penalties -> (greedy if temperature
== 0) -> divide by temperature -> top-k -> top-p -> min-p -> sample. ``top_p`` keeps the smallest
set of most probable tokens whose probability mass reaches ``top_p`` (the most probable token is
always kept), so ``top_p == 1`` keeps everything (off) and ``top_p == 0`` keeps only the most
probable token (greedy among ties broken by token id).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

MAX_LOGPROBS = 20
"""Largest ``logprobs`` / ``prompt_logprobs`` (top-n alternatives) a request may ask for."""

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The constraint kinds of :class:`StructuredOutputsParams`, exactly one of which is set."""

STRUCTURED_OPTIONS = ("bounded_numbers",)
"""Options of :class:`StructuredOutputsParams` beside its kind."""

# Caps on request preprocessing that grows with the request (each a 400 naming the field and the
# cap; vLLM's figures where vLLM has the cap). With them every per-request preprocessing step is
# bounded and linear, and runs before the engine thread sees the request (see
# ``jaxserve.structured.prepare_token_masks``).
MAX_LOGIT_BIAS = 1024
"""Most ``logit_bias`` entries (vLLM's ``MAX_NUM_LOGIT_BIAS_TOKENS``): the sampler's bias arrays
are as wide as the step's largest map, so the cap bounds that width too."""

MAX_ALLOWED_TOKEN_IDS = 1024
"""Most ``allowed_token_ids`` entries (vLLM's ``MAX_NUM_ALLOWED_TOKEN_IDS``)."""

MAX_BAD_WORDS = 1024
"""Most ``bad_words`` (vLLM sets no cap; each word costs two tokenizations at admission)."""

MAX_BAD_WORDS_CHARS = 16384
"""Most characters of all ``bad_words`` together: they are tokenized (twice each) and built
into an automaton in Python, ~10 ms for the most this allows."""

MAX_CHOICES = 16384
"""Most ``structured_outputs.choice`` entries (vLLM sets no cap); they compile to one
alternation, 16k short entries in ~0.1 s."""

MAX_CONSTRAINT_CHARS = 256 * 1024
"""Longest constraint text, characters: a regex, a grammar, the choices together, or a JSON
schema as JSON (vLLM sets no cap; llguidance compiles 100 kB schemas in well under a second)."""


def _json_text(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError):
        raise ValueError(
            "structured_outputs.json must be a JSON schema (object or string)"
        ) from None


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``); exactly one field set.

    Attributes:
      json: a JSON schema (dict, or its JSON text) the output must validate against.
      regex: a regular expression (Rust ``regex`` syntax) the whole output must match.
      choice: the output is exactly one of these strings.
      grammar: a Lark grammar (llguidance dialect) or a GBNF grammar.
      json_object: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
      bounded_numbers: JSON numbers the schema leaves unbounded are limited to what JSON
        consumers accept (integers within int64, floats with a bounded count of digits; see
        ``jaxserve.structured.json_numbers``); None takes the engine's default
        (``--structured-outputs-bounded-numbers``, on). Only for ``json`` / ``json_object``.

    Whether the constraint compiles is checked by ``jaxserve.structured`` (it needs the
    tokenizer); here only the types.

    Raises:
      ValueError: no field or several set, a field of the wrong type, more than
        ``MAX_CHOICES`` choices or more than ``MAX_CONSTRAINT_CHARS`` characters of constraint
        (message starts with ``structured_outputs``).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    bounded_numbers: bool | None = None

    def __post_init__(self) -> None:
        set_fields = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {set_fields or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (object or string)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")
        if self.bounded_numbers is not None and not isinstance(self.bounded_numbers, bool):
            raise ValueError("structured_outputs.bounded_numbers must be a boolean")
        self._check_size()

    def _check_size(self) -> None:
        """Refuses more than ``MAX_CHOICES`` choices or ``MAX_CONSTRAINT_CHARS`` characters."""
        kind = self.kind
        if kind == "choice":
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(
                    f"structured_outputs.choice has {len(self.choice)} entries; at most "
                    f"{MAX_CHOICES} are allowed"
                )
            size = sum(len(c) for c in self.choice)
        elif kind == "json":
            size = len(self.json if isinstance(self.json, str) else _json_text(self.json))
        elif kind in ("regex", "grammar"):
            size = len(getattr(self, kind))
        else:
            return
        if size > MAX_CONSTRAINT_CHARS:
            raise ValueError(
                f"structured_outputs.{kind} has {size} characters; at most "
                f"{MAX_CONSTRAINT_CHARS} are allowed"
            )

    @property
    def kind(self) -> str:
        """The field that is set: one of :data:`STRUCTURED_KINDS`."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


MAX_STOP_STRINGS = 64
"""Most stop strings one request may send (OpenAI allows 4; vLLM sets no count cap)."""

MAX_STOP_STRING_CHARS = 256
"""Longest stop string, characters. With the count cap this bounds the engine thread's stop work
per sample and step (``jaxserve.tokenizer.stop_strings``): it reads only the last
``new + MAX_STOP_STRING_CHARS`` characters, never the whole output."""


def check_stop_caps(stop: Any) -> None:
    """Checks the stop list against ``MAX_STOP_STRINGS`` and ``MAX_STOP_STRING_CHARS``.

    Raises:
      ValueError: too many or too long stop strings (message starts with ``stop``).
    """
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(
            f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters long, got one of {longest}"
        )


def _check_float(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if value < lo or value > hi or (lo_open and value == lo):
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {left}{lo}, {hi}], got {value}")
    return value


def _check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return value


@dataclasses.dataclass
class SamplingParams:
    """How to pick the tokens of one request (OpenAI semantics, vLLM extensions).

    Attributes:
      n: number of parallel samples (>= 1); the engine fans them out as child requests that
        share the prompt's KV blocks through prefix caching.
      temperature: in [0, 2]; 0 means greedy.
      top_p: nucleus mass in [0, 1]; 1 is off, 0 keeps only the most probable token.
      top_k: keep the k most probable tokens; 0 or -1 is off.
      min_p: in [0, 1]; drop tokens whose probability is below min_p times the top one's.
      presence_penalty: in [-2, 2]; subtracted once from the logit of each token present in the
        output so far.
      frequency_penalty: in [-2, 2]; times the count of the token in the output so far.
      repetition_penalty: > 0 (1 is off); logits of tokens seen in prompt or output are divided
        by it when positive and multiplied by it when negative (CTRL paper, HF/vLLM behaviour).
      seed: per-request sampling seed; samples do not depend on which other requests share
        the step. None draws from the engine's generator.
      stop: stop strings (at most ``MAX_STOP_STRINGS`` of at most ``MAX_STOP_STRING_CHARS``
        characters); generation ends when the output text contains one, and the returned
        text stops before it (after it with ``include_stop_str_in_output``).
      stop_token_ids: token ids that end generation (kept in ``output_token_ids``).
      ignore_eos: keep generating past EOS.
      max_tokens: most tokens to generate; None means up to max_model_len. 0 is allowed (the
        request then only scores its prompt, e.g. for ``echo`` + ``logprobs``).
      min_tokens: EOS and stop_token_ids cannot end generation before this many tokens.
      logprobs: number of top alternatives (0..20) to return with each sampled token's logprob;
        None for no logprobs.
      prompt_logprobs: the same for prompt tokens; None for none.
      logit_bias: token id -> bias in [-100, 100] added to its logit; at most
        ``MAX_LOGIT_BIAS`` entries.
      include_stop_str_in_output: keep the matched stop string in the text.
      skip_special_tokens: drop special tokens when detokenizing.
      structured_outputs: a constraint the output must match (JSON schema, regex, choice,
        grammar; see :class:`StructuredOutputsParams`), enforced by masking the logits; None
        for free text.
      allowed_token_ids: only these token ids may be sampled (vLLM); None for all; at most
        ``MAX_ALLOWED_TOKEN_IDS``.
      bad_words: words that must not be generated (vLLM): each is tokenized with and without
        a leading space, and the last token of a word is banned whenever the output ends with
        the rest of it; at most ``MAX_BAD_WORDS`` words of ``MAX_BAD_WORDS_CHARS``
        characters in all.
      token_mask_plan: what ``jaxserve.structured.prepare_token_masks`` made of the three
        fields above (compiled grammar, token bitmask, bad-word automaton), set by the server
        in a worker thread so the engine thread only copies it; None lets the engine prepare
        it at ``add_request``. Not compared, not shown, and pickled as None (another process
        prepares its own).

    Raises:
      ValueError: a field is out of range or of the wrong type; the message starts with its
        name.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = dataclasses.field(default_factory=list)
    token_mask_plan: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n, 1, 128)
        self.temperature = _check_float("temperature", self.temperature, 0.0, 2.0)
        self.top_p = _check_float("top_p", self.top_p, 0.0, 1.0)
        self.top_k = _check_int("top_k", self.top_k, -1)
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _check_float("min_p", self.min_p, 0.0, 1.0)
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _check_float(
            "frequency_penalty", self.frequency_penalty, -2.0, 2.0
        )
        self.repetition_penalty = _check_float(
            "repetition_penalty", self.repetition_penalty, 0.0, 2.0**31, lo_open=True
        )
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, -(2**63), 2**64 - 1)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(
            isinstance(s, str) for s in self.stop
        ):
            raise ValueError("stop must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        self.stop = list(self.stop)
        check_stop_caps(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError("stop_token_ids must be a list of integers")
        self.stop_token_ids = [_check_int("stop_token_ids", t, 0) for t in self.stop_token_ids]
        if not isinstance(self.ignore_eos, bool):
            raise ValueError("ignore_eos must be a boolean")
        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens, 0)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}"
            )
        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _check_int(
                "prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS
            )
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must be a map of token id to bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are "
                "allowed"
            )
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token}")
            bias[token] = _check_float("logit_bias", value, -100.0, 100.0)
        self.logit_bias = bias
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(
                    f"allowed_token_ids has {len(self.allowed_token_ids)} entries; at most "
                    f"{MAX_ALLOWED_TOKEN_IDS} are allowed"
                )
            self.allowed_token_ids = [
                _check_int("allowed_token_ids", t, 0) for t in self.allowed_token_ids
            ]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if not isinstance(self.bad_words, (list, tuple)) or not all(
            isinstance(w, str) and w for w in self.bad_words
        ):
            raise ValueError("bad_words must be a list of non-empty strings")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(
                f"bad_words has {len(self.bad_words)} words; at most {MAX_BAD_WORDS} are allowed"
            )
        chars = sum(map(len, self.bad_words))
        if chars > MAX_BAD_WORDS_CHARS:
            raise ValueError(
                f"bad_words has {chars} characters in all; at most {MAX_BAD_WORDS_CHARS} are "
                "allowed"
            )
        self.bad_words = list(self.bad_words)

    @property
    def needs_token_mask(self) -> bool:
        """True when the sampler must mask this request's logits on the host's say-so
        (structured outputs, allowed_token_ids, bad_words)."""
        return (
            self.structured_outputs is not None
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )

    @property
    def greedy(self) -> bool:
        """True when the sampler takes the argmax (temperature 0)."""
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Checks token ids in ``logit_bias`` and ``stop_token_ids`` against the vocabulary.

        Raises:
          ValueError: a token id is >= vocab_size (names the field and the id).
        """
        for token in self.logit_bias:
            if token >= vocab_size:
                raise ValueError(
                    f"logit_bias token id {token} is out of the vocabulary (size {vocab_size})"
                )
        for token in self.stop_token_ids:
            if token >= vocab_size:
                raise ValueError(
                    f"stop_token_ids token id {token} is out of the vocabulary (size {vocab_size})"
                )
        for token in self.allowed_token_ids or ():
            if token >= vocab_size:
                raise ValueError(
                    f"allowed_token_ids token id {token} is out of the vocabulary "
                    f"(size {vocab_size})"
                )

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with ``changes`` applied (e.g. ``n=1, seed=s+k`` for child requests).
        Changing a field the token-mask plan was made from drops the plan."""
        if "token_mask_plan" not in changes and _MASK_FIELDS.intersection(changes):
            changes["token_mask_plan"] = None
        return dataclasses.replace(self, **changes)


_MASK_FIELDS = frozenset(("structured_outputs", "allowed_token_ids", "bad_words"))
