"""Hugging Face ``tokenizer.json`` backend, on the ``tokenizers`` library (Llama 3, Qwen, Mistral).

Special tokens are added the way transformers' fast tokenizers do: by the tokenizer.json
post-processor, unless tokenizer_config.json sets ``add_bos_token``/``add_eos_token`` (Llama
style), in which case those flags decide (transformers' ``LlamaTokenizerFast`` rewrites its
post-processor from them). Decoding never applies transformers' optional
``clean_up_tokenization_spaces`` rewrite, so decoding stays prefix-stable for the incremental
detokenizer (vLLM does the same when streaming).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tokenizers

from jaxserve.tokenizer.tokenizer import Tokenizer


class HFTokenizer(Tokenizer):
    """:class:`Tokenizer` over a ``tokenizers`` JSON file.

    Raises (constructor):
      ValueError: the file cannot be parsed by ``tokenizers`` (naming the path).
    """

    def __init__(self, json_file: str, model_dir: str, config: dict[str, Any]):
        super().__init__(model_dir, config, default_add_bos=False)
        try:
            tok = tokenizers.Tokenizer.from_file(json_file)
        except Exception as e:  # tokenizers raises its own Exception subclass
            raise ValueError(f"{json_file}: not a tokenizers JSON file ({e})") from e
        self._set_backend(tok, json_file, config)

    def _set_backend(self, tok: tokenizers.Tokenizer, json_file: str, config: dict[str, Any]):
        """Takes ``tok`` as the backend (also used by the GGUF tokenizer, which builds it)."""
        self.tok = tok
        self.json_file = json_file
        self._config_adds_specials = "add_bos_token" in config or "add_eos_token" in config
        added = self.tok.get_added_tokens_decoder()
        self._special = {i for i, t in added.items() if t.special}
        self._vocab_size = max(
            [self.tok.get_vocab_size(with_added_tokens=True)] + [i + 1 for i in added]
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (1 + the largest id)."""
        return self._vocab_size

    def _backend_special_ids(self) -> set[int]:
        return set(self._special)

    def _token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of ``ids`` (byte-level BPE pieces such as "Ġthe"); None for
        an id ``tokenizers`` does not know."""
        return [self.tok.id_to_token(int(i)) for i in ids]

    def _encode_plain(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. When tokenizer_config.json sets ``add_bos_token`` or
        ``add_eos_token`` (or ``add_special_tokens`` is False) the base class adds them;
        otherwise tokenizer.json's own post-processor adds its special tokens (e.g. Llama 3's
        ``<|begin_of_text|>``), as transformers' fast tokenizers do.

        Raises:
          ValueError: ``text`` is not a string.
        """
        if self._config_adds_specials or not add_special_tokens:
            return super().encode(text, add_special_tokens)
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        return self.tok.encode(text, add_special_tokens=True).ids

    def _decode_plain(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            special = self.special_id_set
            ids = [i for i in ids if i not in special]
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
