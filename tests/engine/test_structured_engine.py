"""Structured outputs through the engine under preemption, prefix caching and n > 1: a request's
constrained greedy output does not depend on how its work was cut, and every finished output
matches its constraint."""

from __future__ import annotations

import json

import pytest

from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["id", "tags"],
    "additionalProperties": False,
}


def _requests(prompts, greedy: bool):
    spec = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=spec)
        if greedy
        else SamplingParams(temperature=1.0, max_tokens=24, n=2, seed=i, structured_outputs=spec)
        for i in range(len(prompts))
    ]
    return [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]


def _texts(done):
    return {rid: [c.text for c in out.outputs] for rid, out in done.items()}


def test_constrained_outputs_survive_preemption_and_prefix_caching(make_engine, run, prompts):
    prompts = prompts[:12]  # up to 150 tokens; 16 blocks of 16 hold about two at once
    plain = run(make_engine(enable_prefix_caching=False), _requests(prompts, greedy=True))
    squeezed_engine = make_engine(num_gpu_blocks=16, long_prefill_token_threshold=64)
    squeezed = run(squeezed_engine, _requests(prompts, greedy=True))
    assert squeezed_engine.get_stats().num_preemptions_total > 0
    assert _texts(squeezed) == _texts(plain)
    sampled = run(make_engine(enable_prefix_caching=True), _requests(prompts, greedy=False))
    finished = 0
    for done in (plain, sampled):
        for out in done.values():
            for c in out.outputs:
                if c.finish_reason == "stop":
                    finished += 1
                    jsonschema.validate(json.loads(c.text), SCHEMA)
    assert finished >= len(prompts) // 2
    assert len(squeezed_engine.token_masks) == 0  # every request's matcher was dropped


def test_allowed_token_ids_and_bad_words(make_engine, run, prompts, base):
    from jaxserve.structured.grammar import continuation_ids

    prompts = prompts[:4]
    allowed = sorted({t for p in prompts for t in p[1:6]} | {2})
    free = run(
        make_engine(),
        [
            (f"f{i}", p, SamplingParams(temperature=0.0, max_tokens=16))
            for i, p in enumerate(prompts)
        ],
    )
    only = run(
        make_engine(),
        [
            (
                f"a{i}",
                p,
                SamplingParams(temperature=1.0, seed=i, max_tokens=16, allowed_token_ids=allowed),
            )
            for i, p in enumerate(prompts)
        ],
    )
    for out in only.values():
        assert set(out.outputs[0].token_ids) <= set(allowed)
    # Ban a word the free greedy output says: its tokens never appear in a row again.
    text = free["f0"].outputs[0].text
    word = max(text.split(), key=len)
    banned = [continuation_ids(base.tokenizer, w) for w in (word, " " + word)]
    done = run(
        make_engine(),
        [("b0", prompts[0], SamplingParams(temperature=0.0, max_tokens=16, bad_words=[word]))],
    )
    ids = done["b0"].outputs[0].token_ids
    for seq in banned:
        assert not any(ids[i : i + len(seq)] == seq for i in range(len(ids)))
    assert ids != free["f0"].outputs[0].token_ids


def test_batch1_constrained_and_penalty_requests_equal_the_synchronous_loop(
    make_engine, run, prompts
):
    """One request at a time whose sampling reads its output history (a grammar, a penalty):
    under async scheduling the engine updates the step in flight before scheduling the next
    (nothing else could run), its grammar taking the tokens before the next step's mask is
    made; outputs equal the synchronous loop's."""
    spec = StructuredOutputsParams(json=SCHEMA)
    requests = [
        (
            "json",
            prompts[2],
            SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=spec),
        ),
        (
            "penalty",
            prompts[5],
            SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=1.5),
        ),
    ]
    got, early = {}, {}
    for on in (True, False):
        engine = make_engine(async_scheduling=on)
        for req in requests:  # one at a time
            got[on, req[0]] = _texts(run(engine, [req]))[req[0]]
        early[on] = engine.num_early_updates
        assert len(engine.token_masks) == 0
    assert {k[1]: v for k, v in got.items() if k[0]} == {
        k[1]: v for k, v in got.items() if not k[0]
    }
    assert early[True] >= 6 and early[False] == 0
