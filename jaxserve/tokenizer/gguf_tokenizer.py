"""The tokenizer built into a GGUF file, rebuilt with the ``tokenizers`` library.

GGUF stores the vocabulary as ``tokenizer.ggml.*`` metadata: ``model`` ("gpt2": byte-level BPE
with ``merges``, as Llama 3, Qwen and SmolLM; "llama": sentencepiece BPE with ``scores``, as Llama
2 and Mistral), ``pre`` (llama.cpp's name of the pre-tokenizer regex), ``tokens``,
``token_type`` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), special ids,
``add_bos_token`` / ``add_eos_token``, and ``tokenizer.chat_template``. We build the equivalent
``tokenizers.Tokenizer`` and reuse :class:`HFTokenizer` over it.
"""

from __future__ import annotations

import logging
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from jaxserve.tokenizer.hf_tokenizer import HFTokenizer

logger = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = 3, 4
# Pre-tokenizer split patterns of the byte-level BPE families (the tokenizers' own public
# tokenizer.json regexes), by llama.cpp's ``tokenizer.ggml.pre`` name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = ("default", "gpt-2", "gpt2", "olmo", "jais")
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva")


def _byte_level_pre_tokenizer(pre: str | None):
    """The pre-tokenizer for llama.cpp's ``tokenizer.ggml.pre`` name (GPT-2's when unknown)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        split = _LLAMA3_SPLIT
    elif pre in ("qwen2", "deepseek-r1-qwen"):
        split = _QWEN2_SPLIT
    elif pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        if pre not in _GPT2_PRE and pre is not None:
            logger.warning("GGUF pre-tokenizer %r unknown; using GPT-2's", pre)
        return byte_level
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to a sentencepiece BPE vocabulary: every split of a piece into two
    pieces of the vocabulary, the merge of higher-scored pieces first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for piece, pid in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[pid], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def build_gguf_tokenizer(reader, path: str = "") -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """``(tokenizers.Tokenizer, tokenizer_config dict)`` from a ``gguf.GGUFReader``.

    The dict holds ``bos_token`` / ``eos_token`` / ``unk_token`` / ``pad_token`` (text),
    ``add_bos_token``, ``add_eos_token`` and ``chat_template``, as tokenizer_config.json would.

    Raises:
      ValueError: the file has no vocabulary, or a tokenizer model other than "gpt2" / "llama".
    """
    from jaxserve.model.readers.gguf_reader import field

    kind = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"no tokenizer found: {path} has no tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges") or []]
        pre = field(reader, "tokenizer.ggml.pre")
        bpe = models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            ignore_merges=pre in ("llama-bpe", "llama3"),
        )
        tok = tokenizers.Tokenizer(bpe)
        tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
        default_add_bos = False
    elif kind == "llama":
        scores = field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk = field(reader, "tokenizer.ggml.unknown_token_id")
        bpe = models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=_spm_merges(tokens, scores),
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
        tok = tokenizers.Tokenizer(bpe)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if field(reader, "tokenizer.ggml.add_space_prefix", True):
            tok.normalizer = normalizers.Sequence(
                [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
            )
            steps.append(decoders.Strip(" ", 1, 0))
        else:
            tok.normalizer = normalizers.Replace(" ", "▁")
        tok.decoder = decoders.Sequence(steps)
        default_add_bos = True
    else:
        raise ValueError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)"
        )
    tok.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == _CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == _USER_DEFINED
        ]
    )

    def text(key: str) -> str | None:
        i = field(reader, f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {
        "bos_token": text("bos_token_id"),
        "eos_token": text("eos_token_id"),
        "unk_token": text("unknown_token_id"),
        "pad_token": text("padding_token_id"),
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", default_add_bos)),
        "add_eos_token": bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
        "chat_template": field(reader, "tokenizer.chat_template"),
    }
    return tok, config


class GGUFTokenizer(HFTokenizer):
    """:class:`HFTokenizer` over the vocabulary of a ``.gguf`` file.

    Raises (constructor):
      ValueError (ModelLoadError for file problems): missing file or gguf package, no or an
        unsupported vocabulary.
    """

    def __init__(self, path: str, reader=None):
        from jaxserve.model.readers.gguf_reader import gguf_generation_config, open_gguf

        reader = reader if reader is not None else open_gguf(path)
        tok, config = build_gguf_tokenizer(reader, path)
        eos = gguf_generation_config(reader).get("eos_token_id", [])
        super(HFTokenizer, self).__init__(path, config, False, extra_eos_ids=eos)
        self._set_backend(tok, path, config)
