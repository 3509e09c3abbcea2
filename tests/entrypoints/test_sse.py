"""SSE encoding: the fast per-chunk path writes exactly what json.dumps writes."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.entrypoints.http.sse import SSEEncoder
from jaxserve.serving.json_io import dumps


def reference(chunk) -> bytes:
    text = json.dumps(chunk, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


TEXT = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=12)
SCALAR = st.one_of(
    st.none(),
    TEXT,
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
)
VALUE = st.recursive(
    SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=8,
)
CHOICE = st.one_of(
    st.fixed_dictionaries(
        {
            "index": st.integers(0, 9),
            "text": TEXT,
            "logprobs": st.none(),
            "finish_reason": st.sampled_from([None, "stop", "length"]),
            "stop_reason": st.one_of(st.none(), TEXT, st.integers(0, 99)),
        }
    ),
    st.fixed_dictionaries(
        {"index": st.integers(0, 9), "delta": st.dictionaries(TEXT, VALUE, max_size=2)}
    ),
    st.dictionaries(TEXT, VALUE, max_size=4),
)
HEADER = st.fixed_dictionaries(
    {
        "id": TEXT,
        "object": st.just("text_completion"),
        "created": st.integers(0, 2**40),
        "model": TEXT,
    },
    optional={"usage": st.one_of(st.none(), st.dictionaries(TEXT, st.integers(0, 99), max_size=3))},
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(HEADER, st.lists(CHOICE, max_size=3)), min_size=1, max_size=4))
def test_events_match_json_dumps(chunks):
    encoder = SSEEncoder()  # one per response: its header cache must follow header changes
    for header, choices in chunks:
        chunk = {**header, "choices": choices}
        assert encoder.event(chunk) == reference(chunk)


@given(st.dictionaries(TEXT, VALUE, max_size=4))
def test_other_events_and_dumps(obj):
    # Bodies without a trailing "choices" list (errors, ledgers) take the plain encoder.
    assert SSEEncoder().event(obj) == reference(obj)
    assert dumps(obj) == reference(obj)[6:-2]


def test_choices_not_last_and_special_characters():
    chunk = {"choices": [{"text": 'a"\\\n\t\x00é🙂\u2028'}], "id": "x"}
    assert SSEEncoder().event(chunk) == reference(chunk)
    chunk = {"choices": [{"index": True, "x": 1.5, "y": [1, None]}]}
    assert SSEEncoder().event(chunk) == reference(chunk)


def test_header_cache_follows_changes_of_value_type_and_content():
    encoder = SSEEncoder()
    usage = {"prompt_tokens": 1}
    for header in ({"created": 1}, {"created": True}, {"usage": usage}, {"usage": usage}):
        chunk = {**header, "choices": []}
        assert encoder.event(chunk) == reference(chunk)
        usage["prompt_tokens"] += 1  # mutated in place between chunks


def test_the_server_loop_is_uvloops_unless_asked_for_asyncios(monkeypatch):
    """The event loop the server runs on (``run_loop``): uvloop's (installed with
    orbax-checkpoint) by default, asyncio's with ``JAXSERVE_EVENT_LOOP=asyncio``."""
    import asyncio

    import uvloop

    from jaxserve.entrypoints.http.api_server import new_event_loop

    for env, is_uvloop in ((None, True), ("asyncio", False)):
        if env is None:
            monkeypatch.delenv("JAXSERVE_EVENT_LOOP", raising=False)
        else:
            monkeypatch.setenv("JAXSERVE_EVENT_LOOP", env)
        loop = new_event_loop()
        try:
            assert isinstance(loop, uvloop.Loop) == is_uvloop
            assert loop.run_until_complete(asyncio.sleep(0, result=7)) == 7
        finally:
            loop.close()
