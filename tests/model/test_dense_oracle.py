"""The dense oracle against an unpadded greedy loop, EOS handling and validation (the
``jaxserve generate`` command: tests/test_generate.py)."""

from __future__ import annotations

import numpy as np
import pytest
from model_testing import dense_logits, golden_path

from jaxserve.model.dense_oracle import bucket_len, generate_dense
from jaxserve.model.loader import load_model

PROMPT = [1, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def model():
    return load_model(golden_path("mistral"), dtype="float32")[0]


def test_bucket_len():
    assert [bucket_len(n) for n in (1, 16, 17, 32, 33, 100)] == [16, 16, 32, 32, 64, 128]


def test_each_token_is_the_unpadded_argmax(model):
    """Across a bucket boundary (5 + 14 > 16): teacher-forcing the output through one unpadded
    forward must reproduce every token as the argmax of the position before it."""
    out = generate_dense(model, PROMPT, 14)
    assert len(out) == 14 and len(set(out)) > 5
    logits = dense_logits(model, PROMPT + out[:-1])
    assert np.argmax(logits[len(PROMPT) - 1 :], axis=-1).tolist() == out


def test_eos_stops_and_is_included(model):
    full = generate_dense(model, PROMPT, 6)
    eos = full[2]
    first = full.index(eos)
    assert generate_dense(model, PROMPT, 6, eos_token_ids=[eos]) == full[: first + 1]
    assert generate_dense(model, PROMPT, 6, eos_token_ids=[eos], ignore_eos=True) == full
    assert generate_dense(model, PROMPT, 0) == []


@pytest.mark.parametrize(
    "prompt,max_tokens,match",
    [
        ([], 4, "prompt_token_ids must not be empty"),
        ([1, 256], 4, r"prompt_token_ids must be in \[0, 256\)"),
        ([1, -1], 4, "prompt_token_ids"),
        ([1, 2], -1, "max_tokens must be >= 0"),
        ([1] * 500, 13, "exceeds the model's max_position_embeddings"),
    ],
)
def test_invalid_input(model, prompt, max_tokens, match):
    with pytest.raises(ValueError, match=match):
        generate_dense(model, prompt, max_tokens)
