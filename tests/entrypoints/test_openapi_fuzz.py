"""``/openapi.json`` and a bounded schemathesis run against the FakeEngine server: zero 5xx.

(The same fuzzer runs a smaller number of cases against the real tiny engine in
``test_openai_server_real.py``.)
"""

from __future__ import annotations

import httpx2 as httpx
import pytest
from fake_engine import FakeEngine
from fuzz import fuzz_server
from server_harness import MODEL_DIR, LiveServer

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.serving.protocol import ChatCompletionRequest, CompletionRequest


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
    for model in (CompletionRequest, ChatCompletionRequest):
        assert set(schemas[model.__name__]["properties"]) == set(model.model_fields)
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    assert {"/v1/completions", "/tokenize", "/detokenize", "/health"} <= set(doc["paths"])


@pytest.mark.slow
def test_fuzz_fake_engine_no_5xx(server):
    seen = fuzz_server(server.url, max_examples=100)
    assert server.internal_errors == []
    assert sum(seen.values()) >= 50 and any(400 <= s < 500 for s in seen), seen
    assert seen.get(200, 0) > 0, seen
