"""Chat templates rendered as transformers renders them, against hand-written expectations."""

from __future__ import annotations

import pytest
from tokenizer_testing import LLAMA3_TEMPLATE

from jaxserve.tokenizer import DEFAULT_CHAT_TEMPLATE, ChatTemplateError, render_chat_template
from jaxserve.tokenizer.chat_template import select_chat_template

CHATML_TEMPLATE = (  # Qwen2's, with its default system prompt
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "You are terse. "},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": "parts"}],
    },
]


def test_llama3_template():
    out = render_chat_template(
        LLAMA3_TEMPLATE, CONVERSATION, special_tokens={"bos_token": "<|begin_of_text|>"}
    )
    assert out == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nTwo\nparts<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_chatml_template_and_generation_prompt_flag():
    msgs = [{"role": "user", "content": "Hi"}]
    assert render_chat_template(CHATML_TEMPLATE, msgs) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat_template(CHATML_TEMPLATE, msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_default_template_is_chatml():
    assert select_chat_template(None) == DEFAULT_CHAT_TEMPLATE
    assert (
        render_chat_template(DEFAULT_CHAT_TEMPLATE, [{"role": "user", "content": "Hi"}])
        == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_trim_and_lstrip_blocks():
    template = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "[U] {{ m.content }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
    )
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert render_chat_template(template, msgs) == "[U] a\n[U] c\n"


def test_tojson_keeps_unicode_and_tools_are_passed():
    template = "{{ tools | tojson }}|{{ messages[0] | tojson(indent=None) }}"
    tools = [{"type": "function", "function": {"name": "café", "parameters": {}}}]
    out = render_chat_template(template, [{"role": "user", "content": "é"}], tools=tools)
    assert out == (
        '[{"type": "function", "function": {"name": "café", "parameters": {}}}]|'
        '{"role": "user", "content": "é"}'
    )


def test_raise_exception_becomes_value_error():
    template = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation must start with a user message') }}{% endif %}ok"
    )
    with pytest.raises(ChatTemplateError, match="must start with a user message"):
        render_chat_template(template, [{"role": "assistant", "content": "x"}])
    assert issubclass(ChatTemplateError, ValueError)
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat_template("{% for %}", [{"role": "user", "content": "x"}])


def test_sandbox_blocks_attribute_escape():
    with pytest.raises(ChatTemplateError):
        render_chat_template(
            "{{ messages.__class__.__mro__[1].__subclasses__() }}",
            [{"role": "user", "content": "x"}],
        )


def test_generation_tag_and_extra_kwargs():
    template = (
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    )
    msgs = [{"role": "assistant", "content": "A"}]
    assert render_chat_template(template, msgs, enable_thinking=True) == "A<think>"


def test_named_templates():
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    assert select_chat_template(named) == "D"
    assert select_chat_template(named, tools=[{}]) == "T"
    assert select_chat_template({"default": "D"}, tools=[{}]) == "D"
    with pytest.raises(ValueError, match="none named 'default'"):
        select_chat_template([{"name": "rag", "template": "R"}])
    with pytest.raises(ValueError, match="list entries"):
        select_chat_template([{"template": "R"}])


@pytest.mark.parametrize(
    "messages, field",
    [
        ([], "messages must be a non-empty list"),
        ("hi", "messages must be a non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\].role"),
        (
            [{"role": "user", "content": "x"}, {"role": "user"}],
            r"messages\[1\].content is required",
        ),
        ([{"role": "user", "content": 5}], r"messages\[0\].content must be a string"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            r"messages\[0\].content\[0\].type must be 'text'",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            r"messages\[0\].content\[0\].text",
        ),
        ([{"role": "user", "content": ["x"]}], r"messages\[0\].content\[0\] must be an object"),
    ],
)
def test_message_validation_names_the_field(messages, field):
    with pytest.raises(ValueError, match=field):
        render_chat_template(DEFAULT_CHAT_TEMPLATE, messages)


def test_assistant_tool_call_message_without_content():
    msgs = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    out = render_chat_template(
        "{% for m in messages %}[{{ m.content }}|{{ m.tool_calls | length }}]{% endfor %}", msgs
    )
    assert out == "[x|0][|1]"


def test_tokenizer_apply_chat_template(sp_tokenizer, bpe_dir):
    from jaxserve.tokenizer import get_tokenizer

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = sp_tokenizer.apply_chat_template(msgs)
    assert text == "<s>Be brief.\n\n<|user|>\nHi\n<|assistant|>\n"  # the bundled plain template
    ids = sp_tokenizer.encode_chat(msgs)
    assert ids[0] == 1 and ids.count(1) == 1  # the template's BOS, not a second one
    assert sp_tokenizer.decode(ids) == text[len("<s>") :]
    bpe = get_tokenizer(bpe_dir)
    text = bpe.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|begin_of_text|><|start_header_id|>user")
    assert bpe.encode_chat([{"role": "user", "content": "Hi"}]).count(0) == 1
    assert (
        bpe.apply_chat_template([{"role": "user", "content": "Hi"}], chat_template="X{{ 1 }}")
        == "X1"
    )
