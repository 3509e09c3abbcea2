"""TokenMaskManager and the grammar bridge on the bundled tokenizer (no model): token bytes,
masks following the sampled tokens, allowed_token_ids, bad_words, clean-up, compile errors."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.structured import TokenMaskManager, check_structured_outputs
from jaxserve.structured.grammar import continuation_ids, token_bytes

pytest.importorskip("llguidance")

MODEL_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "tiny-llama")


@pytest.fixture(scope="module")
def tok():
    from jaxserve.tokenizer import get_tokenizer

    return get_tokenizer(MODEL_DIR)


def _allowed(row: np.ndarray, vocab: int) -> np.ndarray:
    return np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])[0]


class _Req(types.SimpleNamespace):
    pass


def _sched(req_ids, finished=()):
    return types.SimpleNamespace(
        num_scheduled_tokens={r: 1 for r in req_ids}, finished_req_ids=set(finished)
    )


def test_token_bytes_concatenate_to_the_decoded_continuation(tok):
    table = token_bytes(tok)
    for text in ["Hello world, it's 3.5 degrees!", '{"a": [1, 2]}', "café 日本 🙂\n\tend"]:
        ids = continuation_ids(tok, text)
        assert b"".join(table[i] for i in ids).decode("utf-8") == text


def test_grammar_mask_follows_sampled_tokens_then_only_eos(tok):
    masks = TokenMaskManager(tok)
    spec = StructuredOutputsParams(choice=("yes", "no"))
    masks.add_request("a", SamplingParams(structured_outputs=spec))
    masks.add_request("free", SamplingParams())
    req = _Req(output_token_ids=[])
    requests = {"a": req, "free": _Req(output_token_ids=[])}
    mask = masks.step_mask(_sched(["a", "free"]), requests)
    assert mask.req_ids == ["a"]  # the unconstrained request gets no row
    first = set(_allowed(mask.bitmask[0], tok.vocab_size).tolist())
    table = token_bytes(tok)
    assert first and all(b"yes".startswith(table[t]) or b"no".startswith(table[t]) for t in first)
    req.output_token_ids = continuation_ids(tok, "yes")
    mask = masks.step_mask(_sched(["a"]), requests)
    assert _allowed(mask.bitmask[0], tok.vocab_size).tolist() == [tok.eos_token_id]
    assert masks.step_mask(_sched([], finished=["a"]), requests) is None and len(masks) == 0


def test_allowed_token_ids_and_bad_words(tok):
    masks = TokenMaskManager(tok)
    masks.add_request("a", SamplingParams(allowed_token_ids=[5, 40, 4000]))
    masks.add_request("b", SamplingParams(bad_words=["hello world"]))
    word = continuation_ids(tok, " hello world")
    assert len(word) >= 2
    req_b = _Req(output_token_ids=[])
    requests = {"a": _Req(output_token_ids=[]), "b": req_b}
    mask = masks.step_mask(_sched(["a", "b"]), requests)
    assert _allowed(mask.bitmask[0], tok.vocab_size).tolist() == [5, 40, 4000]
    assert len(_allowed(mask.bitmask[1], tok.vocab_size)) == tok.vocab_size
    req_b.output_token_ids = [7] + word[:-1]  # the output ends with all but the last token
    mask = masks.step_mask(_sched(["b"]), requests)
    assert word[-1] not in _allowed(mask.bitmask[0], tok.vocab_size)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputsParams(json={"type": "objectx"}),
        StructuredOutputsParams(json="{not json"),
        StructuredOutputsParams(regex="(unclosed"),
        StructuredOutputsParams(grammar="start: missing_rule"),
    ],
)
def test_uncompilable_constraints_name_the_field(tok, spec):
    with pytest.raises(ValueError, match=r"^response_format: "):
        check_structured_outputs(spec, tok, "response_format")
    with pytest.raises(ValueError, match=r"^structured_outputs"):
        TokenMaskManager(tok).add_request("x", SamplingParams(structured_outputs=spec))


def test_structured_outputs_params_need_exactly_one_kind():
    with pytest.raises(ValueError, match="^structured_outputs"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="^structured_outputs"):
        StructuredOutputsParams(regex="a", choice=("b",))
    with pytest.raises(ValueError, match="^structured_outputs.choice"):
        StructuredOutputsParams(choice=())
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
