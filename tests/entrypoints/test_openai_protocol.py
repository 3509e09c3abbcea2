"""Request validation, SamplingParams mapping, error shapes and logprob formatting (no server)."""

from __future__ import annotations

import pydantic
import pytest

from jaxserve.request_output import Logprob
from jaxserve.serving.errors import APIError, from_validation_error, from_value_error
from jaxserve.serving.json_io import parse_json_body
from jaxserve.serving.logprobs import CompletionLogprobs, chat_logprobs
from jaxserve.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)
from jaxserve.serving.validation import (
    ServingInfo,
    check_priority,
    check_prompt_ids,
    resolve_max_tokens,
)


def _err(model, body) -> APIError:
    with pytest.raises(pydantic.ValidationError) as info:
        model.model_validate(body)
    return from_validation_error(info.value)


INFO = ServingInfo(
    model_name="m",
    model_path="/m",
    max_model_len=100,
    vocab_size=50,
    max_num_batched_tokens=32,
    enable_chunked_prefill=True,
)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
        ({"prompt": "x", "n": "2"}, "n"),
        ({"prompt": "x", "n": 2.0}, "n"),
        ({"prompt": "x", "echo": 1}, "echo"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "stop": ["a", 1]}, "stop"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": [[1], "a"]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"prompt": "x", "top_p": float("inf")}, "top_p"),
        ({"prompt": "x", "logit_bias": {"1": float("-inf")}}, "logit_bias.1"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "suffix": "tail"}, "suffix"),
        ({"prompt": "x", "top_k": 2**40}, "top_k"),
    ],
)
def test_completion_type_errors_name_the_field(body, param):
    error = _err(CompletionRequest, body)
    assert error.status == 400
    assert error.param == param
    assert error.message.startswith(param)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": "hi"}, "messages"),
        ({}, "messages"),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": False, "top_logprobs": 2},
            "top_logprobs",
        ),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "messages.0.content",
        ),
    ],
)
def test_chat_type_errors_name_the_field(body, param):
    error = _err(ChatCompletionRequest, body)
    assert error.status == 400 and error.param == param


def test_prompt_forms_are_accepted():
    for prompt in ("x", ["a", "b"], [1, 2, 3], [[1, 2], [3]], []):
        assert CompletionRequest.model_validate({"prompt": prompt}).prompt == prompt


def test_unknown_fields_are_ignored():
    request = CompletionRequest.model_validate({"prompt": "x", "frobnicate": 1, "suffix": None})
    assert request.prompt == "x"


def test_completion_sampling_params_mapping():
    request = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "n": 2,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 3,
            "min_p": 0.1,
            "presence_penalty": 1,
            "frequency_penalty": -1,
            "repetition_penalty": 1.2,
            "seed": 7,
            "stop": "END",
            "stop_token_ids": [4],
            "ignore_eos": True,
            "min_tokens": 2,
            "logit_bias": {"5": -100},
            "logprobs": 2,
            "echo": True,
            "include_stop_str_in_output": True,
        }
    )
    sp = request.to_sampling_params(9)
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (2, 0.0, 0.5, 3, 0.1)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.seed) == (
        1.0,
        -1.0,
        1.2,
        7,
    )
    assert sp.stop == ["END"] and sp.stop_token_ids == [4] and sp.ignore_eos and sp.min_tokens == 2
    assert sp.logit_bias == {5: -100.0} and sp.max_tokens == 9
    assert sp.logprobs == 2 and sp.prompt_logprobs == 2  # echo + logprobs scores the prompt too
    assert sp.include_stop_str_in_output


def test_chat_sampling_params_mapping():
    base = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(base).to_sampling_params(5).logprobs is None
    request = ChatCompletionRequest.model_validate({**base, "logprobs": True})
    assert request.to_sampling_params(5).logprobs == 0
    request = ChatCompletionRequest.model_validate(
        {**base, "logprobs": True, "top_logprobs": 3, "max_tokens": 7, "max_completion_tokens": 4}
    )
    assert request.to_sampling_params(request.requested_max_tokens).logprobs == 3
    assert request.requested_max_tokens == 4  # max_completion_tokens wins


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_p", 1.01),
        ("top_p", -0.1),
        ("temperature", 2.01),
        ("temperature", -1),
        ("n", 0),
        ("logprobs", 21),
        ("min_p", 2),
        ("presence_penalty", 3),
        ("repetition_penalty", 0),
        ("max_tokens", -1),
    ],
)
def test_out_of_range_is_a_400_naming_the_field(field, value):
    request = CompletionRequest.model_validate({"prompt": "x", field: value})
    with pytest.raises(ValueError) as info:
        request.to_sampling_params(request.max_tokens)
    error = from_value_error(info.value)
    assert error.status == 400 and error.param == field


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_p", 0),
        ("top_p", 1),
        ("temperature", 0),
        ("temperature", 2),
        ("logprobs", 20),
        ("min_p", 1),
        ("presence_penalty", -2),
        ("presence_penalty", 2),
        ("max_tokens", 0),
    ],
)
def test_boundaries_are_accepted_and_carried_into_sampling_params(field, value):
    request = CompletionRequest.model_validate({"prompt": "x", field: value})
    params = request.to_sampling_params(request.max_tokens)
    assert getattr(params, field) == value


def test_tokenize_needs_exactly_one_of_prompt_and_messages():
    assert TokenizeRequest.model_validate({"prompt": "x"}).prompt == "x"
    for body in ({}, {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}):
        assert _err(TokenizeRequest, body).status == 400


@pytest.mark.parametrize(
    "raw",
    [
        b"{:",
        b"[1]",
        b'{"a": NaN}',
        b'{"a": Infinity}',
        b'{"a": -Infinity}',
        b'{"a": 1e999}',
        b"\xff\xfe",
        b"[" * 100000,
    ],
)
def test_strict_json(raw):
    with pytest.raises(APIError) as info:
        parse_json_body(raw)
    assert info.value.status == 400


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "a\\ud83db"}',
        b'{"prompt": ["x", "\\udc00"]}',
        b'{"stop": {"\\ud800": 1}}',
        '{"prompt": "a\ud83db"}'.encode("utf-8", "surrogatepass"),
        '{"prompt": "\ud83d"}'.encode("utf-16-le", "surrogatepass"),
    ],
)
def test_unpaired_surrogates_are_a_400(raw):
    """Found by trying to break the server: a lone surrogate reached sentencepiece and was a 500."""
    with pytest.raises(APIError) as info:
        parse_json_body(raw)
    assert info.value.status == 400 and "surrogate" in info.value.message


def test_surrogate_pairs_and_plain_unicode_parse():
    assert parse_json_body(b'{"prompt": "\\ud83e\\udd99 \\u00e9"}') == {
        "prompt": "\U0001f999 \u00e9"
    }
    assert parse_json_body('{"prompt": "🦙 日本"}'.encode()) == {"prompt": "🦙 日本"}


@pytest.mark.parametrize(
    "field",
    [
        "n",
        "stream",
        "echo",
        "ignore_eos",
        "min_tokens",
        "priority",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "logprobs",
        "seed",
    ],
)
def test_completion_null_means_default(field):
    """OpenAI's spec marks these "or null"; a client that sends null gets the default, not a 400."""
    request = CompletionRequest.model_validate({"prompt": "x", field: None})
    assert getattr(request, field) == CompletionRequest.model_fields[field].default
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens is None


def test_chat_null_means_default():
    body = {
        "messages": [{"role": "user", "content": "y"}],
        "logprobs": None,
        "n": None,
        "stream": None,
        "add_generation_prompt": None,
        "top_logprobs": None,
        "max_completion_tokens": None,
    }
    request = ChatCompletionRequest.model_validate(body)
    assert (request.logprobs, request.n, request.stream, request.add_generation_prompt) == (
        False,
        1,
        False,
        True,
    )
    assert _err(ChatCompletionRequest, {"messages": None}).param == "messages"
    assert _err(CompletionRequest, {"prompt": None}).param == "prompt"


def test_priority_needs_the_priority_policy():
    check_priority(0, INFO)
    with pytest.raises(APIError) as info:
        check_priority(3, INFO)
    assert info.value.param == "priority" and "fcfs" in info.value.message
    check_priority(3, ServingInfo(**{**INFO.__dict__, "scheduling_policy": "priority"}))


def test_prompt_checks_name_lengths():
    with pytest.raises(APIError, match="0 tokens"):
        check_prompt_ids([], INFO)
    with pytest.raises(APIError, match="outside the vocabulary"):
        check_prompt_ids([1, 50], INFO)
    with pytest.raises(APIError) as info:
        check_prompt_ids([1] * 101, INFO)
    assert "100" in info.value.message and "101" in info.value.message
    no_chunking = ServingInfo(**{**INFO.__dict__, "enable_chunked_prefill": False})
    with pytest.raises(APIError, match="32.*40|40.*32"):
        check_prompt_ids([1] * 40, no_chunking)
    check_prompt_ids([1] * 40, INFO)


def test_resolve_max_tokens():
    assert resolve_max_tokens(None, 30, INFO) == 70
    assert resolve_max_tokens(70, 30, INFO) == 70
    for over in (71, 10**30):  # clamped to what max_model_len leaves (vLLM 0.32)
        assert resolve_max_tokens(over, 30, INFO) == 70
    assert resolve_max_tokens(0, 100, INFO) == 0
    assert resolve_max_tokens(-1, 30, INFO) == -1  # left to SamplingParams (a 400 there)
    for requested in (None, 1):
        with pytest.raises(APIError) as info:
            resolve_max_tokens(requested, 100, INFO)
        assert "100" in info.value.message and info.value.param == "prompt"


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"t{i}" for i in ids)

    def convert_ids_to_tokens(self, ids):
        return ["<0xC3>" if i == 9 else f"t{i}" for i in ids]


def test_completion_logprobs_legacy_shape():
    builder = CompletionLogprobs(_Tok())
    builder.add([1, 2], [None, {2: Logprob(-0.5, 2, "B"), 3: Logprob(-0.1, 1, "C")}], 1)
    builder.add(
        [4],
        [{4: Logprob(float("-inf"), 5, None), 3: Logprob(-0.2, 1, "C"), 7: Logprob(-3, 2, "D")}],
        1,
    )
    assert builder.to_dict() == {
        "tokens": ["t1", "B", "t4"],
        "token_logprobs": [None, -0.5, -9999.0],
        "top_logprobs": [None, {"C": -0.1, "B": -0.5}, {"C": -0.2, "t4": -9999.0}],
        "text_offset": [0, 2, 3],
    }


def test_chat_logprobs_shape():
    out = chat_logprobs(
        [2, 9],
        [{2: Logprob(-0.5, 2, "B"), 3: Logprob(-0.1, 1, "C")}, {9: Logprob(-0.3, 1, "\ufffd")}],
        1,
        _Tok(),
    )
    assert out == {
        "content": [
            {
                "token": "B",
                "logprob": -0.5,
                "bytes": [66],
                "top_logprobs": [{"token": "C", "logprob": -0.1, "bytes": [67]}],
            },
            {
                "token": "\ufffd",
                "logprob": -0.3,
                "bytes": [0xC3],
                "top_logprobs": [{"token": "\ufffd", "logprob": -0.3, "bytes": [0xC3]}],
            },
        ]
    }
