"""Does a Lark grammar (llguidance's dialect) derive any finite string at all?

llguidance compiles ``start: "a" start`` and lets the matcher emit "a" forever: every string it
allows is a prefix of an infinite one, so a request can only end at ``max_tokens``. This module
answers the question with the textbook productivity fixpoint over the grammar's rules: a rule is
productive when one of its alternatives consists of productive items only; literals, regexes,
special tokens, inline ``%json`` / ``%regex`` bodies and names it cannot see (``%import``) count
as productive; anything optional or starred is productive by itself.

    derives_finite_string(lark_text)   # True, False, or None when the text is not understood

The answer is conservative: None (do not refuse) for any syntax this small reader does not
follow (parametric rules, unbalanced brackets, ...). Linear in the grammar's length, plus one
pass per rule until nothing changes (at most as many passes as rules).
"""

from __future__ import annotations

import re

_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\r\n]+)
  | (?P<comment>(?://|\#)[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<special><[^<>\n]*>)
  | (?P<directive>%[A-Za-z_]+)
  | (?P<number>\d+(?:\.\d+)?)
  | (?P<name>[A-Za-z_][A-Za-z0-9_\-]*(?:\.-?\d+)?)
  | (?P<range>\.\.)
  | (?P<arrow>->)
  | (?P<op>[|()\[\]?*+~:{},&!=])
    """,
    re.VERBOSE,
)

_LITERAL = "lit"  # an always-productive atom


class _Unknown(Exception):
    """The grammar uses syntax this reader does not follow."""


def _tokens(text: str) -> list[tuple[str, str]]:
    """(kind, text) pairs; ``%json {...}`` / ``%regex {...}`` bodies become one literal."""
    out: list[tuple[str, str]] = []
    pos = 0
    n = len(text)
    while pos < n:
        m = _TOKEN.match(text, pos)
        if m is None:
            raise _Unknown(f"unexpected character {text[pos]!r}")
        kind = m.lastgroup
        pos = m.end()
        if kind in ("ws", "comment"):
            if kind == "ws" and "\n" in m.group():
                out.append(("nl", "\n"))
            continue
        value = m.group()
        if kind == "directive":
            if value in ("%json", "%regex", "%llguidance"):
                pos = _skip_braces(text, pos)
                out.append(("lit", value) if value != "%llguidance" else ("nl", "\n"))
                continue
            # %import / %ignore / %declare ...: the rest of the line is not a rule
            end = text.find("\n", pos)
            pos = n if end < 0 else end
            continue
        out.append((kind, value))
    return out


def _skip_braces(text: str, pos: int) -> int:
    """Index after the balanced ``{...}`` that starts at or after ``pos`` (JSON strings
    inside may hold braces)."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    if pos >= len(text) or text[pos] != "{":
        raise _Unknown("directive without a {...} body")
    depth = 0
    in_string = False
    i = pos
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise _Unknown("unbalanced {")


def _definitions(tokens: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Rule / terminal name -> the tokens of its body (every definition starts a line with
    ``[?!]name[attrs]:``)."""
    defs: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    i = 0
    at_line_start = True
    while i < len(tokens):
        kind, value = tokens[i]
        if kind == "nl":
            at_line_start = True
            i += 1
            continue
        if at_line_start and (kind == "name" or (kind, value) in (("op", "?"), ("op", "!"))):
            header = _header(tokens, i)
            if header is not None:
                name, i = header
                if name in defs:
                    raise _Unknown(f"{name} defined twice")
                current = defs[name] = []
                at_line_start = False
                continue
        if current is None:
            raise _Unknown("text before the first rule")
        current.append((kind, value))
        at_line_start = False
        i += 1
    return defs


def _header(tokens: list[tuple[str, str]], i: int) -> tuple[str, int] | None:
    """``(name, index after ':')`` when a definition header starts at ``i``, else None."""
    if tokens[i] == ("op", "?") or tokens[i] == ("op", "!"):
        i += 1
    if i >= len(tokens) or tokens[i][0] != "name":
        return None
    name = tokens[i][1].split(".")[0]
    i += 1
    if i < len(tokens) and tokens[i] == ("op", "["):  # attributes: name[lazy, stop="x"]
        depth = 0
        while i < len(tokens):
            if tokens[i] == ("op", "["):
                depth += 1
            elif tokens[i] == ("op", "]"):
                depth -= 1
                if depth == 0:
                    break
            i += 1
        i += 1
    if i < len(tokens) and tokens[i] == ("op", ":"):
        if i + 1 < len(tokens) and tokens[i + 1] == ("op", ":"):
            raise _Unknown("parametric rules")
        return name, i + 1
    return None


class _Parser:
    """Recursive descent over one body: expansions := seq ('|' seq)*, an expression tree of
    ("or", [..]), ("and", [..]), ("ref", name), ("lit", ...), ("true", ...)."""

    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.t = [tok for tok in tokens if tok[0] != "nl"]
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise _Unknown("unexpected end of a rule")
        self.i += 1
        return tok

    def parse(self) -> tuple:
        node = self.expansions()
        if self.peek() is not None:
            raise _Unknown(f"unexpected {self.peek()[1]!r}")
        return node

    def expansions(self) -> tuple:
        alts = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.take()
            alts.append(self.sequence())
        return ("or", alts)

    def sequence(self) -> tuple:
        items = []
        while True:
            tok = self.peek()
            if tok is None or tok in (("op", "|"), ("op", ")"), ("op", "]")):
                break
            if tok[0] == "arrow":  # "-> alias" ends the alternative
                self.take()
                self.take()
                continue
            if tok == ("op", "&"):  # terminal intersection: both sides must match
                self.take()
                continue
            items.append(self.item())
        return ("and", items)

    def item(self) -> tuple:
        tok = self.take()
        kind, value = tok
        if kind == "op" and value == "~":  # prefix negation (terminals): matches something
            self.item()
            node: tuple = ("true",)
        elif kind == "op" and value == "!":
            node = self.item()
        elif kind == "op" and value == "(":
            node = self.expansions()
            if self.take() != ("op", ")"):
                raise _Unknown("unbalanced (")
        elif kind == "op" and value == "[":
            self.expansions()
            if self.take() != ("op", "]"):
                raise _Unknown("unbalanced [")
            node = ("true",)
        elif kind in ("string", "regex", "special", "lit"):
            node = (_LITERAL,)
            if kind == "string" and self.peek() == ("range", ".."):
                self.take()
                if self.take()[0] != "string":
                    raise _Unknown("bad range")
        elif kind == "name":
            node = ("ref", value.split(".")[0])
        else:
            raise _Unknown(f"unexpected {value!r}")
        return self.postfix(node)

    def postfix(self, node: tuple) -> tuple:
        while True:
            tok = self.peek()
            if tok in (("op", "?"), ("op", "*")):
                self.take()
                node = ("true",)
            elif tok == ("op", "+"):
                self.take()
            elif tok == ("op", "~"):  # expr ~ n or expr ~ n..m
                self.take()
                low = self.take()
                if low[0] != "number":
                    raise _Unknown("bad ~ repetition")
                if self.peek() == ("range", ".."):
                    self.take()
                    self.take()
                if int(low[1]) == 0:
                    node = ("true",)
            elif tok == ("op", "{"):  # expr{m,n}
                self.take()
                low = None
                while self.peek() != ("op", "}"):
                    part = self.take()
                    if part[0] == "number" and low is None:
                        low = int(part[1])
                    elif part == ("op", ","):
                        low = 0 if low is None else low
                    elif part[0] != "number":
                        raise _Unknown("bad {m,n}")
                self.take()
                if not low:
                    node = ("true",)
            else:
                return node


def _productive(node: tuple, known: dict[str, bool], defined: set[str]) -> bool:
    kind = node[0]
    if kind in (_LITERAL, "true"):
        return True
    if kind == "ref":
        name = node[1]
        return known.get(name, False) if name in defined else True  # imported: assume yes
    if kind == "or":
        return any(_productive(n, known, defined) for n in node[1])
    return all(_productive(n, known, defined) for n in node[1])  # "and"


def derives_finite_string(lark_text: str, start: str = "start") -> bool | None:
    """True when ``start`` derives at least one finite string, False when it derives none (an
    unproductive start such as ``start: "a" start``), None when the text uses syntax this
    reader does not follow or defines no ``start``."""
    try:
        defs = _definitions(_tokens(lark_text))
        trees = {name: _Parser(body).parse() for name, body in defs.items()}
    except (_Unknown, IndexError, ValueError):
        return None
    if start not in trees:
        return None
    defined = set(trees)
    known: dict[str, bool] = {}
    changed = True
    while changed:
        changed = False
        for name, tree in trees.items():
            if not known.get(name) and _productive(tree, known, defined):
                known[name] = True
                changed = True
    return bool(known.get(start))
