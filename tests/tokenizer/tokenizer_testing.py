"""Helpers for the tokenizer tests: paths, training text, templates, a piece-list tokenizer."""

from __future__ import annotations

import os
from collections.abc import Sequence

from jaxserve.tokenizer.tokenizer import Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_LLAMA = os.path.join(REPO, "checkpoints", "tiny-llama")

TRAIN_TEXT = [
    "Once upon a time there was a little king who lived in a castle.",
    "The quick brown fox jumps over the lazy dog, and the dog sleeps.",
    "Hello world! How are you today? I am fine, thank you.",
    "In the beginning God created the heaven and the earth.",
    "héllo wörld, naïve café, 世界 and 🙂 are multi-byte characters.",
    "Numbers like 12345 and 2026 appear in text sometimes.",
] * 20

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


class PieceTokenizer(Tokenizer):
    """A tokenizer over a fixed list of strings, decoding by concatenation: exact control of
    token boundaries for the stop-string tests. Id 0 is "<s>", id 1 is "</s>"."""

    def __init__(self, pieces: Sequence[str]):
        self.pieces = ["<s>", "</s>", *pieces]
        super().__init__(
            "/nonexistent", {"bos_token": "<s>", "eos_token": "</s>"}, default_add_bos=True
        )

    def ids(self, *pieces: str) -> list[int]:
        return [self.pieces.index(p) for p in pieces]

    def _encode_plain(self, text):
        raise NotImplementedError

    def _decode_plain(self, ids, skip_special_tokens):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i < 2))

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]

    def _token_to_id(self, token):
        return self.pieces.index(token) if token in self.pieces else None

    @property
    def vocab_size(self):
        return len(self.pieces)

    def _backend_special_ids(self):
        return {0, 1}
