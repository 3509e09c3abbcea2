"""Grammars that end requests (#38 F4, #39): a complete grammar stops its request on the token
that completed it, with ``ignore_eos`` too, with usage counting only the tokens produced and one
log line at most; a matcher that fails mid-generation ends the request with "error"; bounded
JSON numbers finish. Preprocessing prepared off the engine thread gives the same output as the
engine's own."""

from __future__ import annotations

import json
import logging

import pytest

from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

pytest.importorskip("llguidance")

SHORT = {
    "type": "object",
    "properties": {"a": {"type": "string", "maxLength": 5}},
    "required": ["a"],
    "additionalProperties": False,
}


def test_grammar_complete_stops_with_ignore_eos_and_counts_only_produced_tokens(
    make_engine, run, prompts, base, caplog
):
    # #38 F4: ignore_eos ran on after the JSON was complete ("length", 4,000 tokens for ~24
    # visible, a warning per step).
    spec = StructuredOutputsParams(json=SHORT)
    params = SamplingParams(
        temperature=1.0, seed=3, n=4, max_tokens=64, ignore_eos=True, structured_outputs=spec
    )
    with caplog.at_level(logging.WARNING, logger="jaxserve.structured"):
        done = run(make_engine(), [("f4", prompts[0], params)])
    out = done["f4"]
    for c in out.outputs:
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        assert len(json.loads(c.text)["a"]) <= 5
        # Every token produced is text of the answer: none past the grammar's end.
        assert base.tokenizer.decode(c.token_ids) == c.text
        assert len(c.token_ids) < 64
    assert not [r for r in caplog.records if r.name.startswith("jaxserve.structured")]


def test_grammar_complete_stops_without_eos_even_when_eos_is_banned(make_engine, run, prompts):
    # #39: a complete answer stops on its own token, even when EOS cannot be sampled.
    eos = 2
    spec = StructuredOutputsParams(choice=("yes", "no"))
    params = SamplingParams(
        temperature=0.0, max_tokens=16, logit_bias={eos: -100.0}, structured_outputs=spec
    )
    done = run(make_engine(), [("c", prompts[1], params)])
    c = done["c"].outputs[0]
    assert c.finish_reason == "stop" and c.text in ("yes", "no")
    assert eos not in c.token_ids


def test_bounded_integers_finish_and_unbounded_ones_may_not(make_engine, run, prompts):
    # #39: an unbounded integer field ran on until max_tokens; bounded, every answer finishes.
    schema = {
        "type": "object",
        "properties": {"celsius": {"type": "integer"}},
        "required": ["celsius"],
        "additionalProperties": False,
    }
    bounded = StructuredOutputsParams(json=schema)
    reqs = [
        (
            f"b{i}",
            prompts[i % 4],
            SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=bounded),
        )
        for i in range(6)
    ]
    done = run(make_engine(), reqs)
    for out in done.values():
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        assert abs(json.loads(c.text)["celsius"]) < 2**63


def _failing_branch_grammar(tokenizer) -> tuple[str, int]:
    """A grammar the admission probe passes (it follows the highest token id: "q" "ok") whose
    other branch makes llguidance fail mid-generation (2,500 alternatives after "e": more
    Earley items in one row than its limit of 2,000), and the token id that takes that branch."""
    from jaxserve.structured.grammar import continuation_ids

    single = {}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        ids = continuation_ids(tokenizer, ch)
        if len(ids) == 1:
            single[ch] = ids[0]
    low, high = min(single, key=single.get), max(single, key=single.get)
    tail = " | ".join(f'"w{i}"' for i in range(2500))
    return f'start: "{high}" "ok" | "{low}" tail\ntail: {tail}', single[low]


def test_matcher_failure_mid_generation_ends_the_request_with_error(
    make_engine, prompts, base, caplog
):
    # #38 F2: a matcher error mid-generation ended the request as a silent "stop".
    grammar, bad_token = _failing_branch_grammar(base.tokenizer)
    spec = StructuredOutputsParams(grammar=grammar)
    engine = make_engine()
    engine.add_request(
        "e",
        prompts[2],
        SamplingParams(
            temperature=0.0, max_tokens=30, logit_bias={bad_token: 100.0}, structured_outputs=spec
        ),
    )
    engine.add_request("ok", prompts[3], SamplingParams(temperature=0.0, max_tokens=8))
    done = {}
    with caplog.at_level(logging.WARNING, logger="jaxserve.structured"):
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    c = done["e"].outputs[0]
    assert c.finish_reason == "error", (c.finish_reason, c.text)
    assert c.stop_reason.startswith("structured output constraint failed: ")
    assert c.token_ids == [bad_token]
    assert done["ok"].outputs[0].finish_reason == "length"  # the engine went on serving
    warned = [r for r in caplog.records if r.name.startswith("jaxserve.structured")]
    assert len(warned) == 1
    assert len(engine.token_masks) == 0 and not engine.scheduler.requests
