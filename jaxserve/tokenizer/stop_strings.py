"""Stop strings for streamed generation (OpenAI ``stop``, vLLM ``include_stop_str_in_output``).

Generation stops at the first place in the output text where a stop string ends (the match
that a reader scanning the text character by character would see first); the text is cut
right before that stop string, or right after it with ``include_stop_str_in_output``.

Streaming must never show text that is later cut off, so the text is released in two
steps: :meth:`StopChecker.check` looks for a match ending in the newly appended characters
(only the tail ``len(new) + len(longest stop) - 1`` characters can hold one, as in vLLM's
``check_stop_strings``), and :meth:`StopChecker.holdback` gives how many trailing characters
must be withheld because they could be the start of a stop string completed by later text.
Unlike vLLM V1, which withholds a fixed ``max(len(stop)) - 1`` characters, only a trailing
run that really is a proper prefix of some stop string is withheld.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Finds stop strings in growing output text.

    Args:
      stop: the stop strings (non-empty strings; duplicates allowed).
      include_stop_str_in_output: keep the matched stop string in the output text.

    Raises:
      ValueError: ``stop`` is not a list of non-empty strings (field ``stop``).
    """

    def __init__(self, stop: Sequence[str] | None, include_stop_str_in_output: bool = False):
        stop = list(stop or [])
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string")
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_len = max((len(s) for s in stop), default=0)

    def check(self, text: str, num_new_chars: int) -> tuple[str | None, int]:
        """Looks for a stop string ending in the last ``num_new_chars`` characters of ``text``.

        The caller guarantees no match ends earlier (it called ``check`` on every growth).

        Returns:
          ``(stop_str, cut)``: the matched stop string and the length the output text must be
          truncated to (before the match, or after it with ``include_stop_str_in_output``);
          ``(None, len(text))`` when nothing matched.
        """
        if not self.stop or num_new_chars <= 0:
            return None, len(text)
        first_new = len(text) - num_new_chars
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            start = text.find(s, max(0, first_new - len(s) + 1))
            if start == -1:
                continue
            end = start + len(s)
            if best is None or (end, start) < best[:2]:
                best = (end, start, s)
        if best is None:
            return None, len(text)
        end, start, s = best
        return s, end if self.include_stop_str_in_output else start

    def holdback(self, text: str) -> int:
        """Number of trailing characters of ``text`` that are a proper prefix of a stop
        string (the longest such run), i.e. that must not be streamed yet.

        Cost: per stop string ``s``, a scan of the last ``len(s) - 1`` characters for ``s[0]``
        and one ``startswith`` per hit; never more than the tail, whatever the output length.
        """
        best = 0
        for s in self.stop:
            tail = text[len(text) - min(len(s) - 1, len(text)) :]
            i = tail.find(s[0])
            # The first hit from the left that starts a prefix of s is the longest one.
            while i != -1 and len(tail) - i > best:
                if s.startswith(tail[i:]):
                    best = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return best
