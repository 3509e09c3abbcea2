"""Tokenizer fixtures: the bundled sentencepiece model, and tiny Hugging Face tokenizer.json
files (byte-level BPE, Llama-3 style; Metaspace Unigram) built with the ``tokenizers`` library."""

from __future__ import annotations

import json
import os

import pytest
from tokenizer_testing import LLAMA3_TEMPLATE, TINY_LLAMA, TRAIN_TEXT
from tokenizers import Tokenizer as HFTok
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jaxserve.tokenizer import get_tokenizer
from jaxserve.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def sp_tokenizer() -> Tokenizer:
    return get_tokenizer(TINY_LLAMA)


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory) -> str:
    """Byte-level BPE (GPT-2 / Llama 3 style) with a BOS post-processor."""
    d = str(tmp_path_factory.mktemp("bpe"))
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tok.train_from_iterator(
        TRAIN_TEXT,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "chat_template": LLAMA3_TEMPLATE,
            },
            f,
        )
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [1, 2]}, f)
    return d


@pytest.fixture(scope="session")
def unigram_dir(tmp_path_factory) -> str:
    """Metaspace Unigram (sentencepiece-like word boundaries in a tokenizer.json), with
    Llama-style add_bos_token in tokenizer_config.json and no post-processor."""
    d = str(tmp_path_factory.mktemp("unigram"))
    tok = HFTok(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(
        TRAIN_TEXT,
        trainers.UnigramTrainer(
            vocab_size=200,
            special_tokens=["<unk>", "<s>", "</s>"],
            unk_token="<unk>",
            show_progress=False,
        ),
    )
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True},
            f,
        )
    return d
