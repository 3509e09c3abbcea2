"""The HTTP server over the scripted FakeEngine: shapes, streaming, errors, aborts, metrics, death.

The fake engine runs the real tokenizer and incremental detokenizer, so streaming and
stop-string behaviour here is the server's and the detokenizer's for real; only the model is
scripted. ``test_openai_server_real.py`` repeats the end-to-end cases on the bundled model.
"""

from __future__ import annotations

import threading
import time

import httpx2 as httpx
import pytest
from fake_engine import FakeEngine
from server_harness import MODEL_DIR, LiveServer, assert_error, metric_values, sse, wait_idle

from jaxserve.engine.async_llm import AsyncLLM

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSG = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server():
    llm = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.002, max_model_len=256))
    srv = LiveServer(llm)
    yield srv
    srv.close()
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


# ---- plain endpoints ---------------------------------------------------------------------------


def test_models_health_version(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
    assert models["data"][0]["object"] == "model" and models["data"][0]["max_model_len"] == 256
    assert client.get("/v1/models/fake-model").json() == models["data"][0]
    error = assert_error(client.get("/v1/models/other"), 404, "model", "model_not_found")
    assert "other" in error["message"]
    assert client.get("/health").status_code == 200
    assert client.get("/version").json()["version"]


def test_tokenize_detokenize(client, server):
    tok = server.llm.tokenizer
    r = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    chat = client.post("/tokenize", json={"messages": MSG}).json()
    assert chat["tokens"] == tok.encode_chat(MSG)
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {
        "prompt": "Hello world"
    }
    assert_error(client.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    assert_error(client.post("/tokenize", json={"prompt": 3}), 400, "prompt")


def test_generate_server_refuses_pooling_routes(client):
    for url, body in [
        ("/v1/embeddings", {"input": "Hello"}),
        ("/pooling", {"input": [1, 2, 3]}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
    ]:
        error = assert_error(client.post(url, json=body), 400, "model", "model_not_supported")
        assert "--runner pooling" in error["message"]


# ---- non-streaming shapes ----------------------------------------------------------------------


def test_completion_shape_and_usage(client, server):
    r = client.post(COMPL, json={"model": "fake-model", "prompt": "Hello", "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "fake-model" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert (
        choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    )
    assert choice["text"]
    n_prompt = len(server.llm.tokenizer.encode("Hello"))
    assert body["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 5,
        "total_tokens": n_prompt + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_completion_prompt_lists_and_n(client):
    body = client.post(COMPL, json={"prompt": ["Hello", "Bye now"], "n": 2, "max_tokens": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 12
    tokens = client.post(COMPL, json={"prompt": [[1, 300, 400], [1, 500]], "max_tokens": 2}).json()
    assert [c["index"] for c in tokens["choices"]] == [0, 1]
    assert tokens["usage"]["prompt_tokens"] == 5


def test_echo_max_tokens_0(client, server):
    """Case echo-max-tokens-0: scoring a prompt returns it and its logprobs, no completion tokens."""
    n_prompt = len(server.llm.tokenizer.encode("Hello world"))
    body = client.post(
        COMPL, json={"prompt": "Hello world", "echo": True, "logprobs": 1, "max_tokens": 0}
    ).json()
    (choice,) = body["choices"]
    assert choice["text"] == "Hello world" and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n_prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    plain = client.post(COMPL, json={"prompt": "Hello world", "max_tokens": 0}).json()
    assert plain["choices"][0]["text"] == "" and plain["usage"]["completion_tokens"] == 0
    one = client.post(
        COMPL, json={"prompt": "Hello world", "max_tokens": 1, "echo": True, "logprobs": 0}
    ).json()
    assert one["usage"]["completion_tokens"] == 1
    assert len(one["choices"][0]["logprobs"]["tokens"]) == n_prompt + 1
    assert one["choices"][0]["text"].startswith("Hello world")


def test_chat_shape_and_logprobs(client):
    body = client.post(
        CHAT,
        json={
            "messages": MSG,
            "max_completion_tokens": 4,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice in body["choices"]:
        assert choice["message"]["role"] == "assistant" and isinstance(
            choice["message"]["content"], str
        )
        content = choice["logprobs"]["content"]
        assert len(content) == 4
        for entry in content:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert len(entry["top_logprobs"]) == 2
            assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
    assert body["usage"]["completion_tokens"] == 8


# ---- streaming ---------------------------------------------------------------------------------


@pytest.mark.parametrize("include_usage", [False, True])
def test_streamed_completion_matches_non_streamed(client, include_usage):
    body = {"prompt": ["Hello", "Bye now"], "max_tokens": 12, "n": 2, "temperature": 0}
    full = client.post(COMPL, json=body).json()
    stream_body = {**body, "stream": True}
    if include_usage:
        stream_body["stream_options"] = {"include_usage": True}
    events = sse(client, COMPL, stream_body)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    usage_chunks = [c for c in chunks if c.get("usage")]
    if include_usage:
        assert usage_chunks == [chunks[-1]] and chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == full["usage"]
        assert all(c["usage"] is None for c in chunks[:-1])
    else:
        assert not usage_chunks and all("usage" not in c for c in chunks)
    for index in range(4):  # prompt_index * n + sample
        mine = [
            c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index
        ]
        assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
        assert "".join(c["text"] for c in mine) == full["choices"][index]["text"]
        assert [c["finish_reason"] for c in mine].count("length") == 1 and mine[-1][
            "finish_reason"
        ] == "length"


def test_streamed_chat_role_first_and_joined_text(client):
    body = {"messages": MSG, "max_tokens": 10}
    full = client.post(CHAT, json=body).json()
    events = sse(client, CHAT, {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert "".join(d.get("content", "") for d in deltas) == full["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == full["usage"]


def test_streamed_echo_with_logprobs(client):
    full = client.post(
        COMPL, json={"prompt": "Hello", "max_tokens": 3, "echo": True, "logprobs": 1}
    ).json()
    chunks = sse(
        client,
        COMPL,
        {"prompt": "Hello", "max_tokens": 3, "echo": True, "logprobs": 1, "stream": True},
    )[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    joined = {
        k: sum((c["choices"][0]["logprobs"][k] for c in chunks), [])
        for k in full["choices"][0]["logprobs"]
    }
    assert joined == full["choices"][0]["logprobs"]


def test_stop_strings_streamed_and_not(client):
    """Case stop-string-leak (scripted model): text cut at the stop string, no delta past the cut."""
    base = {"prompt": "Hello", "max_tokens": 50, "temperature": 0}
    greedy = client.post(COMPL, json=base).json()["choices"][0]["text"]
    assert "lazy dog" in greedy
    for stop in ("lazy dog", "az", "\U0001f642"):
        cut = greedy.index(stop)
        for include in (False, True):
            body = {**base, "stop": [stop], "include_stop_str_in_output": include}
            expected = greedy[: cut + len(stop)] if include else greedy[:cut]
            full = client.post(COMPL, json=body).json()["choices"][0]
            assert (
                full["text"] == expected
                and full["finish_reason"] == "stop"
                and full["stop_reason"] == stop
            )
            chunks = sse(client, COMPL, {**body, "stream": True})[:-1]
            sent = ""
            for c in chunks:
                sent += c["choices"][0]["text"]
                assert expected.startswith(sent), (stop, include, sent)
            assert sent == expected and chunks[-1]["choices"][0]["finish_reason"] == "stop"


# ---- bad input ---------------------------------------------------------------------------------

BAD_REQUESTS = [
    # case wrong-types
    (CHAT, b"{:", None),
    (CHAT, {"messages": "hi"}, "messages"),
    (COMPL, {"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    (COMPL, {"prompt": "x", "stop": 5}, "stop"),
    (CHAT, {"messages": MSG, "n": "2"}, "n"),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (COMPL, b"[1, 2]", None),
    (COMPL, b"", None),
    (COMPL, b"\xff", None),
    (COMPL, b'{"prompt": "x", "temperature": NaN}', None),
    (COMPL, b'{"prompt": "x", "top_p": Infinity}', None),
    (COMPL, b'{"prompt": "x", "top_p": -Infinity}', None),
    (COMPL, b'{"prompt": "x", "temperature": 1e999}', None),
    # case top-p-boundaries
    (COMPL, {"prompt": "x", "top_p": 1.01}, "top_p"),
    (COMPL, {"prompt": "x", "top_p": -0.1}, "top_p"),
    (COMPL, {"prompt": "x", "temperature": 2.01}, "temperature"),
    (CHAT, {"messages": MSG, "temperature": -1}, "temperature"),
    # case empty-prompt
    (COMPL, {"prompt": []}, "prompt"),
    (COMPL, {"prompt": [[]]}, "prompt"),
    # ranges and the rest
    (COMPL, {"prompt": "x", "n": 0}, "n"),
    (COMPL, {"prompt": "x", "n": 129}, "n"),
    (COMPL, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    (COMPL, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (COMPL, {"prompt": "x", "seed": 2**70}, "seed"),
    (COMPL, {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    (COMPL, {"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
    (COMPL, {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    (COMPL, {"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
    (COMPL, {"prompt": [1, 99999]}, "prompt"),
    (COMPL, {"prompt": [-1]}, "prompt"),
    (COMPL, {"prompt": "x", "stop": [""]}, "stop"),
    (COMPL, {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    (COMPL, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": -1}, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": -1}, "max_tokens"),
    # unpaired surrogates were a 500 (sentencepiece cannot encode them)
    (COMPL, b'{"prompt": "a\\ud83db"}', None),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', None),
    (
        COMPL,
        {"prompt": "x", "priority": 1},
        "priority",
    ),  # ignored under fcfs otherwise (vLLM refuses it too)
    (
        CHAT,
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        "messages.0.content",
    ),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages.0.role"),
    (COMPL, {"prompt": [1] * 256}, "prompt"),
    (COMPL, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (COMPL, {"prompt": "x", "best_of": 2}, "best_of"),
    (COMPL, {"prompt": "x", "priority": 2**64}, "priority"),
    (COMPL, {"prompt": "x", "top_k": -2}, "top_k"),
]


def test_bad_input_sweep(client, server):
    """Cases wrong-types, top-p-boundaries, empty-prompt and friends: each a 400 naming the field."""
    for path, body, param in BAD_REQUESTS:
        if isinstance(body, bytes):
            r = client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = client.post(path, json=body)
        assert_error(r, 400, param)
    assert client.get("/health").status_code == 200
    assert client.post(COMPL, json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert server.internal_errors == []


def test_boundaries_accepted(client):
    for field, value in [("top_p", 0), ("top_p", 1), ("temperature", 0), ("temperature", 2)]:
        assert (
            client.post(COMPL, json={"prompt": "x", "max_tokens": 2, field: value}).status_code
            == 200
        )
    # top_p == 1 is "off": identical to not sending it (seeded sampling)
    a = client.post(COMPL, json={"prompt": "x", "max_tokens": 4, "seed": 3, "top_p": 1}).json()
    b = client.post(COMPL, json={"prompt": "x", "max_tokens": 4, "seed": 3}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_null_optional_fields_mean_default(client):
    """OpenAI's spec allows null for n, stream, echo, chat logprobs, ...; they were a 400."""
    r = client.post(
        COMPL, json={"prompt": "x", "max_tokens": 2, "n": None, "stream": None, "echo": None}
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    r = client.post(
        CHAT, json={"messages": MSG, "max_tokens": 2, "logprobs": None, "n": None, "stream": None}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


WEIRD_VALUES = [
    None,
    "",
    "x",
    -1,
    0,
    1,
    2.5,
    -1e308,
    1e308,
    2**70,
    True,
    [],
    [1],
    ["a"],
    {},
    {"a": 1},
]
FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "logprobs",
    "echo",
    "n",
    "stream",
    "stream_options",
    "priority",
    "cache_salt",
    "user",
    "include_stop_str_in_output",
    "best_of",
    "suffix",
    "skip_special_tokens",
    "prompt_logprobs",
]


def test_field_fuzz_never_500(client, server):
    """Every field set to every odd JSON value: never a 5xx, the server keeps serving."""
    base = {"prompt": "Hi", "max_tokens": 2}
    for field in FIELDS:
        for value in WEIRD_VALUES:
            body = {**base, field: value}
            r = client.post(COMPL, json=body)
            assert r.status_code in (200, 400, 404), (field, value, r.status_code, r.text)
            if r.status_code != 200:
                assert_error(r, r.status_code)
    for field in (
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "add_generation_prompt",
    ):
        for value in WEIRD_VALUES:
            r = client.post(CHAT, json={"messages": MSG, "max_tokens": 2, field: value})
            assert r.status_code in (200, 400), (field, value, r.status_code, r.text)
    assert server.internal_errors == []
    assert client.get("/health").status_code == 200


def test_unknown_model_is_404_without_engine_work(client, server):
    steps = server.llm.engine.num_steps
    for path, body in [
        (CHAT, {"model": "does-not-exist", "messages": MSG}),
        (COMPL, {"model": "does-not-exist", "prompt": "hi"}),
    ]:
        error = assert_error(client.post(path, json=body), 404, "model", "model_not_found")
        assert "does-not-exist" in error["message"]
    assert server.llm.engine.num_steps == steps


def test_unknown_route_and_method(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get(COMPL), 405)


def test_long_prompt_then_normal_request(client, server):
    """Case long-prompt-blocks-queue (a): a 400 naming both lengths; the next request is served."""
    long_prompt = [1] + [500] * 300
    error = assert_error(
        client.post(COMPL, json={"prompt": long_prompt, "max_tokens": 1}), 400, "prompt"
    )
    assert "256" in error["message"] and "301" in error["message"]
    # prompt + max_tokens beyond max_model_len: clamped to what it leaves (vLLM 0.32)
    over = client.post(COMPL, json={"prompt": [1] + [500] * 250, "max_tokens": 10**30})
    assert over.status_code == 200 and over.json()["usage"]["completion_tokens"] <= 5
    start = time.monotonic()
    assert (
        client.post(COMPL, json={"prompt": "one two three four five", "max_tokens": 5}).status_code
        == 200
    )
    assert time.monotonic() - start < 5
    assert wait_idle(client, server.llm)[1]


def test_prompt_over_budget_without_chunked_prefill():
    """Case long-prompt-blocks-queue (b): chunked prefill off, a prompt over the token budget is
    a clear 400 naming both numbers; the next request is served and the queue drains."""
    llm = AsyncLLM(FakeEngine(MODEL_DIR, enable_chunked_prefill=False, max_num_batched_tokens=32))
    srv = LiveServer(llm)
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            error = assert_error(
                c.post(COMPL, json={"prompt": [1] + [500] * 40, "max_tokens": 1}), 400, "prompt"
            )
            assert "32" in error["message"] and "41" in error["message"]
            assert (
                c.post(
                    COMPL, json={"prompt": "one two three four five", "max_tokens": 5}
                ).status_code
                == 200
            )
            assert wait_idle(c, llm)[1]
    finally:
        srv.close()
        llm.shutdown()


def test_empty_chat_content_is_served(client):
    """Case empty-prompt (chat): the template and BOS make the prompt non-empty: a normal answer."""
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": ""}], "max_tokens": 2})
    assert r.status_code == 200
    r = client.post(COMPL, json={"prompt": [""], "max_tokens": 2})  # BOS only: served
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1


# ---- aborts and metrics ------------------------------------------------------------------------


def test_abort_n2_leak_streaming(client, server):
    """Case abort-n2-leak: closing an n=2 stream after 3 chunks aborts both samples, 20 times."""
    body = {
        "prompt": "Tell me a long story",
        "n": 2,
        "ignore_eos": True,
        "max_tokens": 200,
        "stream": True,
    }
    before = metric_values(client)
    for _ in range(20):
        with client.stream("POST", COMPL, json=body) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == 3:
                        break
    m, idle = wait_idle(client, server.llm)
    assert idle, m
    assert not server.llm.engine._reqs
    aborted = (
        m["jaxserve:request_success_total[abort]"] - before["jaxserve:request_success_total[abort]"]
    )
    assert aborted == 40


def test_non_streaming_client_timeout_aborts(server):
    with httpx.Client(base_url=server.url, timeout=0.3) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(COMPL, json={"prompt": "x", "n": 2, "ignore_eos": True, "max_tokens": 250})
    with httpx.Client(base_url=server.url, timeout=10) as c:
        assert wait_idle(c, server.llm)[1]
    assert not server.llm.engine._reqs


def test_metrics_count_tokens(client):
    before = metric_values(client)
    body = client.post(COMPL, json={"prompt": "Hello", "max_tokens": 7, "n": 2}).json()
    after = metric_values(client)
    assert (
        after["jaxserve:generation_tokens_total"] - before["jaxserve:generation_tokens_total"] == 14
    )
    assert (
        after["jaxserve:prompt_tokens_total"] - before["jaxserve:prompt_tokens_total"]
        == body["usage"]["prompt_tokens"]
    )
    assert (
        after["jaxserve:request_success_total[length]"]
        - before["jaxserve:request_success_total[length]"]
        == 2
    )
    assert (
        after["jaxserve:e2e_request_latency_seconds_count"]
        - before["jaxserve:e2e_request_latency_seconds_count"]
    ) == 1
    for name in (
        "jaxserve:time_to_first_token_seconds_count",
        "jaxserve:inter_token_latency_seconds_count",
        "jaxserve:request_queue_time_seconds_count",
        "jaxserve:num_preemptions_total",
        "jaxserve:prefix_cache_queries_total",
        "jaxserve:prefix_cache_hits_total",
        "jaxserve:num_requests_waiting",
    ):
        assert name in after
    assert any(k.startswith("jaxserve:cache_config_info") for k in after)


# ---- separate servers: auth, overload, slow steps, death -----------------------------------------


def test_api_key():
    llm = AsyncLLM(FakeEngine(MODEL_DIR))
    srv = LiveServer(llm, api_key="sesame")
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            assert_error(c.get("/v1/models"), 401, code="invalid_api_key")
            assert_error(
                c.post(COMPL, json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401
            )
            assert_error(c.post("/tokenize", json={"prompt": "x"}), 401)
            assert_error(
                c.post(COMPL, json={"prompt": "x"}, headers={"Authorization": "Basic sesame"}), 401
            )
            assert_error(
                c.post(COMPL, json={"prompt": "x"}, headers={"Authorization": "sesame"}), 401
            )
            for scheme in (
                "Bearer",
                "bearer",
                "BEARER",
            ):  # the scheme is case-insensitive (RFC 7235)
                ok = c.post(
                    COMPL,
                    json={"prompt": "x", "max_tokens": 1},
                    headers={"Authorization": f"{scheme} sesame"},
                )
                assert ok.status_code == 200
            assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    finally:
        srv.close()
        llm.shutdown()


def test_overload_503_and_event_loop_not_blocked():
    """One running slot, a cap of one waiting request: the third gets 503 with Retry-After; a slow
    step (0.5 s) never delays /health (the engine steps in its own thread)."""
    llm = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.5, max_num_seqs=1, max_waiting_requests=1))
    srv = LiveServer(llm)
    results = {}
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:

            def run(name, max_tokens):
                results[name] = c.post(
                    COMPL, json={"prompt": "x", "max_tokens": max_tokens}
                ).status_code

            first = threading.Thread(target=run, args=("first", 3))
            first.start()
            deadline = time.monotonic() + 5
            while llm.num_running_requests < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            second = threading.Thread(target=run, args=("second", 1))
            second.start()
            while llm.num_waiting_requests < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            r = c.post(COMPL, json={"prompt": "x", "max_tokens": 1})
            assert_error(r, 503, code="server_overloaded")
            assert r.headers["Retry-After"]
            worst = 0.0
            for _ in range(5):
                t = time.monotonic()
                assert c.get("/health").status_code == 200
                worst = max(worst, time.monotonic() - t)
            assert worst < 0.3, worst
            first.join()
            second.join()
        assert results == {"first": 200, "second": 200}
    finally:
        srv.close()
        llm.shutdown()


def test_engine_death_reports_errors_and_exits_nonzero():
    llm = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.01, fail_at_step=10))
    srv = LiveServer(llm, dead_grace_s=1.0)
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        events = sse(c, COMPL, {"prompt": "x", "max_tokens": 100, "stream": True})
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_dead"
        assert_error(c.get("/health"), 503, code="engine_dead")
        assert_error(c.post(COMPL, json={"prompt": "x"}), 503, code="engine_dead")
    assert srv.wait_stopped(10) == 1
    assert srv.internal_errors == []


# ---- non-HTTP entry (batch CLI), startup report, CLI ---------------------------------------------


def test_serve_request_without_http(server):
    import asyncio

    from jaxserve.serving.endpoints import serve_request

    llm = server.llm

    async def main():
        return await asyncio.gather(
            serve_request(llm, COMPL, {"prompt": "Hello", "max_tokens": 3}),
            serve_request(llm, CHAT, {"messages": MSG, "max_tokens": 2, "n": 2}),
            serve_request(llm, CHAT, {"messages": MSG, "stream": True}),
            serve_request(llm, "/v1/embeddings", {"input": "x"}),
            serve_request(llm, CHAT, {"model": "nope", "messages": MSG}),
            serve_request(llm, COMPL, {"prompt": "x", "max_tokens": "3"}),
        )

    (s1, b1), (s2, b2), (s3, b3), (s4, b4), (s5, b5), (s6, b6) = asyncio.run(main())
    assert s1 == 200 and b1["object"] == "text_completion" and b1["usage"]["completion_tokens"] == 3
    assert s2 == 200 and b2["object"] == "chat.completion" and len(b2["choices"]) == 2
    assert (s3, b3["error"]["param"]) == (400, "stream")
    assert (s4, b4["error"]["param"]) == (400, "model")  # a generate server: --runner pooling
    assert (s5, b5["error"]["code"]) == (404, "model_not_found")
    assert (s6, b6["error"]["param"]) == (400, "max_tokens")


def test_startup_report(server):
    from types import SimpleNamespace

    from jaxserve.entrypoints.serve import startup_report

    report = startup_report(server.llm, 1.5)
    assert "served_model_name': 'fake-model'" in report
    assert "KV pool: 64 blocks x 16 tokens (1008 usable tokens" in report
    assert "1.5 s" in report
    # with a real engine the model runner's warm-up time is reported (it was never found before)
    runner = SimpleNamespace(
        compile_seconds=18.75, token_buckets=(16, 32, 64), seq_buckets=(16, 32)
    )
    real_like = SimpleNamespace(
        engine_config=server.llm.engine_config, engine=SimpleNamespace(runner=runner)
    )
    report = startup_report(real_like, 21.0)
    assert "compile time: 18.8 s (startup 21.0 s)" in report
    assert "step token buckets: [16, 32, 64] (sequence buckets [16, 32])" in report


def test_serve_cli_flags():
    from jaxserve.cli import build_parser
    from jaxserve.config import EngineArgs
    from jaxserve.entrypoints.serve import run_serve

    argv = [
        "serve",
        "some/model",
        "--port",
        "0",
        "--api-key",
        "k",
        "--max-num-seqs",
        "4",
        "--served-model-name",
        "m",
        "--no-enable-prefix-caching",
        "--max-waiting-requests",
        "3",
    ]
    args = build_parser(argv).parse_args(argv)
    assert args.func is run_serve and (args.host, args.port, args.api_key) == (
        "127.0.0.1",
        0,
        ["k"],
    )
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.model, engine_args.max_num_seqs, engine_args.served_model_name) == (
        "some/model",
        4,
        "m",
    )
    assert engine_args.enable_prefix_caching is False and engine_args.max_waiting_requests == 3
    defaults = build_parser(["serve"]).parse_args(["serve"])
    assert (defaults.host, defaults.port) == ("127.0.0.1", 8000)
