"""``/openapi.json`` and bounded schemathesis runs against the FakeEngine server: zero 5xx.

The document describes every route ``build_app`` serves (and nothing else); one run covers
every route, and a short one the routes #35 added (``/v1/responses``, its GET / DELETE, and the
sleep routes on a server in sleep mode). (The same fuzzer runs a smaller number of cases
against the real tiny engine in ``test_openai_server_real.py``.)
"""

from __future__ import annotations

import httpx2 as httpx
import pytest
from fake_engine import FakeEngine
from fuzz import fuzz_server
from server_harness import MODEL_DIR, LiveServer

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.http.api_server import served_routes
from jaxserve.serving.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest


@pytest.fixture(scope="module")
def server():
    llm = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.0005, max_model_len=256))
    srv = LiveServer(llm)
    yield srv
    srv.close()
    llm.shutdown()


def test_openapi_document_comes_from_the_request_models(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    for model in (CompletionRequest, ChatCompletionRequest, ResponsesRequest):
        assert set(schemas[model.__name__]["properties"]) == set(model.model_fields)
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    assert {"/v1/completions", "/v1/responses", "/tokenize", "/health"} <= set(doc["paths"])


def test_openapi_document_covers_every_route(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    described = {(m.upper(), path) for path, ops in doc["paths"].items() for m in ops}
    assert described == served_routes(server.app)
    operation_ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(operation_ids) == len(set(operation_ids))


@pytest.mark.slow
def test_fuzz_new_routes_no_5xx(server):
    new = ["/v1/responses", "/v1/responses/{response_id}"]
    seen = fuzz_server(server.url, max_examples=40, paths=new)
    assert server.internal_errors == []
    assert seen.get(200, 0) > 0 and any(400 <= s < 500 for s in seen), seen
    llm = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.0005, enable_sleep_mode=True))
    sleepy = LiveServer(llm)
    try:
        seen = fuzz_server(
            sleepy.url, max_examples=20, paths=["/sleep", "/wake_up", "/is_sleeping"]
        )
        assert sleepy.internal_errors == []
        assert seen.get(200, 0) > 0 and any(400 <= s < 500 for s in seen), seen
    finally:
        sleepy.close()
        llm.shutdown()


@pytest.mark.slow
def test_fuzz_fake_engine_no_5xx(server):
    seen = fuzz_server(server.url, max_examples=100)
    assert server.internal_errors == []
    assert sum(seen.values()) >= 50 and any(400 <= s < 500 for s in seen), seen
    assert seen.get(200, 0) > 0, seen
