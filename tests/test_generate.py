"""``jaxserve generate``: the engine's continuation of one prompt, printed; greedy it equals the
dense oracle's (the bundled model through the console script: tests/test_cli.py)."""

from __future__ import annotations

import argparse
import os

import pytest

import jaxserve.tokenizer
from jaxserve.generate import add_generate_parser
from jaxserve.model import preflight
from jaxserve.model.dense_oracle import generate_dense
from jaxserve.model.loader import load_model
from jaxserve.tokenizer.tokenizer import Tokenizer

MISTRAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "golden", "mistral")


class _ByteTokenizer(Tokenizer):
    """Stands in for the model's tokenizer: one id per byte of ASCII text, BOS = 1, EOS = 2;
    ids decode to their numbers."""

    vocab_size = 256

    def __init__(self):
        config = {"bos_token": "\x01", "eos_token": "\x02"}
        super().__init__("/nonexistent", config, default_add_bos=True, extra_eos_ids=[2])

    def _encode_plain(self, text):
        return list(text.encode())

    def _decode_plain(self, ids, skip_special_tokens):
        return " ".join(str(i) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(i) for i in ids]

    def _token_to_id(self, token):
        return ord(token) if len(token) == 1 and ord(token) < self.vocab_size else None

    def _backend_special_ids(self):
        return set()


@pytest.fixture(scope="module")
def model():
    return load_model(MISTRAL, dtype="float32")[0]


def test_generate_command(model, monkeypatch, capsys):
    monkeypatch.setattr(jaxserve.tokenizer, "get_tokenizer", lambda path: _ByteTokenizer())
    monkeypatch.setattr(
        jaxserve.tokenizer.loading, "get_tokenizer", lambda path: _ByteTokenizer()
    )  # what the engine calls (load_served_tokenizer)
    # The fixture has no tokenizer files (the byte tokenizer above stands in for one): the
    # start-up check must not ask for them.
    check = preflight.check_model_path
    monkeypatch.setattr(
        preflight,
        "check_model_path",
        lambda p, f, need_tokenizer=False, quantization="auto": check(p, f, False, quantization),
    )
    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers())
    args = parser.parse_args(
        [
            "generate",
            "hi",
            "--max-tokens",
            "4",
            "--model",
            MISTRAL,
            "--dtype",
            "float32",
            "--ignore-eos",
            "--show-token-ids",
        ]
    )
    expected = generate_dense(model, [1, ord("h"), ord("i")], 4)
    assert args.func(args) == 0  # echo (the default): the prompt, then the continuation
    lines = capsys.readouterr().out.splitlines()
    continuation = " " + " ".join(map(str, expected))  # the byte tokenizer's incremental text
    assert lines[0] == "hi" + continuation, lines  # #39: generate printed only the continuation
    assert lines[2] == f"generated_token_ids: {expected}"
    args.echo = False  # --no-echo
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == " ".join(map(str, expected))


def test_a_dummy_preset_without_tokenizer_is_refused_before_loading():
    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers())
    args = parser.parse_args(["generate", "hi", "llama-3.1-8b", "--load-format", "dummy"])
    with pytest.raises(ValueError, match="dummy preset 'llama-3.1-8b' has no tokenizer"):
        args.func(args)
