"""Engine logprobs (``list[dict[token_id, Logprob]]``) in OpenAI's two response shapes.

Completions (legacy, OpenAI's ``Logprobs`` object)::

    {"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} | None],
     "text_offset": [int]}

``top_logprobs[i]`` maps the text of each of the step's top alternatives *and* the chosen token
to its logprob (vLLM's behaviour); the first prompt token of an echoed prompt has None for both
(no logits precede it). ``text_offset[i]`` is the running sum of the lengths of ``tokens[:i]``
(vLLM's rule), echoed prompt tokens included; it equals the offset in the returned text when the
engine's per-token texts concatenate to it.

Chat (``choices[].logprobs``)::

    {"content": [{"token": str, "logprob": float, "bytes": [int],
                  "top_logprobs": [{"token", "logprob", "bytes"}]}]}

with ``top_logprobs`` the ``top_logprobs`` most probable tokens in rank order. ``bytes`` are the
token's UTF-8 bytes; a sentencepiece byte-fallback piece (``<0xE2>``, part of a character) gives
its one raw byte, so clients can rebuild characters split over tokens.

Logprobs of -inf (a token the bias made impossible) are sent as -9999.0, as vLLM does, since
JSON has no infinity.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from jaxserve.request_output import Logprob

_FLOOR = -9999.0
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


def token_text(token_id: int, logprob: Logprob | None, tokenizer: Any) -> str:
    """The text of one token: the engine's ``decoded_token``, else the tokenizer's decode."""
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_bytes(token_id: int, text: str, tokenizer: Any) -> list[int]:
    """The token's bytes: the raw byte of a byte-fallback piece, else ``text`` in UTF-8."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is not None:
        match = _BYTE_PIECE.fullmatch(convert([token_id])[0])
        if match:
            return [int(match.group(1), 16)]
    return list(text.encode("utf-8"))


class CompletionLogprobs:
    """Builds the legacy completions ``logprobs`` object, token by token.

    Args:
      tokenizer: decodes tokens whose Logprob has no ``decoded_token``.
      text_offset: character offset of the first token added (the length of the text already
        sent, for streaming).
    """

    def __init__(self, tokenizer: Any, text_offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.offset = text_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[dict[int, Logprob] | None] | None,
        num_top: int,
    ) -> None:
        """Appends tokens with their per-position dicts (None: no logits, e.g. prompt position 0).

        Args:
          token_ids: ``[k]`` the chosen tokens.
          logprobs: ``[k]`` dicts ``{token_id: Logprob}`` (or None per position, or None
            altogether when the engine returned none).
          num_top: the request's ``logprobs`` (alternatives per position).
        """
        for i, token in enumerate(token_ids):
            step = logprobs[i] if logprobs is not None and i < len(logprobs) else None
            chosen = step.get(token) if step else None
            text = token_text(token, chosen, self.tokenizer)
            self.tokens.append(text)
            self.text_offset.append(self.offset)
            self.offset += len(text)
            if step is None or chosen is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(_finite(chosen.logprob))
            top: dict[str, float] = {}
            for tid, lp in sorted(step.items(), key=lambda kv: kv[1].rank or 0):
                if tid == token or lp.rank is None or lp.rank <= num_top:
                    top.setdefault(token_text(tid, lp, self.tokenizer), _finite(lp.logprob))
            self.top_logprobs.append(top)

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI ``logprobs`` object of the tokens added so far."""
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob]] | None,
    num_top: int,
    tokenizer: Any,
) -> dict[str, Any]:
    """The chat ``logprobs`` object (``{"content": [...]}``) of generated tokens.

    Args:
      token_ids: ``[k]`` generated token ids.
      logprobs: ``[k]`` dicts ``{token_id: Logprob}`` from the engine (None: no logprobs).
      num_top: the request's ``top_logprobs`` (0..20).
    """
    content = []
    for i, token in enumerate(token_ids):
        step = logprobs[i] if logprobs is not None and i < len(logprobs) else None
        if not step:
            continue
        chosen = step.get(token)
        text = token_text(token, chosen, tokenizer)
        ranked = sorted(
            ((lp.rank or 0, tid, lp) for tid, lp in step.items() if lp.rank is not None),
            key=lambda x: (x[0], x[1]),
        )
        top = []
        seen: set[int] = set()
        for rank, tid, lp in ranked:
            if rank > num_top or tid in seen or len(top) >= num_top:
                continue
            seen.add(tid)
            alt = token_text(tid, lp, tokenizer)
            top.append(
                {
                    "token": alt,
                    "logprob": _finite(lp.logprob),
                    "bytes": token_bytes(tid, alt, tokenizer),
                }
            )
        content.append(
            {
                "token": text,
                "logprob": _finite(chosen.logprob) if chosen else _FLOOR,
                "bytes": token_bytes(token, text, tokenizer),
                "top_logprobs": top,
            }
        )
    return {"content": content}
