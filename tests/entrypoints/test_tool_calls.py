"""Tool-call parsing and planning without a model: the three text formats, streamed deltas that
join to the whole answer, and the 400s of bad tools / tool_choice."""

from __future__ import annotations

import json

import pytest

from jaxserve.serving.tool_calls import PARSERS, ToolPlan, plan_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}

TEXTS = {
    "hermes": 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
    '{"name": "get_time", "arguments": {}}]',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
    '{"name": "get_time", "parameters": {}}',
}


def _stream(plan: ToolPlan, text: str, step: int = 3) -> tuple[str, list[dict]]:
    """Feeds ``text`` in pieces; returns the joined content and the tool-call deltas."""
    ex = plan.extractor()
    content, calls = "", []
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        delta = ex.delta(piece, finished=k == len(pieces) - 1)
        content += delta.get("content", "")
        calls += delta.get("tool_calls", [])
    return content, calls


@pytest.mark.parametrize("parser", sorted(TEXTS))
def test_parsers_find_both_calls_whole_and_streamed(parser):
    plan = plan_tools([WEATHER, TIME], "auto", True, parser)
    text = TEXTS[parser]
    content, calls = plan.extractor().final(text)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert (
        json.loads(calls[0].arguments) == {"city": "Oslo"} and json.loads(calls[1].arguments) == {}
    )
    expected_content = None if parser == "llama3_json" else "Let me check."
    assert content == expected_content
    streamed_content, deltas = _stream(plan, text)
    assert streamed_content == (expected_content or "")
    assert [d["index"] for d in deltas] == [0, 1]
    assert [d["function"]["name"] for d in deltas] == ["get_weather", "get_time"]
    assert all(d["id"].startswith("call_") and d["type"] == "function" for d in deltas)


@pytest.mark.parametrize("parser", sorted(TEXTS))
def test_plain_text_stays_content(parser):
    plan = plan_tools([WEATHER], "auto", True, parser)
    text = "It is sunny in Oslo < today [maybe] {not json"
    assert plan.extractor().final(text) == (text, [])
    content, deltas = _stream(plan, text)
    assert deltas == [] and content == (text if parser != "llama3_json" else text)


def test_named_streams_arguments_and_required_parses_the_array():
    named = plan_tools(
        [WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, True, ""
    )
    assert named.mode == "named" and named.constraint.json == WEATHER["function"]["parameters"]
    content, deltas = _stream(named, '{"city": "Oslo"}')
    assert content == "" and deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Oslo"}'
    required = plan_tools([WEATHER, TIME], "required", False, "")
    assert required.constraint.json["maxItems"] == 1
    text = '[{"name": "get_time", "parameters": {}}]'
    assert [c.name for c in required.extractor().final(text)[1]] == ["get_time"]
    assert plan_tools([WEATHER], "none", True, "").extractor() is None
    assert plan_tools(None, None, True, "") is None


@pytest.mark.parametrize(
    "tools,choice,parser,field",
    [
        ([{"type": "function", "function": {"name": "bad name"}}], "required", "", "tools"),
        ([{"type": "retrieval"}], "required", "", "tools"),
        ([WEATHER, WEATHER], "required", "", "tools"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            "required",
            "",
            "tools",
        ),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "", "tool_choice"),
        ([WEATHER], "auto", "", "tool_choice"),
        ([WEATHER], "sometimes", "hermes", "tool_choice"),
        (None, "required", "", "tool_choice"),
    ],
)
def test_bad_tools_and_choices_name_the_field(tools, choice, parser, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        plan_tools(tools, choice, True, parser)


def test_parser_names_match_the_config_flag():
    from jaxserve.config import TOOL_CALL_PARSERS

    assert set(PARSERS) == set(TOOL_CALL_PARSERS)


def test_prepare_chat_hands_tools_and_parsed_arguments_to_the_template():
    from server_harness import MODEL_DIR

    from jaxserve.serving.chat import prepare_chat
    from jaxserve.serving.protocol import ChatCompletionRequest
    from jaxserve.serving.validation import ServingInfo
    from jaxserve.tokenizer import get_tokenizer

    real = get_tokenizer(MODEL_DIR)
    seen = {}

    class Tok:  # the real tokenizer (tool schemas compile against it), recording the template call
        def __getattr__(self, name):
            return getattr(real, name)

        def encode_chat(self, messages, add_generation_prompt=True, tools=None):
            seen.update(messages=messages, tools=tools)
            return [1, 2, 3]

    info = ServingInfo("m", "/m", 64, 100, 64, True, tool_call_parser="hermes")
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
    }
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
            ],
            "tools": [WEATHER, TIME],
            "tool_choice": "none",
        }
    )
    job = prepare_chat(request, info, Tok())
    assert seen["tools"] == [WEATHER, TIME] and job.tools.mode == "none"
    assert seen["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}
    assert seen["messages"][2]["tool_call_id"] == "c1"
