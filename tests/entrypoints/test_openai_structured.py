"""Structured outputs end to end on the bundled model (which knows no JSON): the grammar alone
makes its outputs valid. One server for the module; small max_tokens; requests run concurrently.

Every output that finishes with ``stop`` must parse and validate with ``jsonschema`` (the
"100%" of the issue); the tests also require most outputs to finish, so they cannot pass
vacuously.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import jsonschema
import openai
import pydantic
import pytest
from server_harness import (
    MODEL_DIR,
    assert_error,
    running_server,
    small_engine_args,
    sse,
    wait_idle,
)
from structured_schemas import SCHEMAS

pytest.importorskip("llguidance")

COMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    if not os.path.isdir(os.path.join(MODEL_DIR, "params")):
        pytest.skip("the bundled weights are missing")
    args = small_engine_args(
        num_gpu_blocks_override=96,
        max_num_seqs=16,
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    with running_server(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat_schema(oai, i: int, schema: dict):
    return oai.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Answer in JSON."}],
        max_tokens=64,
        n=2,
        temperature=1.0,
        seed=i,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
        },
    )


def test_twenty_schemas_every_stopped_output_validates(oai):
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(lambda a: _chat_schema(oai, *a), enumerate(SCHEMAS)))
    stopped = 0
    for schema, done in zip(SCHEMAS, results):
        assert len(done.choices) == 2
        for choice in done.choices:
            assert choice.finish_reason in ("stop", "length")
            if choice.finish_reason == "stop":
                stopped += 1
                jsonschema.validate(json.loads(choice.message.content), schema)
    assert stopped >= 30, f"only {stopped} of 40 outputs finished"


def test_completions_stream_joins_to_the_same_text_with_logprobs(client):
    schema = SCHEMAS[3]
    body = {
        "prompt": "Data:",
        "max_tokens": 64,
        "temperature": 1.0,
        "seed": 7,
        "logprobs": 2,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    }
    whole = client.post(COMPL, json=body).json()["choices"][0]
    chunks = []
    with client.stream("POST", COMPL, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert streamed == whole["text"]
    assert whole["finish_reason"] == "stop"
    jsonschema.validate(json.loads(whole["text"]), schema)
    assert len(whole["logprobs"]["tokens"]) == len(whole["logprobs"]["top_logprobs"]) > 0
    assert all(len(top) <= 3 for top in whole["logprobs"]["top_logprobs"])  # top 2 + the chosen one


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    celsius: int = pydantic.Field(ge=-40, le=50)
    sky: str = pydantic.Field(json_schema_extra={"enum": ["sunny", "cloudy", "rain"]})


def test_openai_client_parse_returns_the_model(oai):
    done = oai.chat.completions.parse(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Weather?"}],
        response_format=Weather,
        max_tokens=64,
        temperature=0.8,
        seed=3,
    )
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Weather)
    assert message.parsed.sky in ("sunny", "cloudy", "rain") and -40 <= message.parsed.celsius <= 50


@pytest.mark.parametrize(
    "constraint,check",
    [
        ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
        ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
        (
            {"grammar": 'start: "ab" ("c" | "d")+'},
            lambda t: t.startswith("ab") and set(t[2:]) <= {"c", "d"},
        ),
    ],
)
def test_structured_outputs_extras_on_completions(client, constraint, check):
    body = {
        "prompt": "Go:",
        "max_tokens": 48,
        "temperature": 1.0,
        "seed": 1,
        "n": 2,
        "structured_outputs": constraint,
    }
    r = client.post(COMPL, json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "stop":
            assert check(choice["text"]), choice["text"]


def test_json_object_on_chat_streams(oai):
    stream = oai.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        max_tokens=48,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.startswith("{")


@pytest.mark.parametrize(
    "extra,param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "objectx"}},
                }
            },
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"xml": "a"}}, "structured_outputs"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_constraints_are_400s_and_the_server_keeps_serving(server, client, extra, param):
    for url, body in (
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        (COMPL, {"prompt": "hi", "max_tokens": 4}),
    ):
        assert_error(client.post(url, json={**body, **extra}), 400, param=param)
    ok = client.post(COMPL, json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
    _, idle = wait_idle(client, server.llm)
    assert idle


# ---- tool calling ------------------------------------------------------------------------------

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _check_calls(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_named_tool_choice_forces_a_valid_call(oai):
    done = oai.chat.completions.create(
        model="tiny-llama",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
        temperature=0.8,
        seed=2,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    _check_calls(choice.message.tool_calls)


def test_required_tool_choice_streams_the_same_calls(oai):
    kwargs = dict(
        model="tiny-llama",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0.8,
        seed=5,
    )
    done = oai.chat.completions.create(**kwargs)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls)
    deltas, finish = [], None
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    # #39: like a named call, each call streams as a head (index, id, name) and then its
    # arguments piece by piece (it came as one delta at the end).
    joined: dict[int, list] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in joined and d.function.name and d.type == "function"
            joined[d.index] = [d.function.name, d.function.arguments or ""]
        else:
            assert d.function.name is None
            joined[d.index][1] += d.function.arguments
    assert len(deltas) > 2 * len(joined)
    assert [tuple(joined[i]) for i in sorted(joined)] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_named_tool_call_streams_argument_deltas_and_a_tool_turn_renders(oai):
    stream = oai.chat.completions.create(
        model="tiny-llama",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    deltas = [d for c in stream if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "add" and deltas[0].id.startswith("call_")
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), PARAMS["add"])
    follow_up = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": deltas[0].id,
                    "type": "function",
                    "function": {"name": "add", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": deltas[0].id, "content": "42"},
    ]
    done = oai.chat.completions.create(
        model="tiny-llama", messages=follow_up, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert done.choices[0].message.tool_calls is None


def test_auto_tool_choice_with_a_template_that_cannot_show_tools_is_a_400(oai):
    """#39: the bundled model's template (like SmolLM2's) drops the tools, so "auto" (also the
    default with tools) answered silent prose; now a 400 that says what to send instead."""
    for extra in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as exc_info:
            oai.chat.completions.create(
                model="tiny-llama", messages=ASK, tools=TOOLS, max_tokens=8, **extra
            )
        error = exc_info.value.body
        assert error["param"] == "tool_choice" and "does not show the tools" in error["message"]


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        (  # tool_choice none: the bundled template cannot serve "auto" (a 400 of its own)
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "objectx"}},
                    }
                ],
                "tool_choice": "none",
            },
            "tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (  # OpenAI's limit: each tool's schema is compiled at admission
            {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
            "tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_bad_tool_definitions_are_400s(client, extra, param):
    body = {"messages": ASK, "max_tokens": 4, **extra}
    assert_error(client.post(CHAT, json=body), 400, param=param)


# ---- limits and endings (#38 F1, F2, F4; #39) ------------------------------------------------


@pytest.mark.parametrize(
    "extra,param,cap",
    [
        ({"bad_words": [f"w{i}" for i in range(1025)]}, "bad_words", "1024"),
        ({"bad_words": ["x" * 8200, "y" * 8200]}, "bad_words", "16384"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1024"),
        ({"allowed_token_ids": list(range(1025))}, "allowed_token_ids", "1024"),
        (
            {"structured_outputs": {"choice": [f"w{i}" for i in range(16385)]}},
            "structured_outputs.choice",
            "16384",
        ),
        ({"structured_outputs": {"regex": "a" * 262145}}, "structured_outputs.regex", "262144"),
    ],
)
def test_request_sizes_over_the_caps_are_400s_naming_field_and_cap(client, extra, param, cap):
    # #38 F1: 30,000 bad words froze every request for 30 s; now the caps answer at once.
    error = assert_error(
        client.post(COMPL, json={"prompt": "hi", "max_tokens": 2, **extra}), 400, param=param
    )
    assert cap in error["message"]


@pytest.mark.parametrize(
    "constraint,says",
    [
        ({"regex": "(a{1000}){1000}"}, "within limits"),
        ({"regex": "(a{300}){300}"}, "too costly"),
        ({"grammar": 'start: "a" start'}, "no finite string"),
        ({"grammar": 'root ::= "x" root'}, "no finite string"),
        ({"regex": "[^\\s\\S]"}, "matches no text"),
    ],
)
def test_constraints_that_cannot_finish_are_400s_at_admission(server, client, constraint, says):
    # #38 F2: each of these answered "a" / "x" / "" with finish_reason "stop".
    body = {"prompt": "hi", "max_tokens": 8, "structured_outputs": constraint}
    error = assert_error(client.post(COMPL, json=body), 400, param="structured_outputs")
    assert says in error["message"]
    assert client.post(COMPL, json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def _single_token_letters(client) -> dict[str, int]:
    out = {}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        ids = client.post("/tokenize", json={"prompt": "\n" + ch, "add_special_tokens": False})
        newline = client.post("/tokenize", json={"prompt": "\n", "add_special_tokens": False})
        tail = ids.json()["tokens"][len(newline.json()["tokens"]) :]
        if len(tail) == 1:
            out[ch] = tail[0]
    return out


def test_matcher_failure_mid_generation_is_finish_reason_error(server, client):
    # #38 F2: a constraint failing mid-generation was reported as a normal "stop". The probe
    # takes the highest token id ("q..."); the bias sends the model down the other branch,
    # whose 2,500 alternatives exceed llguidance's 2,000 Earley items per row.
    letters = _single_token_letters(client)
    low, high = min(letters, key=letters.get), max(letters, key=letters.get)
    rule = " | ".join(f'"w{i}"' for i in range(2500))
    body = {
        "prompt": "hi",
        "max_tokens": 8,
        "temperature": 0,
        "logit_bias": {str(letters[low]): 100},
        "structured_outputs": {"grammar": f'start: "{high}" "ok" | "{low}" tail\ntail: {rule}'},
    }
    choice = client.post(COMPL, json=body).json()["choices"][0]
    assert choice["finish_reason"] == "error"
    assert choice["stop_reason"].startswith("structured output constraint failed")
    events = sse(client, COMPL, {**body, "stream": True})
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "error"
    _, idle = wait_idle(client, server.llm)
    assert idle


def test_ignore_eos_json_stops_when_complete_and_usage_counts_the_answer(client):
    # #38 F4: 4 x max_tokens of usage and thousands of warnings for ~24 visible tokens.
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 5}},
        "required": ["a"],
        "additionalProperties": False,
    }
    body = {
        "prompt": "Data:",
        "max_tokens": 200,
        "n": 4,
        "ignore_eos": True,
        "seed": 1,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    }
    done = client.post(COMPL, json=body).json()
    for choice in done["choices"]:
        assert choice["finish_reason"] == "stop"
        assert len(json.loads(choice["text"])["a"]) <= 5
    assert done["usage"]["completion_tokens"] <= 4 * 16


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
)
def test_forced_tool_call_cut_by_max_tokens_is_text_with_length(oai, tool_choice):
    # #39: a named call whose arguments ran into max_tokens came back as tool_calls of broken
    # JSON.
    done = oai.chat.completions.create(
        model="tiny-llama", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=3
    )
    choice = done.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None
    assert choice.message.content and choice.message.content.startswith(("{", "["))


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"json": {"type": "integer"}, "bounded_numbers": False}},
        {
            "response_format": {"type": "json_object"},
            "structured_outputs": {"bounded_numbers": False},
        },
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "schema": {"type": "integer", "x-guidance": {"bounded_numbers": False}}
                },
            }
        },
    ],
)
def test_bounded_numbers_can_be_switched_off_per_request(client, extra):
    done = client.post(COMPL, json={"prompt": "n=", "max_tokens": 4, **extra})
    assert done.status_code == 200, done.text


# ---- the README's examples (#39) -----------------------------------------------------------


def _readme_client_blocks() -> list[str]:
    """The README's Python blocks that talk to a generating server through the ``openai``
    client, in order (a later block uses the ``client`` an earlier one made); the embeddings
    example needs a pooling server (``test_pooling_server.test_readme_embeddings_example``)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    with open(path, encoding="utf-8") as f:
        blocks = re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)
    return [
        b
        for b in blocks
        if "client" in b and "from jaxserve import" not in b and "embeddings.create" not in b
    ]


def test_readme_client_examples_run_as_printed(server):
    # #39: the README's pydantic example failed 4 of 4 times (LengthFinishReasonError).
    blocks = _readme_client_blocks()
    assert any("chat.completions.parse" in b for b in blocks) and len(blocks) >= 2
    for _ in range(2):  # the issue saw 4 failures in 4 tries; bounded, none can run on
        namespace: dict = {}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            for block in blocks:
                exec(block.replace("http://127.0.0.1:8000", server.url), namespace)  # noqa: S102
        printed = out.getvalue()
        assert "city=" in printed and "celsius=" in printed, printed
        assert "name='get_weather'" in printed, printed


# ---- the Responses API on the bundled model (serving/responses.py) ---------------------------

RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_responses_named_tool_call_and_its_result_fed_back(oai):
    """A forced call through ``responses.create`` (stream helper and not), then its output fed
    back with ``previous_response_id``: the model answers in text."""
    kwargs = dict(
        model="tiny-llama",
        input="What is the weather in Oslo?",
        tools=RESPONSE_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=48,
        temperature=0.8,
        extra_body={"seed": 2},  # vLLM's extension
    )
    done = oai.responses.create(**kwargs)
    assert done.status == "completed"
    (call,) = done.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    with oai.responses.stream(**kwargs) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_response()
    assert [(c.name, c.arguments) for c in streamed.output] == [(call.name, call.arguments)]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    answer = oai.responses.create(
        model="tiny-llama",
        input=[result],
        previous_response_id=done.id,
        tools=RESPONSE_TOOLS,
        tool_choice="none",
        max_output_tokens=6,
    )
    assert answer.output[0].type == "message" and answer.output_text
    assert answer.usage.input_tokens > done.usage.input_tokens


def test_responses_json_schema_text_format(oai):
    done = oai.responses.create(
        model="tiny-llama",
        input="Weather as JSON.",
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER_PARAMS}},
        max_output_tokens=48,
        temperature=0.8,
        extra_body={"seed": 3},
    )
    assert done.status == "completed"
    jsonschema.validate(json.loads(done.output_text), WEATHER_PARAMS)
