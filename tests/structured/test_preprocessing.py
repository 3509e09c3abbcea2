"""Request preprocessing that grows with the request (#38, #39), on the bundled tokenizer without a
model: the caps, the bad-words automaton against vLLM's rule, plans prepared once and only copied
by the manager, the admission checks of grammars, choices as exact literals, bounded JSON
numbers and their switches, and the Lark productivity check."""

from __future__ import annotations

import os
import pickle
import random
import types

import numpy as np
import pytest

from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.structured import TokenMaskManager, compile_constraint, prepare_token_masks
from jaxserve.structured.bad_words import BadWords
from jaxserve.structured.grammar import continuation_ids
from jaxserve.structured.json_numbers import INT_BOUND
from jaxserve.structured.lark_check import derives_finite_string

pytest.importorskip("llguidance")

MODEL_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "tiny-llama")


@pytest.fixture(scope="module")
def tok():
    from jaxserve.tokenizer import get_tokenizer

    return get_tokenizer(MODEL_DIR)


def _sched(req_ids):
    return types.SimpleNamespace(
        num_scheduled_tokens={r: 1 for r in req_ids}, finished_req_ids=set()
    )


def _allowed(row: np.ndarray, vocab: int) -> set[int]:
    return set(np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])[0])


# ---- caps -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"logit_bias": {i: 1.0 for i in range(1025)}},
            "logit_bias has 1025 entries; at most 1024",
        ),
        ({"allowed_token_ids": list(range(1025))}, "allowed_token_ids has 1025 entries"),
        ({"bad_words": ["w"] * 1025}, "bad_words has 1025 words; at most 1024"),
        ({"bad_words": ["x" * 10000, "y" * 7000]}, "bad_words has 17000 characters"),
    ],
)
def test_caps_name_the_field_and_the_cap(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        SamplingParams(**kwargs)


def test_structured_caps():
    with pytest.raises(ValueError, match="^structured_outputs.choice has 16385 entries"):
        StructuredOutputsParams(choice=[str(i) for i in range(16385)])
    with pytest.raises(ValueError, match="^structured_outputs.json has"):
        StructuredOutputsParams(json={"enum": ["x" * 1000] * 300})
    StructuredOutputsParams(choice=[str(i) for i in range(16384)])  # at the cap: fine


# ---- bad words --------------------------------------------------------------------------------


def _vllm_rule(words, output):
    banned = set()
    for w in words:
        prefix = list(w[:-1])
        if len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix:
            banned.add(w[-1])
    return banned


def test_bad_words_automaton_bans_what_vllms_rule_bans():
    rng = random.Random(0)
    for _ in range(200):
        vocab = rng.choice([2, 4, 30])
        words = [
            tuple(rng.randrange(vocab) for _ in range(rng.randint(2, 7)))
            for _ in range(rng.randint(1, 40))
        ]
        automaton = BadWords(words)
        node, output = BadWords.ROOT, []
        for _ in range(50):
            new = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2]))]
            output += new
            node = automaton.advance(node, new)
            assert set(automaton.banned(node).tolist()) == _vllm_rule(words, output)


def test_manager_bans_bad_words_like_vllm_with_and_without_a_space(tok):
    words = ["hello world", "the", "once upon", "x y z"]
    masks = TokenMaskManager(tok)
    masks.add_request("b", SamplingParams(bad_words=words))
    sequences = {tuple(continuation_ids(tok, t)) for w in words for t in (w, " " + w)}
    rng = random.Random(1)
    output: list[int] = []
    request = types.SimpleNamespace(output_token_ids=output)
    for _ in range(60):  # outputs that keep running into the words' prefixes
        seq = rng.choice(sorted(sequences))
        output += list(seq[: rng.randint(1, len(seq))])
        row = masks.step_mask(_sched(["b"]), {"b": request}).bitmask[0]
        banned = set(range(tok.vocab_size)) - _allowed(row, tok.vocab_size)
        assert banned == _vllm_rule(sequences, output)


def test_a_prepared_plan_is_only_copied_and_travels_as_nothing(tok, monkeypatch):
    spec = StructuredOutputsParams(json={"type": "object"})
    params = SamplingParams(
        n=2, bad_words=[f"word{i}" for i in range(1024)], structured_outputs=spec
    )
    params.token_mask_plan = prepare_token_masks(params, tok)
    import jaxserve.structured.manager as manager

    def refuse(*args, **kwargs):
        raise AssertionError("the engine thread prepared a plan it was given")

    monkeypatch.setattr(manager, "prepare_token_masks", refuse)
    masks = TokenMaskManager(tok)
    for k in range(2):  # n > 1: the children share the plan (clone keeps it)
        masks.add_request(f"r-{k}", params.clone(n=1, seed=k))
    assert len(masks) == 2
    assert params.clone(bad_words=["other"]).token_mask_plan is None  # a stale plan is dropped
    assert pickle.loads(pickle.dumps(params)).token_mask_plan is None


# ---- grammars at admission ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,says",
    [
        (StructuredOutputsParams(regex="(a{1000}){1000}"), "does not compile within limits"),
        (StructuredOutputsParams(regex="(a{300}){300}"), "is too costly"),
        (StructuredOutputsParams(grammar='start: "a" start'), "derives no finite string"),
        (StructuredOutputsParams(grammar='root ::= "x" root'), "derives no finite string"),
        (StructuredOutputsParams(regex="[^\\s\\S]"), "matches no text"),
    ],
)
def test_constraints_that_cannot_finish_are_refused(tok, spec, says):
    with pytest.raises(ValueError, match=f"^response_format: .*{says}"):
        compile_constraint(spec, tok, "response_format")


def _accepts(tok, spec, text: str, **kwargs) -> bool:
    matcher = compile_constraint(spec, tok, **kwargs).template.deep_copy()
    return matcher.consume_tokens(continuation_ids(tok, text)) and matcher.is_accepting()


def test_choices_match_exactly_even_with_regex_characters(tok):
    spec = StructuredOutputsParams(choice=("a.b", "(x)|[y]", "c\\d", "-~#&"))
    for choice in spec.choice:
        assert _accepts(tok, spec, choice)
    for other in ("axb", "(x)", "[y]", "cd", "c\\\\d"):
        assert not _accepts(tok, spec, other)


NUMBERS = {
    "type": "object",
    "properties": {
        "i": {"type": "integer"},
        "f": {"type": ["number", "null"], "description": "kept as an annotation"},
        "low": {"type": "integer", "minimum": 0},
        "items": {"type": "array", "items": {"$ref": "#/$defs/n"}},
    },
    "required": ["i", "f", "low", "items"],
    "additionalProperties": False,
    "$defs": {"n": {"type": "number", "multipleOf": 0.5}},
}


@pytest.mark.parametrize(
    "text,bounded,unbounded",
    [
        (f'{{"i": {INT_BOUND}, "f": null, "low": 0, "items": []}}', True, True),
        ('{"i": 12345678901234567890123, "f": null, "low": 0, "items": []}', False, True),
        ('{"i": 1, "f": 3.123456789, "low": 0, "items": []}', True, True),
        ('{"i": 1, "f": 3.1234567891, "low": 0, "items": []}', False, True),
        ('{"i": 1, "f": 1e300, "low": 0, "items": []}', False, True),
        ('{"i": 1, "f": null, "low": 99999999999999999999, "items": []}', False, True),
        ('{"i": 1, "f": null, "low": 0, "items": [2.5, 123456789012345678]}', False, True),
    ],
)
def test_bounded_numbers_and_their_switches(tok, text, bounded, unbounded):
    # #39: unbounded integers ran on until max_tokens ("celsius": 1975599377109515522892773...).
    spec = StructuredOutputsParams(json=NUMBERS)
    assert _accepts(tok, spec, text) is bounded
    assert _accepts(tok, spec, text, bounded_numbers=False) is unbounded  # the server flag
    off = StructuredOutputsParams(json=NUMBERS, bounded_numbers=False)  # the request field
    assert _accepts(tok, off, text) is unbounded
    guided = StructuredOutputsParams(json={**NUMBERS, "x-guidance": {"bounded_numbers": False}})
    assert _accepts(tok, guided, text) is unbounded  # llguidance's place for JSON options


def test_json_object_numbers_are_bounded(tok):
    spec = StructuredOutputsParams(json_object=True)
    assert _accepts(tok, spec, '{"a": [1, 2.5, {"b": null, "c": "x"}], "d": true}')
    assert not _accepts(tok, spec, '{"a": 12345678901234567890}')
    off = StructuredOutputsParams(json_object=True, bounded_numbers=False)
    assert _accepts(tok, off, '{"a": 12345678901234567890}')


# ---- Lark productivity ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grammar,finite",
    [
        ('start: "a" start', False),
        ('start: "a" start | "b"', True),
        ('start: a\na: "x" a', False),
        ('start: a*\na: "x" a', True),
        ('start: "x"{2,5} b\nb: b "y"', False),
        ('start: "a"~0..3 b\nb: b', False),
        (
            '?start: value\n?value: obj | "null"\nobj: "{" [pair ("," pair)*] "}"\npair: STR ":" value\n'
            "%import common.ESCAPED_STRING -> STR",
            True,
        ),
        ('start: x\n// note\nx[lazy, stop="\\n", temperature=0.7]: /.*/', True),
        ('start: TEXT | call\nTEXT: /[^{](.|\\n)*/\ncall: %json {\n "type": "object"\n}', True),
        ('start: <|python_tag|> "x"', True),
        ("start: foo::_", None),  # parametric rules: not understood, never refused
        ('nothing: "x"', None),
    ],
)
def test_lark_grammars_that_derive_no_finite_string(grammar, finite):
    assert derives_finite_string(grammar) is finite


def test_one_compile_per_grammar_shared_refusals_cached_cancels_harmless(tok):
    from jaxserve.structured import compile_constraint_future

    spec = StructuredOutputsParams(regex="[a-z]{1,5}-shared-compile")
    first = compile_constraint_future(spec, tok, "structured_outputs")
    second = compile_constraint_future(spec, tok, "response_format")
    second.cancel()  # its client left while the compile ran
    compiled = first.result(timeout=60)
    again = compile_constraint_future(spec, tok, "tools")
    assert again.done() and again.result() is compiled  # cached: no second compile
    empty = StructuredOutputsParams(regex="[^\\s\\S]")
    with pytest.raises(ValueError, match="^tools: the regex constraint matches no text"):
        compile_constraint_future(empty, tok, "tools").result(timeout=60)
    refused = compile_constraint_future(empty, tok, "response_format")
    assert refused.done()  # the refusal is kept too, and names each caller's field
    with pytest.raises(ValueError, match="^response_format: "):
        refused.result()
