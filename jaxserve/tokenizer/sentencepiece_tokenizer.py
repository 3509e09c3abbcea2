"""Sentencepiece ``tokenizer.model`` backend (Llama 1/2, Mistral v0.1, our tiny-llama).

Encoding first splits the text on the special tokens' strings (``<s>``, ``</s>``, ``<unk>``),
which become their ids, as transformers does for text rendered from a chat template; each
text segment in between is encoded by sentencepiece (with its dummy-prefix space, as
transformers' ``LlamaTokenizer`` in legacy mode).

Decoding follows sentencepiece: pieces are concatenated, "▁" becomes a space, byte pieces
``<0xXX>`` are joined into UTF-8 (an invalid or incomplete sequence decodes to U+FFFD), and
the leading space of the first piece of the text is dropped (the "dummy prefix" the encoder
added). With ``skip_special_tokens=False`` control pieces are written as their text
(``<s>``) and the piece after one keeps its leading space, like transformers'
``LlamaTokenizer`` (legacy mode).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import sentencepiece as spm

from jaxserve.tokenizer.tokenizer import Tokenizer


class SentencePieceTokenizer(Tokenizer):
    """:class:`Tokenizer` over a sentencepiece model file.

    Special tokens default to the model's own ``<s>``/``</s>``/``<unk>`` pieces when
    tokenizer_config.json does not name them; ``add_bos_token`` defaults to True (Llama).

    Raises (constructor):
      ValueError: the file is not a sentencepiece model (naming the path).
    """

    def __init__(self, model_file: str, model_dir: str, config: dict[str, Any]):
        super().__init__(model_dir, config, default_add_bos=True)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{model_file}: not a sentencepiece model ({e})") from e
        self.model_file = model_file
        for attr, sp_id in (
            ("bos_token", self.sp.bos_id()),
            ("eos_token", self.sp.eos_id()),
            ("unk_token", self.sp.unk_id()),
            ("pad_token", self.sp.pad_id()),
        ):
            if attr not in config and sp_id >= 0:
                setattr(self, attr, self.sp.id_to_piece(sp_id))
        n = self._vocab_size = self.sp.get_piece_size()
        self._special = {i for i in range(n) if self.sp.is_control(i) or self.sp.is_unknown(i)}

    @property
    def vocab_size(self) -> int:
        """Number of sentencepiece pieces (token ids are ``[0, vocab_size)``)."""
        return self._vocab_size

    def _backend_special_ids(self) -> set[int]:
        return set(self._special)

    def _token_to_id(self, token: str) -> int | None:
        tid = self.sp.piece_to_id(token)
        # piece_to_id answers unk_id for unknown pieces; only trust it for the unk piece itself.
        if tid == self.sp.unk_id() and token != self.sp.id_to_piece(tid):
            return None
        return tid

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The sentencepiece pieces of ``ids`` (e.g. "▁the", "<0x0A>").

        Raises:
          IndexError: from sentencepiece, for an id outside ``[0, vocab_size)``.
        """
        return [self.sp.id_to_piece(int(i)) for i in ids]

    @functools.cached_property
    def _special_split(self) -> tuple[re.Pattern, dict[str, int]]:
        by_text = {self.sp.id_to_piece(i): i for i in self.special_id_set}
        alternatives = sorted(by_text, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, alternatives)) + ")"), by_text

    def _encode_plain(self, text: str) -> list[int]:
        pattern, by_text = self._special_split
        if not by_text:
            return self.sp.encode(text)
        ids: list[int] = []
        for k, segment in enumerate(pattern.split(text)):
            if k % 2:
                ids.append(by_text[segment])
            elif segment:
                ids.extend(self.sp.encode(segment))
        return ids

    def _decode_plain(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        special = self.special_id_set
        if skip_special_tokens:
            return self.sp.decode([i for i in ids if i not in special])
        out, run = [], []
        for i in ids:
            if i in special:
                out.append(self._decode_run(run, at_start=not out))
                out.append(self.sp.id_to_piece(i))
                run = []
            else:
                run.append(i)
        out.append(self._decode_run(run, at_start=not out))
        return "".join(out)

    def _decode_run(self, run: list[int], at_start: bool) -> str:
        text = self.sp.decode(run)
        if run and not at_start and self.sp.id_to_piece(run[0]).startswith("▁"):
            text = " " + text  # sentencepiece dropped the dummy-prefix space; not at text start
        return text
