"""StopChecker: where a stop string matches, and what must be withheld from the stream."""

from __future__ import annotations

import pytest

from jaxserve.tokenizer import StopChecker


def test_match_cut_before_or_after():
    checker = StopChecker(["END"])
    assert checker.check("hello END there", 15) == ("END", 6)
    assert StopChecker(["END"], include_stop_str_in_output=True).check("hello END there", 15) == (
        "END",
        9,
    )
    assert checker.check("hello there", 11) == (None, 11)


def test_only_the_tail_is_searched():
    # A match ending before the new characters was (by contract) already reported; the
    # search starts len(stop) - 1 characters before the new ones.
    checker = StopChecker(["ab"])
    assert checker.check("ab xyz", 3) == (None, 6)
    assert checker.check("xa" + "b", 1) == ("ab", 1)


def test_earliest_ending_match_wins():
    # "bc" ends before "abcd" does, whatever the list order: a character-by-character stream
    # would have stopped there.
    checker = StopChecker(["abcd", "bc"])
    assert checker.check("xabcd", 5) == ("bc", 2)
    # Same end: the longer (earlier-starting) one.
    assert StopChecker(["cd", "abcd"], True).check("abcd", 4) == ("abcd", 4)
    assert StopChecker(["cd", "bcd"]).check("abcd", 4) == ("bcd", 1)


def test_holdback_is_longest_proper_prefix_suffix():
    checker = StopChecker(["<|end|>", "STOP"])
    assert checker.holdback("hello <|en") == 4
    assert checker.holdback("hello <") == 1
    assert checker.holdback("hello ST") == 2
    assert checker.holdback("hello") == 0
    assert checker.holdback("<|end|") == 6
    assert StopChecker([]).holdback("anything") == 0


@pytest.mark.parametrize("stop", [[""], [None], ["ok", 3]])
def test_bad_stop_names_the_field(stop):
    with pytest.raises(ValueError, match=r"stop\[\d\] must be a non-empty string"):
        StopChecker(stop)
