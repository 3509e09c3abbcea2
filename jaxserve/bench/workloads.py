"""Benchmark workloads: lists of prompts with the output length each one asks for.

Three workloads (``WorkloadSpec.kind``), shared by ``jaxserve bench serve`` (HTTP),
``jaxserve bench throughput`` (offline) and the notebooks:

* ``random``: every prompt ``input_len`` random tokens, every request ``output_len`` output
  tokens (vLLM ``bench serve --dataset-name random``: ``--random-input-len``,
  ``--random-output-len``, ``--random-range-ratio``).
* ``shared-prefix``: ``num_prefixes`` random prefixes of ``prefix_len`` tokens; request ``i`` is
  prefix ``i % num_prefixes`` followed by ``input_len`` unique random tokens (vLLM's
  ``--random-prefix-len`` and its ``prefix_repetition`` dataset). With ``num_prefixes ==
  num_prompts`` nothing is shared: the same lengths without prefix-cache hits.
* ``mixed``: a ``long_fraction`` of the requests are long (``long_input_len`` in,
  ``long_output_len`` out), the rest short (``input_len`` / ``output_len``), shuffled.

Prompts are token ids (``prompt_format="ids"``; sent as an OpenAI token-id prompt, so the lengths
are exact) or text (``"text"``: random whole-word vocabulary pieces, decoded; about one token a
word, the exact count is what the tokenizer gives back). Special tokens are never drawn.

The load shapes of the design (``PRESETS``; explicit flags override a preset's values):

* ``qa``: short high-concurrency question answering: 128 tokens in, 128 out, 64 concurrent.
* ``long-doc``: long-document generation: 2,048 tokens in, 512 out, 4 concurrent.
* ``mixed``: both at once, 10% long, under Poisson arrivals at 4 requests/s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

WORKLOADS = ("random", "shared-prefix", "mixed")
PROMPT_FORMATS = ("ids", "text")

PRESETS: dict[str, dict[str, Any]] = {
    "qa": {
        "workload": "random",
        "input_len": 128,
        "output_len": 128,
        "num_prompts": 512,
        "max_concurrency": 64,
    },
    "long-doc": {
        "workload": "random",
        "input_len": 2048,
        "output_len": 512,
        "num_prompts": 32,
        "max_concurrency": 4,
    },
    "mixed": {
        "workload": "mixed",
        "input_len": 128,
        "output_len": 128,
        "long_input_len": 2048,
        "long_output_len": 512,
        "long_fraction": 0.1,
        "num_prompts": 200,
        "request_rate": 4.0,
    },
}
"""Named load shapes: default values for the workload and load flags (flags given win)."""


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One benchmark request.

    Attributes:
      prompt: token ids (``list[int]``) or text.
      prompt_len: prompt tokens (exact for ids; the tokenizer's count, BOS included, for text).
      output_len: output tokens to ask for (``max_tokens``; with ``ignore_eos`` the exact count).
      kind: a label for per-kind breakdowns ("short", "long", or "" for uniform workloads).
    """

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    kind: str = ""


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """What to generate (see the module docstring for each kind's meaning).

    Attributes:
      kind: "random", "shared-prefix" or "mixed".
      num_prompts: requests to generate.
      input_len: prompt tokens (random, mixed short), or unique tokens after the prefix
        (shared-prefix).
      output_len: output tokens per request (mixed: of the short ones).
      range_ratio: lengths drawn uniformly from ``[len * (1 - r), len * (1 + r)]`` (vLLM's
        ``--random-range-ratio``); 0 = fixed lengths.
      prefix_len: shared prefix tokens (shared-prefix).
      num_prefixes: distinct prefixes (shared-prefix).
      long_input_len, long_output_len: the long requests' lengths (mixed).
      long_fraction: share of long requests, in [0, 1] (mixed).
      prompt_format: "ids" or "text".
      seed: random seed (>= 0); the same spec and vocabulary give the same requests.

    Raises:
      ValueError: a field out of range (names it).
    """

    kind: str = "random"
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_prefixes: int = 1
    long_input_len: int = 2048
    long_output_len: int = 512
    long_fraction: float = 0.1
    prompt_format: str = "ids"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.kind!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be ids or text, got {self.prompt_format!r}")
        for name in (
            "num_prompts",
            "input_len",
            "output_len",
            "num_prefixes",
            "long_input_len",
            "long_output_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len}")
        if self.kind == "shared-prefix" and self.prefix_len < 1:
            raise ValueError("prefix_len must be >= 1 for the shared-prefix workload")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")


class TokenSource:
    """Draws random non-special token ids, and words for text prompts.

    Args:
      vocab_size: ids are drawn from ``[0, vocab_size)``.
      special_ids: ids never drawn (BOS, EOS, pad, unknown, ...).
      tokenizer: a ``jaxserve.tokenizer.Tokenizer`` (or anything with ``encode``, ``decode``,
        ``convert_ids_to_tokens``); needed for text prompts only.

    Raises:
      ValueError: vocab_size < 2 or no id left to draw.
    """

    def __init__(
        self, vocab_size: int, special_ids: Sequence[int] = (), tokenizer: Any = None
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        excluded = set(int(i) for i in special_ids)
        self.ids = np.array([i for i in range(vocab_size) if i not in excluded], np.int64)
        if self.ids.size == 0:
            raise ValueError("vocab_size: every token id is special; nothing to draw prompts from")
        self.tokenizer = tokenizer
        self._word_ids: np.ndarray | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenSource:
        """Ids of ``tokenizer``'s vocabulary minus its special tokens."""
        return cls(tokenizer.vocab_size, tokenizer.all_special_ids, tokenizer)

    def sample_ids(self, rng: np.random.Generator, n: int) -> list[int]:
        """``n`` random token ids."""
        return self.ids[rng.integers(0, self.ids.size, size=n)].tolist()

    def word_ids(self) -> np.ndarray:
        """Ids whose piece is a whole alphabetic word with a leading space marker (▁ or Ġ).

        Raises:
          ValueError: the source has no tokenizer, or its vocabulary has no such piece (both
            named as ``prompt_format``: use id prompts then).
        """
        if self._word_ids is None:
            if self.tokenizer is None:
                raise ValueError("prompt_format: text prompts need a tokenizer")
            pieces = self.tokenizer.convert_ids_to_tokens(self.ids.tolist())
            words = [
                i
                for i, p in zip(self.ids.tolist(), pieces)
                if len(p) > 2 and p[0] in "▁Ġ" and p[1:].isalpha() and p[1:].isascii()
            ]
            if not words:
                raise ValueError("prompt_format: the tokenizer has no whole-word pieces; use ids")
            self._word_ids = np.array(words, np.int64)
        return self._word_ids

    def sample_text(self, rng: np.random.Generator, n: int) -> str:
        """About ``n`` tokens of random words."""
        words = self.word_ids()
        return self.tokenizer.decode(words[rng.integers(0, words.size, size=n)].tolist()).strip()


def _length(rng: np.random.Generator, length: int, ratio: float) -> int:
    if ratio == 0.0:
        return length
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return int(rng.integers(lo, hi + 1))


def _prompt(
    source: TokenSource, rng: np.random.Generator, fmt: str, n: int, prefix: Any = None
) -> tuple[str | list[int], int]:
    if fmt == "ids":
        ids = (list(prefix) if prefix is not None else []) + source.sample_ids(rng, n)
        return ids, len(ids)
    text = ((prefix + " ") if prefix is not None else "") + source.sample_text(rng, n)
    return text, len(source.tokenizer.encode(text))


def make_requests(spec: WorkloadSpec, source: TokenSource) -> list[BenchRequest]:
    """The requests of ``spec``, drawn from ``source`` with ``numpy.random.default_rng((seed, kind))``
    (the kind's index mixed in, so workloads of one seed share no prompt tokens by construction).

    Raises:
      ValueError: text prompts without a tokenizer.
    """
    rng = np.random.default_rng([spec.seed, WORKLOADS.index(spec.kind)])
    fmt = spec.prompt_format
    out: list[BenchRequest] = []
    if spec.kind == "random":
        for _ in range(spec.num_prompts):
            prompt, n = _prompt(source, rng, fmt, _length(rng, spec.input_len, spec.range_ratio))
            out.append(BenchRequest(prompt, n, _length(rng, spec.output_len, spec.range_ratio)))
    elif spec.kind == "shared-prefix":
        draw = source.sample_ids if fmt == "ids" else source.sample_text
        prefixes = [draw(rng, spec.prefix_len) for _ in range(spec.num_prefixes)]
        for i in range(spec.num_prompts):
            prompt, n = _prompt(
                source,
                rng,
                fmt,
                _length(rng, spec.input_len, spec.range_ratio),
                prefix=prefixes[i % spec.num_prefixes],
            )
            out.append(
                BenchRequest(
                    prompt,
                    n,
                    _length(rng, spec.output_len, spec.range_ratio),
                    kind=f"prefix-{i % spec.num_prefixes}",
                )
            )
    else:  # mixed
        num_long = int(round(spec.long_fraction * spec.num_prompts))
        is_long = np.zeros(spec.num_prompts, bool)
        is_long[:num_long] = True
        rng.shuffle(is_long)
        for long in is_long.tolist():
            in_len, out_len = (
                (spec.long_input_len, spec.long_output_len)
                if long
                else (spec.input_len, spec.output_len)
            )
            prompt, n = _prompt(source, rng, fmt, _length(rng, in_len, spec.range_ratio))
            out.append(
                BenchRequest(
                    prompt,
                    n,
                    _length(rng, out_len, spec.range_ratio),
                    kind="long" if long else "short",
                )
            )
    return out


def poisson_arrivals(num: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: a Poisson process of ``request_rate`` requests/s
    (exponential gaps, vLLM ``bench serve`` with burstiness 1); ``inf`` sends all at 0.

    Raises:
      ValueError: request_rate <= 0.
    """
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if np.isinf(request_rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()
