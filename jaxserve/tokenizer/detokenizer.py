"""Incremental detokenization: stream the text of generated tokens as they arrive.

Follows vLLM's ``detokenize_incrementally`` (two offsets into the token list): each step
decodes a short window ``ids[prefix_offset:]`` and the already-emitted part of it,
``ids[prefix_offset:read_offset]``, and emits the difference. Decoding a window instead of
single tokens keeps what per-token decoding loses:

* sentencepiece word-boundary spaces: decoding ``["▁time"]`` alone gives "time", but inside a
  window that starts a few tokens earlier the "▁" stays a space. The window starts up to 5
  tokens before the first generated token (inside the prompt), so the first generated
  token's space appears.
* multi-byte UTF-8 characters split over byte-fallback tokens (``<0xF0><0x9F><0x99><0x82>``
  is one emoji): while the window's text ends in U+FFFD the character is incomplete, and
  nothing is emitted until it completes (or the request finishes).

Invariant (tested): ``decode(prompt_ids) + "".join(deltas) == decode(prompt_ids + output_ids)``
when the prompt's text is complete (does not end in a partial character), i.e. the joined
deltas are the continuation of the prompt text, spaces included, truncated at a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.tokenizer.stop_strings import StopChecker
from jaxserve.tokenizer.tokenizer import REPLACEMENT_CHAR, Tokenizer

INITIAL_OFFSET = 5
"""Prompt tokens decoded before the first generated token (vLLM's
``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``)."""


class IncrementalDetokenizer:
    """Turns one request's generated token ids into streamed text deltas, with stop strings.

    Args:
      tokenizer: the model's tokenizer.
      prompt_token_ids: the prompt (its last few tokens give the first output token its
        leading space).
      skip_special_tokens: drop special tokens from the text (OpenAI default True).
      stop: stop strings, see :class:`~jaxserve.tokenizer.stop_strings.StopChecker`.
      include_stop_str_in_output: keep the matched stop string in the text.

    Attributes:
      output_text: all text decoded so far (an incomplete trailing UTF-8 character excluded
        until it completes or the request finishes), truncated at a stop string. It can be
        ahead of the concatenated deltas by the characters withheld as a possible stop-string
        prefix.
      token_ids: the generated token ids received so far.
      stop_str: the stop string that ended generation, or None.

    Raises:
      ValueError: bad ``stop`` (field ``stop``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_checker = StopChecker(stop, include_stop_str_in_output)
        self._ids: list[int] = [int(t) for t in prompt_token_ids]
        tokenizer.check_ids(self._ids)
        self._num_prompt = len(self._ids)
        self.read_offset = self._num_prompt
        self.prefix_offset = self._initial_prefix_offset()
        self.output_text = ""
        self.stop_str: str | None = None
        self.finished = False
        self._num_emitted = 0  # characters of output_text already returned as deltas
        # the window's text is known complete and non-empty (set once a window step emitted)
        self._clean = False

    def _initial_prefix_offset(self) -> int:
        offset = max(self.read_offset - INITIAL_OFFSET, 0)
        if self.skip_special_tokens:
            # The window must hold a non-special prompt token, or the first generated
            # sentencepiece token would lose its leading space to the dummy-prefix rule.
            special = self.tokenizer.special_id_set
            last_text = self.read_offset - 1
            while last_text >= 0 and self._ids[last_text] in special:
                last_text -= 1
            if last_text >= 0:
                offset = min(offset, last_text)
        return offset

    @property
    def token_ids(self) -> list[int]:
        """The output token ids seen so far (prompt excluded); a fresh list."""
        return self._ids[self._num_prompt :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode_checked_ids(ids, self.skip_special_tokens)

    def _decode_new_text(self, finished: bool) -> str:
        """vLLM's ``detokenize_incrementally`` step: the stable text of the tokens after
        ``read_offset``; advances the offsets when it returns text."""
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (
            new_text.endswith(REPLACEMENT_CHAR) and not finished
        ):
            return ""  # nothing new, or an incomplete UTF-8 character: wait for more tokens
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        self._clean = not new_text.endswith(REPLACEMENT_CHAR)
        return new_text[len(prefix_text) :]

    def _stream_one(self, token_id: int) -> str | None:
        """The window step for one new token without decoding, when its text cannot depend on
        its neighbours (``Tokenizer.stream_text``) and the window before it decoded complete:
        then decoding the window with it gives the window's text plus the token's text. Same
        offsets and result as ``_decode_new_text``; None when it does not apply."""
        if not self._clean or self.read_offset != len(self._ids):
            return None
        text = self.tokenizer.stream_text(token_id, self.skip_special_tokens)
        if text is None:
            return None
        self._ids.append(token_id)
        if text:
            self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        return text

    def update(
        self, new_token_ids: Sequence[int], finished: bool = False
    ) -> tuple[str, str | None]:
        """Adds generated tokens and returns the text that can be streamed now.

        Args:
          new_token_ids: the tokens sampled since the last call (may be empty).
          finished: the request ends with these tokens (EOS, length, stop token, abort):
            everything withheld is released (an incomplete character decodes to U+FFFD).
            As in vLLM V1, a caller that stops on an EOS or ``stop_token_ids`` token leaves
            that token out of ``new_token_ids`` unless its text should appear.

        Returns:
          ``(delta_text, stop_str)``: the new text to stream, and the stop string if one
          matched (then the request is finished and later calls return ``("", None)``).
        """
        if self.finished:
            return "", None
        new_ids = [int(t) for t in new_token_ids]
        self.tokenizer.check_ids(new_ids)
        new_text = self._stream_one(new_ids[0]) if len(new_ids) == 1 else None
        if new_text is None:
            self._ids += new_ids
            new_text = self._decode_new_text(finished)
        self.output_text += new_text
        stop_str, cut = self.stop_checker.check(self.output_text, len(new_text))
        if stop_str is not None:
            self.output_text = self.output_text[:cut]
            self.stop_str = stop_str
            finished = True
        self.finished = finished
        end = len(self.output_text)
        if not finished:
            end -= self.stop_checker.holdback(self.output_text)
        # Holdback and cut never reach into streamed text (see stop_strings' module doc).
        assert end >= self._num_emitted, (end, self._num_emitted)
        delta = self.output_text[self._num_emitted : end]
        self._num_emitted = end
        return delta, stop_str
