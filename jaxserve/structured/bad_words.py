"""vLLM's ``bad_words`` rule as an automaton: per step, O(new tokens) plus the banned ids.

The rule: a word (a token sequence) bans its last token whenever the output ends with the rest
of it (a one-token word is always banned, which ``TokenMaskPlan`` folds into a fixed mask row).
Checking every word against the output's tail each step costs ``O(words)`` per request and step
(F1 of #38: ``n = 128`` x 500 words made every step 3x slower). Here the words' prefixes (all
but the last token) form an Aho-Corasick automaton over token ids: a request keeps one node,
the longest suffix of its output that is a prefix of some word; each new output token moves it
(amortised O(1)), and the node lists the last tokens its suffixes ban (computed once per node,
shared by every request of the plan).

Building it costs one dict step per token of the words (the trie); the failure links are found
on first use, so a plan is ready in time linear in the words with a small constant, and a
generation pays only for the nodes its output reaches.

    words = BadWords([(5, 9), (5, 7, 3)])
    node = words.advance(BadWords.ROOT, [5])     # output so far ends with 5
    words.banned(node)                           # int64 array [9]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

_UNKNOWN = -1


class BadWords:
    """The automaton of a request's multi-token bad words.

    Args:
      words: token sequences of length >= 2 (shorter ones are ignored).

    Built in O(total tokens of the words). Used by the engine thread only (its lazily filled
    links are plain lists); a plan's requests share it.
    """

    ROOT = 0
    """The node of an output that ends with no word's prefix."""

    def __init__(self, words: Iterable[Sequence[int]]) -> None:
        goto: list[dict[int, int]] = [{}]
        parent = [0]
        via = [-1]  # the token on the edge from the parent
        ends: dict[int, list[int]] = {}  # node -> last tokens of words whose prefix ends there
        for word in words:
            if len(word) < 2:
                continue
            node = 0
            for token in word[:-1]:
                children = goto[node]
                nxt = children.get(token)
                if nxt is None:
                    nxt = children[token] = len(goto)
                    goto.append({})
                    parent.append(node)
                    via.append(token)
                node = nxt
            ends.setdefault(node, []).append(word[-1])
        self._goto = goto
        self._parent = parent
        self._via = via
        self._ends = ends
        self._fail = [_UNKNOWN] * len(goto)
        self._fail[0] = 0
        self._banned: dict[int, np.ndarray] = {}

    @property
    def num_nodes(self) -> int:
        """Nodes of the automaton (the root included)."""
        return len(self._goto)

    def _step(self, node: int, token: int) -> int:
        """The node after ``token`` from ``node`` (following failure links)."""
        goto = self._goto
        while True:
            nxt = goto[node].get(token)
            if nxt is not None:
                return nxt
            if node == 0:
                return 0
            node = self._failure(node)

    def _failure(self, node: int) -> int:
        """The node of the longest proper suffix of ``node``'s path that is a trie path
        (computed on first use, ancestors first, without recursion)."""
        fail = self._fail
        if fail[node] != _UNKNOWN:
            return fail[node]
        chain = []
        at = node
        while fail[at] == _UNKNOWN:
            chain.append(at)
            at = self._parent[at]
        for at in reversed(chain):  # each one's parent is known by now
            up = self._parent[at]
            fail[at] = 0 if up == 0 else self._step(fail[up], self._via[at])
        return fail[node]

    def advance(self, node: int, tokens: Iterable[int]) -> int:
        """The node after the output grew by ``tokens``."""
        for token in tokens:
            node = self._step(node, token)
        return node

    def banned(self, node: int) -> np.ndarray:
        """int64 [k]: the token ids banned after an output whose automaton node is ``node``
        (the last tokens of every word whose prefix is a suffix of the output)."""
        found = self._banned.get(node)
        if found is None:
            ids: list[int] = []
            at = node
            while at:
                ids.extend(self._ends.get(at, ()))
                at = self._failure(at)
            found = self._banned[node] = np.unique(np.asarray(ids, np.int64))
        return found
