"""The tokenizer interface shared by the sentencepiece and Hugging Face ``tokenizers`` backends.

A model directory holds either a sentencepiece ``tokenizer.model`` or a Hugging Face
``tokenizer.json``, next to the optional ``tokenizer_config.json`` (special tokens,
``add_bos_token``, ``chat_template``), ``chat_template.jinja``, ``generation_config.json`` and
``config.json`` (extra EOS ids). ``jaxserve.tokenizer.loading.get_tokenizer`` picks the backend.
"""

from __future__ import annotations

import abc
import functools
import json
import os
from collections.abc import Sequence
from typing import Any

from jaxserve.tokenizer.chat_template import render_chat_template, select_chat_template

REPLACEMENT_CHAR = "\ufffd"  # what decoding gives for an incomplete UTF-8 character


def _token_content(tok: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def read_json_object(path: str) -> dict[str, Any]:
    """The JSON object in ``path``; {} when the file does not exist.

    Raises:
      ValueError: the file is not valid JSON or not an object (naming the path).
    """
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


TOOL_PROBE_NAME = "jaxserve_probe_tool"
"""The tool :meth:`Tokenizer.template_shows_tools` renders to see whether tools reach the prompt."""


class Tokenizer(abc.ABC):
    """Text <-> token ids for one model, plus its special tokens and chat template.

    Subclasses implement the backend primitives (``_encode_plain``, ``_decode_plain``,
    ``convert_ids_to_tokens``, ``_token_to_id``, ``vocab_size``, ``_backend_special_ids``);
    this class adds the Hugging Face ``tokenizer_config.json`` semantics on top.

    Attributes:
      bos_token, eos_token: the special tokens' text, or None.
      bos_token_id, eos_token_id: their ids, or None.
      eos_token_ids: every id that ends generation: ``eos_token_id`` plus the
        ``eos_token_id`` entries (int or list) of generation_config.json and config.json.
      add_bos_token, add_eos_token: whether ``encode(..., add_special_tokens=True)`` adds them.
      chat_template: the tokenizer's chat template (str, or list of named templates), or None.
    """

    def __init__(
        self,
        model_dir: str,
        config: dict[str, Any],
        default_add_bos: bool,
        extra_eos_ids: Sequence[int] | None = None,
    ):
        """``extra_eos_ids`` given (a GGUF file carries its own): generation_config.json,
        config.json and chat_template.jinja are not read from ``model_dir``."""
        self.model_dir = model_dir
        self.config = config
        # stream_text's cache per skip_special_tokens value, and its two reference ids (None:
        # not chosen yet; (): this backend gets no fast path)
        self._stream_texts: dict[bool, dict[int, str | None]] = {False: {}, True: {}}
        self._shows_tools: bool | None = None  # template_shows_tools(), once known
        self._stream_refs: tuple[int, ...] | None = None
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.add_bos_token = bool(config.get("add_bos_token", default_add_bos))
        self.add_eos_token = bool(config.get("add_eos_token", False))
        self.chat_template = config.get("chat_template")
        if extra_eos_ids is not None:
            self._extra_eos = [int(i) for i in extra_eos_ids]
            self._bos_fallback = None
            return
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                self.chat_template = f.read()
        gen = read_json_object(os.path.join(model_dir, "generation_config.json"))
        hf = read_json_object(os.path.join(model_dir, "config.json"))
        self._extra_eos = _as_id_list(gen.get("eos_token_id")) + _as_id_list(hf.get("eos_token_id"))
        bos_fallback = gen.get("bos_token_id", hf.get("bos_token_id"))
        self._bos_fallback = bos_fallback if isinstance(bos_fallback, int) else None

    # ---- backend primitives -------------------------------------------------------------
    @abc.abstractmethod
    def _encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added."""

    @abc.abstractmethod
    def _decode_plain(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        """Text of ``ids``; special tokens dropped or rendered as their text."""

    @abc.abstractmethod
    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of ``ids`` (e.g. "▁the", "<0x0A>", "Ġthe")."""

    @abc.abstractmethod
    def _token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string, or None."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""

    @abc.abstractmethod
    def _backend_special_ids(self) -> set[int]:
        """Ids the backend itself marks special (sentencepiece control/unknown pieces,
        ``tokenizers`` added tokens with ``special=True``)."""

    # ---- shared behaviour --------------------------------------------------------------------
    def _lookup(self, token: str | None) -> int | None:
        return None if token is None else self._token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        """Id of ``bos_token``; else ``bos_token_id`` of generation_config.json / config.json;
        else None."""
        found = self._lookup(self.bos_token)
        return found if found is not None else self._bos_fallback

    @property
    def eos_token_id(self) -> int | None:
        """Id of ``eos_token``; else the first ``eos_token_id`` of generation_config.json /
        config.json; else None."""
        found = self._lookup(self.eos_token)
        if found is not None:
            return found
        return self._extra_eos[0] if self._extra_eos else None

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: ``eos_token_id`` plus all ``eos_token_id`` entries
        of generation_config.json and config.json (Llama 3 lists several)."""
        ids = set(self._extra_eos)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return ids

    @functools.cached_property
    def special_id_set(self) -> frozenset[int]:
        """Every special token id (bos, eos, unk, pad and the backend's own), as a set."""
        ids = set(self._backend_special_ids())
        for tok in (self.bos_token, self.eos_token, self.unk_token, self.pad_token):
            tid = self._lookup(tok)
            if tid is not None:
                ids.add(tid)
        return frozenset(ids)

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of every special token (bos, eos, unk, pad and the backend's own)."""
        return sorted(self.special_id_set)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the BOS (and EOS) the
        tokenizer config asks for are added, as transformers' Llama tokenizers do.

        Raises:
          ValueError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        ids = self._encode_plain(text)
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids = [self.bos_token_id] + ids
            if self.add_eos_token and self.eos_token_id is not None:
                ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``.

        Raises:
          ValueError: an id is outside ``[0, vocab_size)``.
        """
        ids = [int(i) for i in ids]
        self.check_ids(ids)
        return self.decode_checked_ids(ids, skip_special_tokens)

    def check_ids(self, ids: list[int]) -> None:
        """Raises ValueError naming the first id outside ``[0, vocab_size)``."""
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def stream_text(self, token_id: int, skip_special_tokens: bool = True) -> str | None:
        """The text ``token_id`` adds when decoded after complete, non-empty text, if that does
        not depend on its neighbours; None when it may (a byte piece of a multi-byte character,
        a decoder that merges or strips around it). Checked once per id against two reference
        tokens (before it, and after it), then cached: the incremental detokenizer's fast path.
        ``token_id`` must be in range (see :meth:`check_ids`)."""
        cache = self._stream_texts[skip_special_tokens]
        try:
            return cache[token_id]
        except KeyError:
            pass
        text = self._probe_stream_text(token_id, skip_special_tokens)
        cache[token_id] = text
        return text

    def _probe_stream_text(self, token_id: int, skip: bool) -> str | None:
        refs = self._stream_refs
        if refs is None:
            try:  # two ordinary word tokens ("▁a"/"▁the" in sentencepiece, "a"/"the" in BPE)
                refs = tuple(self._encode_plain(word)[-1] for word in ("a", "the"))
            except Exception:  # a backend that cannot encode: no fast path
                refs = ()
            if len(set(refs)) != 2 or any(self.decode([r]) == "" for r in refs):
                refs = ()
            self._stream_refs = refs
        if not refs:
            return None
        r1, r2 = refs
        decode = self._decode_plain
        before = decode([r1], skip)
        with_it = decode([r1, token_id], skip)
        text = with_it[len(before) :]
        if (
            not with_it.startswith(before)
            or REPLACEMENT_CHAR in text
            or decode([r2, token_id], skip) != decode([r2], skip) + text
            or decode([r1, token_id, r2], skip) != with_it + decode([r1, r2], skip)[len(before) :]
        ):
            return None
        return text

    def decode_checked_ids(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """``decode`` for a list of ints already passed through :meth:`check_ids` (the
        incremental detokenizer's per-step windows: each id is checked once, on arrival)."""
        return self._decode_plain(ids, skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders a conversation to the prompt text, as transformers'
        ``apply_chat_template(..., tokenize=False)`` does.

        The template is ``chat_template`` if given, else the tokenizer's, else
        :data:`jaxserve.tokenizer.chat_template.DEFAULT_CHAT_TEMPLATE` (ChatML). The result
        usually starts with the BOS text when the template writes ``{{ bos_token }}``: tokenize
        it with ``add_special_tokens=False`` then (see :meth:`encode_chat`).

        Raises:
          ValueError: malformed ``messages`` (naming e.g. ``messages[1].content``), or the
            template called ``raise_exception``.
        """
        template = select_chat_template(chat_template or self.chat_template, tools)
        special = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "unk_token": self.unk_token or "",
            "pad_token": self.pad_token or "",
        }
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=special,
            **kwargs,
        )

    def template_shows_tools(self) -> bool:
        """True when the chat template writes a request's ``tools`` into the prompt (a probe
        tool's name appears in the rendered text), so the model can see them and call one on
        its own (``tool_choice: "auto"``). Templates without tool support (the bundled model's,
        SmolLM2's GGUF template, the default ChatML) drop them silently. Probed once."""
        if self._shows_tools is None:
            probe = {
                "type": "function",
                "function": {
                    "name": TOOL_PROBE_NAME,
                    "description": "probe",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
            try:
                text = self.apply_chat_template([{"role": "user", "content": "hi"}], True, [probe])
            except ValueError:  # the template refuses tools outright
                text = ""
            self._shows_tools = TOOL_PROBE_NAME in text
        return self._shows_tools

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Prompt token ids of a conversation: the rendered template, with the BOS added only
        when the rendered text does not already start with it (vLLM's chat serving)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        has_bos = bool(self.bos_token) and text.startswith(self.bos_token)
        return self.encode(text, add_special_tokens=not has_bos)
