"""``/openapi.json`` says what the validation does, and a bounded schemathesis run with its
strict checks against the FakeEngine server finds no mismatch (#38 deliverable 7): no 5xx,
schema-valid bodies accepted, schema-invalid ones refused; the bodies of odd types the issue
found accepted beyond the document (``n: null``, ``ignore_eos: null``, a UTF-16 body,
``text/plain``) are each documented or refused.

The document describes every route ``build_app`` serves (and nothing else); one run covers
every route, and a short one the routes #35 added (``/v1/responses``, its GET / DELETE, and the
sleep routes on a server in sleep mode). (The same fuzzer runs a smaller number of cases
against the real tiny engine in ``test_openai_server_real.py``, checking no 5xx only.)
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
    # a context long enough for any prompt the document allows (the fake engine computes nothing)
    llm = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.0005, max_model_len=8192))
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
def test_fuzz_fake_engine_strict_checks(server):
    seen = fuzz_server(server.url, max_examples=200)
    assert server.internal_errors == []
    assert sum(seen.values()) >= 100 and any(400 <= s < 500 for s in seen), seen
    assert seen.get(200, 0) > 0, seen


def _schema_accepts(schema: dict, components: dict, body: dict) -> bool:
    import jsonschema

    resolver_root = {"components": {"schemas": components}, **schema}
    validator = jsonschema.Draft202012Validator(resolver_root)
    return validator.is_valid(body)


@pytest.mark.parametrize(
    "body, documented",
    [
        ({"prompt": "x", "max_tokens": 2, "n": None}, True),  # null means the default
        ({"prompt": "x", "max_tokens": 2, "ignore_eos": None}, True),
        ({"prompt": "x", "max_tokens": 2, "n": 2.0}, True),  # JSON Schema's integer
        ({"prompt": "x", "max_tokens": 2, "n": 0}, False),
        ({"prompt": "x", "max_tokens": 2, "temperature": 2.5}, False),
        ({"prompt": "x", "max_tokens": 2, "stream_options": {"include_usage": True}}, False),
        ({"prompt": None, "max_tokens": 2}, False),
    ],
)
def test_the_document_says_what_the_server_accepts(server, body, documented):
    doc = httpx.get(server.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    schema = {"$ref": "#/components/schemas/CompletionRequest"}
    assert _schema_accepts(schema, schemas, body) is documented
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert (r.status_code == 200) is documented, r.text


def test_bodies_must_be_json_in_utf8(server):
    """#38: a UTF-16 body and a text/plain one were accepted beyond the document; the document
    says UTF-8 JSON, and the server refuses the rest (400, 415). No Content-Type is JSON."""
    url = server.url + "/v1/completions"
    body = '{"prompt": "x", "max_tokens": 2}'
    r = httpx.post(url, content=body.encode("utf-16"), headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"], r.text
    r = httpx.post(url, content=body.encode(), headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert httpx.post(url, content=body.encode()).status_code == 200  # no Content-Type
    for kind in ("application/json; charset=utf-8", "application/vnd.api+json"):
        assert (
            httpx.post(url, content=body.encode(), headers={"Content-Type": kind}).status_code
            == 200
        )
    assert "UTF-8" in httpx.get(server.url + "/openapi.json").json()["info"]["description"]


def test_documented_ranges_are_what_the_validation_checks():
    """Each bound :func:`openapi.sampling_ranges` documents is where the request model and
    ``SamplingParams`` start refusing (the ranges live there; the document restates them)."""
    import pydantic

    from jaxserve.entrypoints.http.openapi import sampling_ranges
    from jaxserve.serving.protocol import CompletionRequest
    from jaxserve.serving.validation import ServingInfo

    def accepted(name, value) -> bool:
        try:  # max_tokens reaches SamplingParams as resolved (its maximum is relative to the
            # prompt: prompt + max_tokens <= max_model_len, openapi.UNEXPRESSED)
            request = CompletionRequest.model_validate({"prompt": "x", name: value})
            request.to_sampling_params(request.max_tokens if name == "max_tokens" else None)
        except (pydantic.ValidationError, ValueError):
            return False
        return True

    info = ServingInfo("m", "/m", 64, 100, 64, True)
    checked = 0
    for name, schema in sampling_ranges(info).items():
        kind = schema.get("type")
        if kind not in ("integer", "number"):
            continue
        for bound, sign in (("minimum", -1), ("maximum", 1)):
            if bound in schema and (name, bound) != ("max_tokens", "maximum"):
                edge = schema[bound]
                beyond = (
                    edge + sign if kind == "integer" else edge + sign * max(1e-6, abs(edge) * 1e-12)
                )
                assert accepted(name, edge) and not accepted(name, beyond), (name, bound, edge)
                checked += 1
        if "exclusiveMinimum" in schema:
            edge = schema["exclusiveMinimum"]
            assert not accepted(name, edge) and accepted(name, edge + 1e-6), name
            checked += 1
    assert checked >= 18, checked


# ---- the pooling routes (#35) ------------------------------------------------------------------

POOLING_ROUTES = ["/v1/embeddings", "/pooling", "/v1/score", "/score"]


@pytest.fixture(scope="module")
def pooling_llm():
    """A ``--convert embed`` engine: the FakeEngine's stand-in vectors of 16 floats."""
    llm = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.0005, max_model_len=8192, convert="embed"))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def pooling_server(pooling_llm):
    srv = LiveServer(pooling_llm)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def proxied_pooling(pooling_llm):
    """The same engine behind an API key and ``--root-path /llm``."""
    from jaxserve.entrypoints.http.api_server import build_app

    srv = LiveServer(pooling_llm, app=build_app(pooling_llm, api_key="key", root_path="/llm"))
    yield srv
    srv.close()
    assert not srv.internal_errors


KEY = {"Authorization": "Bearer key"}


def _body_schema(doc: dict, path: str) -> dict:
    return doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def test_the_document_says_which_runner_serves_a_route(server, proxied_pooling):
    """Each server's document has every route it serves (the ``--root-path`` copies aside); a
    route its runner does not answer (a 400 naming ``--runner``) takes no body there."""
    generate = httpx.get(server.url + "/openapi.json").json()
    pooling = httpx.get(proxied_pooling.url + "/llm/openapi.json").json()
    described = {(m.upper(), path) for path, ops in pooling["paths"].items() for m in ops}
    assert described == served_routes(proxied_pooling.app)
    assert pooling["servers"] == [{"url": "/llm"}]
    for url in POOLING_ROUTES:
        assert _body_schema(generate, url)["not"] == {}
        assert "200" not in generate["paths"][url]["post"]["responses"]
        model = "ScoreRequest" if "score" in url else "EmbeddingRequest"
        assert _body_schema(pooling, url)["$ref"].endswith(model)
    for url in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        assert _body_schema(pooling, url)["not"] == {}
        assert _body_schema(generate, url)["$ref"].endswith("Request")
    embedding = pooling["components"]["schemas"]["EmbeddingRequest"]["properties"]
    assert embedding["dimensions"]["anyOf"][0]["minimum"] == 1
    assert embedding["priority"]["anyOf"][0]["const"] == 0  # fcfs


@pytest.mark.parametrize(
    "url, body, documented",
    [
        ("/v1/embeddings", {"input": "x", "encoding_format": None}, True),  # null: the default
        ("/v1/embeddings", {"input": "x", "dimensions": 4.0}, True),
        ("/v1/embeddings", {"input": "x", "dimensions": 0}, False),
        ("/v1/embeddings", {"input": [[]]}, False),
        ("/v1/embeddings", {"input": [10**9]}, False),
        ("/v1/embeddings", {"input": "x", "priority": 1}, False),  # fcfs
        ("/pooling", {"input": ["a", "b"], "normalize": False}, True),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": "c"}, False),
        ("/v1/score", {"text_1": ["a"], "text_2": ["b", "c"]}, True),
        ("/score", {"text_1": "a", "text_2": []}, False),
    ],
)
def test_the_pooling_document_says_what_the_server_accepts(pooling_server, url, body, documented):
    doc = httpx.get(pooling_server.url + "/openapi.json").json()
    assert _schema_accepts(_body_schema(doc, url), doc["components"]["schemas"], body) is documented
    r = httpx.post(pooling_server.url + url, json=body, timeout=30)
    assert (r.status_code == 200) is documented, r.text


def test_api_key_covers_the_pooling_routes(proxied_pooling):
    for prefix in ("", "/llm"):
        for url in POOLING_ROUTES:
            body = {"text_1": "a", "text_2": "b"} if "score" in url else {"input": "hello"}
            r = httpx.post(proxied_pooling.url + prefix + url, json=body)
            assert r.status_code == 401, (prefix, url, r.text)
            r = httpx.post(proxied_pooling.url + prefix + url, json=body, headers=KEY)
            assert r.status_code == 200, (prefix, url, r.text)
    data = r.json()["data"]
    assert data[0]["object"] == "score" and -1 <= data[0]["score"] <= 1


@pytest.mark.slow
def test_fuzz_pooling_server_strict_checks(pooling_server):
    """Schemathesis' strict checks over a pooling server: its pooling routes accept what the
    document allows and refuse the rest, and the generating routes refuse every body."""
    seen = fuzz_server(pooling_server.url, max_examples=80)
    assert pooling_server.internal_errors == []
    assert seen.get(200, 0) > 0 and any(400 <= s < 500 for s in seen), seen
