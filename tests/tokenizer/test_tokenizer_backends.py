"""Both backends behind one interface: round trips, special tokens, configs, errors."""

from __future__ import annotations

import json
import os

import pytest
from tokenizer_testing import TINY_LLAMA

from jaxserve.tokenizer import get_tokenizer
from jaxserve.tokenizer.hf_tokenizer import HFTokenizer
from jaxserve.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

TEXTS = [
    "Once upon a time there was a king.",
    "  leading spaces, double  spaces and a trailing space ",
    "line one\nline two\n\n\ttabbed",
    "héllo 世界 🙂 naïve café",
    "digits 0123456789 and punctuation: (a), [b], {c}!?",
    "",
]


def test_sentencepiece_round_trip_and_specials(sp_tokenizer):
    tok = sp_tokenizer
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.vocab_size == 4096
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.eos_token_ids == {2}
    assert tok.all_special_ids == [0, 1, 2]
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 1 and 1 not in ids[1:]  # add_bos_token from tokenizer_config.json
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok.encode("Once upon", add_special_tokens=False)) == [
        "▁On",
        "ce",
        "▁upon",
    ]


def test_sentencepiece_byte_fallback_pieces(sp_tokenizer):
    ids = sp_tokenizer.encode("世", add_special_tokens=False)
    assert sp_tokenizer.convert_ids_to_tokens(ids) == ["▁", "<0xE4>", "<0xB8>", "<0x96>"]


def test_sentencepiece_decode_special_tokens(sp_tokenizer):
    tok = sp_tokenizer
    ids = [1] + tok.encode("Hello world", add_special_tokens=False) + [2]
    assert tok.decode(ids) == "Hello world"
    # transformers' LlamaTokenizer (legacy): the piece after a special keeps its space.
    assert tok.decode(ids, skip_special_tokens=False) == "<s> Hello world</s>"


def test_decode_rejects_out_of_range_ids(sp_tokenizer):
    with pytest.raises(ValueError, match="token id 4096"):
        sp_tokenizer.decode([5, 4096])
    with pytest.raises(ValueError, match="text must be a string"):
        sp_tokenizer.encode(["not", "a", "string"])


def test_byte_level_bpe_round_trip(bpe_dir):
    tok = get_tokenizer(bpe_dir)
    assert isinstance(tok, HFTokenizer)
    assert tok.bos_token_id == 0
    assert tok.eos_token_id == 2
    assert tok.eos_token_ids == {1, 2}  # eos_token + generation_config.json's list
    assert tok.all_special_ids == [0, 1, 2]
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 0  # added by the tokenizer.json post-processor
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids) == text
    ids = tok.encode("Hello world") + [2]
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>Hello world<|eot_id|>"


def test_metaspace_unigram_round_trip(unigram_dir):
    tok = get_tokenizer(unigram_dir)
    assert tok.add_bos_token and tok.bos_token_id == 1 and tok.eos_token_id == 2
    for text in ["Once upon a time there was a king.", "the lazy dog sleeps"]:
        ids = tok.encode(text)
        assert ids[0] == 1  # add_bos_token from tokenizer_config.json
        assert tok.decode(ids) == text
        assert all(t.startswith("▁") or t != " " for t in tok.convert_ids_to_tokens(ids))


def test_backend_choice_and_file_paths(tmp_path, bpe_dir):
    assert isinstance(
        get_tokenizer(os.path.join(TINY_LLAMA, "tokenizer.model")), SentencePieceTokenizer
    )
    assert isinstance(get_tokenizer(os.path.join(bpe_dir, "tokenizer.json")), HFTokenizer)
    both = tmp_path / "both"
    both.mkdir()
    for src in (
        os.path.join(TINY_LLAMA, "tokenizer.model"),
        os.path.join(bpe_dir, "tokenizer.json"),
    ):
        (both / os.path.basename(src)).write_bytes(open(src, "rb").read())
    assert isinstance(get_tokenizer(str(both)), HFTokenizer)  # tokenizer.json preferred
    assert isinstance(get_tokenizer(str(both), backend="sentencepiece"), SentencePieceTokenizer)


def test_missing_tokenizer_names_the_path(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path}.*tokenizer.json or tokenizer.model"):
        get_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="backend must be"):
        get_tokenizer(str(tmp_path), backend="tiktoken")
    bad = tmp_path / "tokenizer_config.json"
    bad.write_text("{not json")
    (tmp_path / "tokenizer.model").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        get_tokenizer(str(tmp_path))
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        get_tokenizer(str(tmp_path))


def test_config_overrides(tmp_path):
    """tokenizer_config.json's AddedToken-dict form, add_eos_token, and eos ids from
    generation_config.json and config.json are merged."""
    (tmp_path / "tokenizer.model").write_bytes(
        open(os.path.join(TINY_LLAMA, "tokenizer.model"), "rb").read()
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>", "special": True},
                "eos_token": "</s>",
                "add_bos_token": False,
                "add_eos_token": True,
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    tok = get_tokenizer(str(tmp_path))
    assert tok.bos_token == "<s>"
    assert tok.encode("hi")[-1] == 2 and tok.encode("hi")[0] != 1
    assert tok.eos_token_ids == {2, 7, 9}
