"""The common ``serve`` flags of vLLM, on the scripted FakeEngine: ``--served-model-name`` with
aliases, ``--generation-config``, ``--max-logprobs``, ``--return-tokens-as-token-ids``,
``--enable-log-requests`` / ``--max-log-len``, ``--chat-template`` (inline and a file),
``--tokenizer``, ``--enable-auto-tool-choice``; each parsed from the command line, in the
resolved-config line, and a bad value a one-line error before anything loads."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

import httpx2 as httpx
import pytest
from fake_engine import FakeEngine
from server_harness import MODEL_DIR, LiveServer, assert_error

from jaxserve.cli import build_parser
from jaxserve.config import EngineArgs, ServingConfig
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.http.api_server import SERVING
from jaxserve.entrypoints.serve import config_report
from jaxserve.serving.chat import prepare_chat
from jaxserve.serving.protocol import ChatCompletionRequest

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[answer]"
ASK = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A copy of the bundled tokenizer whose own chat template says ``<<{role}>>``."""
    folder = tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(os.path.join(MODEL_DIR, name), folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def generation_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generation")
    gen = {"temperature": 0.25, "top_k": 7, "max_new_tokens": 5, "do_sample": True}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return str(folder)


@pytest.fixture(scope="module")
def server(tokenizer_dir, generation_dir):
    fake = FakeEngine(
        MODEL_DIR,
        step_s=0.0005,
        served_model_name=["fake-model", "alias"],
        tokenizer=tokenizer_dir,
        generation_config=generation_dir,
        max_logprobs=2,
        return_tokens_as_token_ids=True,
        enable_log_requests=True,
        max_log_len=6,
        tool_call_parser="hermes",
    )
    llm = AsyncLLM(fake)
    srv = LiveServer(llm)
    yield srv
    srv.close()
    llm.shutdown()
    assert not srv.internal_errors


def test_cli_flags_reach_the_config_and_its_report(tmp_path, generation_dir):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    argv = [
        "serve",
        MODEL_DIR,
        "--served-model-name",
        "a",
        "b",
        "--chat-template",
        str(template),
        "--generation-config",
        generation_dir,
        "--max-logprobs",
        "5",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--tokenizer",
        MODEL_DIR,
        "--enable-log-requests",
        "--max-log-len",
        "40",
        "--return-tokens-as-token-ids",
        "--enable-sleep-mode",
        "--allowed-origins",
        '["http://a.example", "http://b.example"]',
        "--allowed-methods",
        "GET,POST",
        "--allow-credentials",
        "--root-path",
        "/llm",
    ]
    args = build_parser(argv).parse_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.check()
    assert config.model.served_model_name == "a" and config.model.served_model_aliases == ("b",)
    assert config.model.tokenizer == MODEL_DIR and config.model.enable_sleep_mode
    assert config.serving == ServingConfig(
        chat_template=str(template),
        generation_config=generation_dir,
        max_logprobs=5,
        enable_auto_tool_choice=True,
        return_tokens_as_token_ids=True,
        enable_log_requests=True,
        max_log_len=40,
    )
    assert args.allowed_origins == ["http://a.example", "http://b.example"]
    assert args.allowed_methods == ["GET", "POST"] and args.allow_credentials
    report = "\n".join(config_report(config, args))
    for shown in (
        "'served_model_aliases': ('b',)",
        "'enable_sleep_mode': True",
        f"'tokenizer': '{MODEL_DIR}'",
        "'max_logprobs': 5",
        "'enable_auto_tool_choice': True",
        "'return_tokens_as_token_ids': True",
        "'enable_log_requests': True",
        f"'generation_config': '{generation_dir}'",
        "'chat_template': ",
        "'root_path': '/llm'",
        "'allow_credentials': True",
        "'ssl_certfile': None",
    ):
        assert shown in report, shown


@pytest.mark.parametrize(
    "flags,named",
    [
        ({"enable_auto_tool_choice": True}, "enable_auto_tool_choice needs tool_call_parser"),
        ({"max_logprobs": 21}, "max_logprobs"),
        ({"generation_config": "/no/such/dir"}, "generation_config"),
        ({"chat_template": "/no/such/template.jinja"}, "chat_template"),
        ({"chat_template": "{% for m in messages %}"}, "chat_template"),
        ({"tokenizer": "/tmp"}, "tokenizer"),
        ({"served_model_name": ["a", "a"]}, "served_model_name"),
    ],
)
def test_bad_flags_are_named_before_loading(flags, named):
    with pytest.raises(ValueError, match=named):
        EngineArgs(model=MODEL_DIR, **flags).check()


def test_bad_generation_config_values_are_named(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match="generation_config: .*temperature"):
        EngineArgs(model=MODEL_DIR, generation_config=str(tmp_path)).check()
    assert ServingConfig(generation_config="vllm").default_sampling_params(str(tmp_path)) == {}


def test_served_model_aliases(server):
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["fake-model", "alias"]
    assert httpx.get(server.url + "/v1/models/alias").json()["id"] == "alias"
    r = httpx.post(server.url + "/v1/completions", json={"model": "alias", "prompt": "Hi"})
    assert r.status_code == 200 and r.json()["model"] == "alias"
    assert_error(
        httpx.post(server.url + "/v1/completions", json={"model": "x", "prompt": "Hi"}), 404
    )


def test_generation_config_defaults_and_cap(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi"})  # OpenAI's 16 -> 5
    assert r.json()["usage"]["completion_tokens"] == 5
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 3})
    assert r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(server.url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 50})
    assert r.json()["usage"]["output_tokens"] == 5  # max_new_tokens caps, as in vLLM
    request = ChatCompletionRequest.model_validate({"messages": ASK, "temperature": 0.9})
    job = prepare_chat(request, server.app[SERVING].info, server.llm.tokenizer)
    assert (job.params.temperature, job.params.top_k, job.params.max_tokens) == (0.9, 7, 5)


def test_max_logprobs(server):
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "logprobs": 2})
    assert ok.status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "logprobs": 3})
    assert "max_logprobs (2)" in assert_error(r, 400, "logprobs")["message"]
    body = {"messages": ASK, "logprobs": True, "top_logprobs": 3}
    assert_error(httpx.post(server.url + "/v1/chat/completions", json=body), 400, "top_logprobs")


def test_return_tokens_as_token_ids(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "logprobs": 1}).json()
    tokens = r["choices"][0]["logprobs"]["tokens"]
    assert tokens and all(re.fullmatch(r"token_id:\d+", t) for t in tokens)
    body = {"messages": ASK, "logprobs": True, "top_logprobs": 1, "max_tokens": 3}
    content = httpx.post(server.url + "/v1/chat/completions", json=body).json()
    first = content["choices"][0]["logprobs"]["content"][0]
    assert re.fullmatch(r"token_id:\d+", first["token"])
    assert first["bytes"] == list(first["token"].encode())
    assert all(re.fullmatch(r"token_id:\d+", t["token"]) for t in first["top_logprobs"])


def test_log_requests(server, caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve.serving.endpoints"):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time"})
    rid = r.json()["id"]
    (line,) = [rec.getMessage() for rec in caplog.records if rid in rec.getMessage()]
    ids = server.llm.tokenizer.encode("Once upon a time")
    assert f"({len(ids)} tokens): {ids[:6]}" in line  # cut to --max-log-len 6
    assert "temperature=" in line


def test_tokenizer_and_chat_template(server, tokenizer_dir):
    r = httpx.post(server.url + "/tokenize", json={"messages": ASK, "add_special_tokens": False})
    text = server.llm.tokenizer.decode(r.json()["tokens"], skip_special_tokens=False)
    assert "<<user>>Hi" in text  # --tokenizer's own template
    inline = FakeEngine(MODEL_DIR, chat_template=TEMPLATE).tokenizer
    assert inline.apply_chat_template(ASK) == "[user] Hi\n[answer]"


def test_auto_tool_choice_needs_the_flag(server):
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"messages": ASK, "tools": tools, "tool_choice": "auto"}
    error = assert_error(httpx.post(server.url + "/v1/chat/completions", json=body), 400)
    assert "--enable-auto-tool-choice" in error["message"]
