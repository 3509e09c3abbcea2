"""The "small request beside the worst allowed case" measurement of #38 (deliverable 1), shared
by tests/entrypoints/test_preprocessing_ratios.py and benchmarks/bench_preprocessing.py.

For each request feature whose preprocessing grows with the request (bad words, allowed token
ids, logit bias, stop strings, grammars, tool schemas, long prompts) ``worst_case(name, k)`` is
a completions / chat body at the largest size the server accepts (``jaxserve.sampling_params``
caps), made distinct per ``k`` so no cache hides its preprocessing; "heavy_regex_x8" is F2's
case, 8 requests at once with a regex refused at admission. ``measure_ratio`` times a
small greedy request alone and beside one such request, interleaved, and returns the ratio of
the fastest of each (the shared dev box's load adds latency at random; the fastest run is the
one it disturbed least): 1 means the worst case costs the small request nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from jaxserve.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_CHARS,
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)
from jaxserve.serving.tool_calls import MAX_TOOLS

COMPL = "/v1/completions"
CHAT = "/v1/chat/completions"

SMALL = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
"""The small request whose latency is measured."""

WORST_MAX_TOKENS = 24
"""Tokens each worst-case request generates (it outlives the small one)."""


def _letters(k: int, length: int) -> str:
    """A word of ``length`` letters, different for each ``k``."""
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    out = []
    for i in range(length):
        k, r = divmod(k + i * 7, 26)
        out.append(alphabet[r])
    return "".join(out)


def _tool(i: int, k: int) -> dict[str, Any]:
    props = {f"p{j}_{k}": {"type": ["string", "integer", "number", "boolean"]} for j in range(8)}
    return {
        "type": "function",
        "function": {"name": f"tool{i}", "parameters": {"type": "object", "properties": props}},
    }


def worst_case(name: str, k: int, max_prompt_bytes: int) -> tuple[str, dict[str, Any]]:
    """``(url, body)`` of the worst allowed request of feature ``name`` (``CASES``), variant
    ``k``. ``max_prompt_bytes``: the server's early prompt-length bound (ServingInfo)."""
    base = {"prompt": "The king said", "max_tokens": WORST_MAX_TOKENS, "ignore_eos": True}
    if name == "plain":  # the control: a request of the same size without the feature
        return COMPL, base
    if name == "bad_words":
        size = MAX_BAD_WORDS_CHARS // MAX_BAD_WORDS
        words = [_letters(k * MAX_BAD_WORDS + i, size) for i in range(MAX_BAD_WORDS)]
        return COMPL, {**base, "bad_words": words}
    if name in ("plain_n128", "bad_words_n128"):  # F1's per-step case: n = 128, 500 words
        body = {"prompt": "Hello", "max_tokens": 4, "n": 128}
        if name == "bad_words_n128":
            body["bad_words"] = [f"w{k}x{i}" for i in range(500)]
        return COMPL, body
    if name == "allowed_token_ids":
        return COMPL, {
            **base,
            "allowed_token_ids": [(k + i) % 4000 for i in range(MAX_ALLOWED_TOKEN_IDS)],
        }
    if name == "logit_bias":
        return COMPL, {
            **base,
            "logit_bias": {str((k + i) % 4000): 0.5 for i in range(MAX_LOGIT_BIAS)},
        }
    if name == "stop":
        stops = [_letters(k * 100 + i, MAX_STOP_STRING_CHARS) for i in range(MAX_STOP_STRINGS)]
        return COMPL, {**base, "stop": stops}
    if name == "heavy_regex_x8":  # F2's case, refused at admission, 8 at once (F2 sent
        # (a{1000}){1000}: 1-4 s of compile thread on this box; this one is refused in ~1 s)
        return COMPL, {
            **base,
            "structured_outputs": {"regex": f"{_letters(k, 3)}(a{{400}}){{400}}"},
        }
    if name == "regex":  # the costliest per-step mask admitted: ~1 ms of CPU at 4k vocabulary
        regex = f"{_letters(k, 3)}(a{{100}}){{100}}"
        return COMPL, {**base, "structured_outputs": {"regex": regex}}
    if name == "choice":
        choices = [f"{_letters(k, 2)} choice {i}" for i in range(MAX_CHOICES)]
        return COMPL, {**base, "structured_outputs": {"choice": choices}}
    if name in ("tool_schemas", "tool_schemas_none"):  # one forced constraint / 128 checks
        body = {
            "messages": [{"role": "user", "content": "Call a tool."}],
            "max_tokens": WORST_MAX_TOKENS,
            "ignore_eos": True,
            "tools": [_tool(i, k) for i in range(MAX_TOOLS)],
            "tool_choice": "required" if name == "tool_schemas" else "none",
        }
        return CHAT, body
    if name == "prompt":  # the longest string the byte bound lets through to the tokenizer
        words = (_letters(k + i, 7) for i in range(max_prompt_bytes // 8))
        return COMPL, {**base, "prompt": " ".join(words)[: max_prompt_bytes - 1]}
    raise ValueError(f"unknown case {name!r}")


CASES = (
    "plain",
    "bad_words",
    "allowed_token_ids",
    "logit_bias",
    "stop",
    "regex",
    "heavy_regex_x8",
    "choice",
    "tool_schemas",
    "tool_schemas_none",
    "prompt",
)


N128_CASES = ("plain_n128", "bad_words_n128")
"""F1's per-step case (benchmark only: it needs ``max_num_seqs`` >= 128)."""


@dataclasses.dataclass
class Ratio:
    """The small request's fastest latency alone and beside the worst case, seconds, and
    their ratio; the worst case's own fastest latency."""

    case: str
    alone_s: float
    beside_s: float
    worst_status: int
    worst_s: float = 0.0

    @property
    def ratio(self) -> float:
        return self.beside_s / self.alone_s


async def _timed(client: Any, url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    r = await client.post(url, json=body)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


async def measure_ratio(client: Any, name: str, max_prompt_bytes: int, reps: int = 3) -> Ratio:
    """Times ``SMALL`` alone and beside ``worst_case(name, k)``, ``reps`` times each,
    interleaved, after one untimed round that compiles what the case uses (sampler variants).
    ``client``: an ``httpx.AsyncClient`` on the server."""
    alone, beside, worst_times = [], [], []
    status = 0
    for k in range(reps + 1):
        url, body = worst_case(name, k, max_prompt_bytes)
        t_alone = await _timed(client, COMPL, SMALL)
        t0 = time.perf_counter()
        copies = 8 if name.endswith("_x8") else 1
        worst = [asyncio.ensure_future(client.post(url, json=body)) for _ in range(copies)]
        await asyncio.sleep(0.005)  # the worst request is in its preprocessing
        t_beside = await _timed(client, COMPL, SMALL)
        status = max([(await w).status_code for w in worst])
        t_worst = time.perf_counter() - t0
        if k:  # round 0 warms up
            alone.append(t_alone)
            beside.append(t_beside)
            worst_times.append(t_worst)
    return Ratio(name, min(alone), min(beside), status, min(worst_times))
