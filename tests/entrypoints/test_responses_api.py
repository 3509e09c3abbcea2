"""``/v1/responses`` over the scripted FakeEngine, through the official openai client: text
and message-list input, instructions, streaming events, max_output_tokens, previous_response_id
and the store, function tools with their outputs fed back, and bad requests.

The fake's script is set per test (``ScriptedFake.say``): each request emits exactly that text,
then an end-of-sequence token, so a response ends "completed" (or "incomplete" when
``max_output_tokens`` cuts it). A chat template given inline (``--chat-template``) writes the
tools (``tool_choice: "auto"`` is refused with a template that drops them), tool calls and
results into the prompt, so feeding them back changes the prompt by a known amount.
"""

from __future__ import annotations

import json

import httpx2 as httpx
import openai
import pytest
from fake_engine import FakeEngine
from server_harness import MODEL_DIR, LiveServer, assert_error

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.serving.responses import OutputItems, input_messages
from jaxserve.serving.tool_calls import plan_tools

TEMPLATE = (  # renders the tools, so tool_choice "auto" is served (Tokenizer.template_shows_tools)
    "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}[result of {{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


class ScriptedFake(FakeEngine):
    """A FakeEngine whose every sample says ``say``'s text from its start, then EOS."""

    def say(self, text: str) -> str:
        """Sets the script; returns the text a sample shows (sentencepiece starts it with the
        word-start marker, a space)."""
        self.script = self.tokenizer.encode(text, add_special_tokens=False)
        self.script.append(self.tokenizer.eos_token_id)
        return " " + text

    def add_request(self, request_id, prompt, params, **kwargs) -> None:
        eos = self.tokenizer.eos_token_id
        super().add_request(request_id, prompt, params.clone(stop_token_ids=[eos]), **kwargs)
        self._reqs[request_id].start = 0


@pytest.fixture(scope="module")
def server():
    fake = ScriptedFake(
        MODEL_DIR,
        step_s=0.0005,
        max_model_len=256,
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        chat_template=TEMPLATE,
    )
    llm = AsyncLLM(fake)
    srv = LiveServer(llm)
    srv.fake = fake
    yield srv
    srv.close()
    llm.shutdown()
    assert not srv.internal_errors


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _prompt_len(server, messages) -> int:
    return len(server.fake.tokenizer.encode_chat(messages))


def test_text_input_with_instructions(server, oai):
    said = server.fake.say("Hello from the fake model.")
    done = oai.responses.create(
        model="fake-model",
        input="Hi",
        instructions="Be brief.",
        temperature=0.5,
        top_p=0.9,
        metadata={"run": "7"},
    )
    assert done.status == "completed" and done.object == "response"
    assert (done.temperature, done.top_p, done.metadata) == (0.5, 0.9, {"run": "7"})
    assert done.output_text == said
    assert [item.type for item in done.output] == ["message"]
    assert done.output[0].role == "assistant" and done.output[0].status == "completed"
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    usage = done.usage
    assert usage.input_tokens == _prompt_len(server, expected)
    assert usage.output_tokens == len(server.fake.script)  # the text and its EOS
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert done.instructions == "Be brief." and done.model == "fake-model"


def test_message_list_input_and_max_output_tokens(server, oai):
    server.fake.say("one two three four five six seven eight")
    items = [
        {"role": "system", "content": "You count."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Ready."}]},
        {"role": "user", "content": "Now"},
    ]
    done = oai.responses.create(model="fake-model", input=items, max_output_tokens=3)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.usage.output_tokens == 3
    messages = input_messages(items)
    assert [m["content"] for m in messages] == ["You count.", "Go", "Ready.", "Now"]
    assert done.usage.input_tokens == _prompt_len(server, messages)


def test_stream_sends_the_event_sequence(server, oai):
    said = server.fake.say("A streamed answer, token by token.")
    events = list(oai.responses.create(model="fake-model", input="Stream it", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == events[-4].text == final.output_text == said
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    # The SDK's stream helper checks the events' consistency as it accumulates them.
    with oai.responses.stream(model="fake-model", input="Again") as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == text


def test_raw_stream_names_each_event(server):
    server.fake.say("ok")
    body = {"model": "fake-model", "input": "Hi", "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    names = [line.split(": ", 1)[1] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas] and names[-1] == "response.completed"
    assert "[DONE]" not in "".join(lines)


def test_previous_response_id_continues_the_stored_conversation(server, oai):
    first_said = server.fake.say("First answer.")
    first = oai.responses.create(model="fake-model", input="Question one", instructions="Sys")
    server.fake.say("Second answer.")
    second = oai.responses.create(
        model="fake-model", input="Question two", previous_response_id=first.id
    )
    history = [  # the first request's instructions are not carried over (OpenAI's rule)
        {"role": "user", "content": "Question one"},
        {"role": "assistant", "content": first_said},
        {"role": "user", "content": "Question two"},
    ]
    assert second.usage.input_tokens == _prompt_len(server, history)
    assert second.previous_response_id == first.id
    stored = httpx.get(f"{server.url}/v1/responses/{first.id}").json()
    assert stored["id"] == first.id and stored["output"][0]["content"][0]["text"] == first_said
    deleted = httpx.delete(f"{server.url}/v1/responses/{first.id}").json()
    assert deleted == {"id": first.id, "object": "response.deleted", "deleted": True}
    assert_error(httpx.get(f"{server.url}/v1/responses/{first.id}"), 404, code="response_not_found")


def test_store_false_keeps_nothing(server, oai):
    server.fake.say("Not kept.")
    done = oai.responses.create(model="fake-model", input="Hi", store=False)
    assert done.store is False
    assert_error(httpx.get(f"{server.url}/v1/responses/{done.id}"), 404, code="response_not_found")
    r = httpx.post(
        server.url + "/v1/responses",
        json={"model": "fake-model", "input": "More", "previous_response_id": done.id},
    )
    assert_error(r, 404, "previous_response_id", "previous_response_not_found")


def test_function_call_and_its_output_fed_back(server, oai):
    server.fake.say("Let me look." + CALL_TEXT)
    done = oai.responses.create(model="fake-model", input="Weather in Oslo?", tools=[WEATHER])
    assert [item.type for item in done.output] == ["message", "function_call"]
    assert done.output[0].content[0].text == " Let me look."
    call = done.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    said = server.fake.say("It is sunny.")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    after = oai.responses.create(
        model="fake-model", input=[result], tools=[WEATHER], previous_response_id=done.id
    )
    assert after.output_text == said
    chat_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
    }
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": " Let me look.", "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]
    tools = [{"type": "function", "function": {k: WEATHER[k] for k in WEATHER if k != "type"}}]
    expected = server.fake.tokenizer.encode_chat(history, tools=tools)
    assert after.usage.input_tokens == len(expected)
    # The same call, fed back by the client itself without the store.
    items = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        result,
    ]
    again = oai.responses.create(model="fake-model", input=items, tools=[WEATHER], store=False)
    history[1]["content"] = ""
    assert again.usage.input_tokens == len(server.fake.tokenizer.encode_chat(history, tools=tools))


def test_streamed_function_call_events(server, oai):
    server.fake.say(CALL_TEXT)
    with oai.responses.stream(model="fake-model", input="Weather?", tools=[WEATHER]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[2:6] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Oslo"}


@pytest.mark.parametrize(
    "extra,status,param",
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            400,
            "tool_choice",
        ),
        ({"background": True}, 400, "background"),
        ({"text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
        ({"max_output_tokens": -1}, 400, "max_output_tokens"),  # 100000: clamped, as vLLM
        ({"temperature": 3}, 400, "temperature"),
        ({"model": "other"}, 404, "model"),
        ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ],
)
def test_bad_requests_name_the_field(server, extra, status, param):
    body = {"model": "fake-model", "input": "Hi", **extra}
    assert_error(httpx.post(server.url + "/v1/responses", json=body), status, param)


def test_output_items_stream_text_then_calls():
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    items = OutputItems(plan_tools(tools, "auto", True, "hermes"))
    text = "Checking." + CALL_TEXT
    events = []
    for i in range(0, len(text), 5):
        events += items.feed(text[i : i + 5], False)
    events += items.feed("", True)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.output_item.done"
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1]
    message, call = items.items
    assert message["content"][0]["text"] == "Checking." and call["name"] == "get_weather"
    assert message["status"] == call["status"] == "completed"


def test_auto_tool_choice_needs_a_template_that_shows_tools():
    """As on chat (#39): with the bundled model's template, which drops ``tools``, "auto" (the
    default with tools) is a 400 naming ``tool_choice``, not prose that ignores the tools."""
    fake = FakeEngine(
        MODEL_DIR, step_s=0.0005, tool_call_parser="hermes", enable_auto_tool_choice=True
    )
    llm = AsyncLLM(fake)
    srv = LiveServer(llm)
    try:
        body = {"model": "fake-model", "input": "Weather?", "tools": [WEATHER]}
        error = assert_error(httpx.post(srv.url + "/v1/responses", json=body), 400, "tool_choice")
        assert "does not show the tools" in error["message"]
        body["tool_choice"] = "required"  # the grammar writes the call: works with any template
        assert httpx.post(srv.url + "/v1/responses", json=body).status_code == 200
    finally:
        srv.close()
        llm.shutdown()
