"""Ledger access (#38 F8): with several API keys (``--api-key`` repeated or a comma list) a
ledger is readable only with the key that created its request, and so is a stored
``/v1/responses`` response (read, deleted or continued: it holds the conversation's text);
``--no-ledger-route`` removes the route (and ``/openapi.json`` no longer names it); with one key
(or none) a request id is the capability to read it."""

from __future__ import annotations

import argparse

import httpx2 as httpx
import pytest
from fake_engine import FakeEngine
from server_harness import MODEL_DIR, LiveServer, assert_error

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.http.api_server import api_keys, build_app, served_routes
from jaxserve.entrypoints.serve import add_serve_parser

COMPL = "/v1/completions"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.0005))
    yield llm
    llm.shutdown()


def _finished_request(c: httpx.Client, key: str) -> str:
    r = c.post(COMPL, json={"prompt": "x", "max_tokens": 2}, headers=_auth(key))
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_several_keys_read_only_their_own_ledgers(llm):
    srv = LiveServer(llm, app=build_app(llm, api_key=["alice", "bob,carol"]))
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            alice = _finished_request(c, "alice")
            carol = _finished_request(c, "carol")  # the comma list's second key works too
            for rid in (alice, f"{alice}-0"):  # response id or engine request id
                ok = c.get(f"/v1/requests/{rid}/ledger", headers=_auth("alice"))
                assert ok.status_code == 200 and ok.json()["request_id"] == rid, ok.text
                for other in ("bob", "carol"):  # F8: any key read any ledger
                    assert_error(
                        c.get(f"/v1/requests/{rid}/ledger", headers=_auth(other)),
                        404,
                        code="ledger_not_found",
                    )
            assert c.get(f"/v1/requests/{carol}/ledger", headers=_auth("carol")).status_code == 200
            assert_error(c.get(f"/v1/requests/{carol}/ledger", headers=_auth("alice")), 404)
            assert_error(c.get(f"/v1/requests/{carol}/ledger"), 401)
        assert srv.internal_errors == []
    finally:
        srv.close()


def test_several_keys_own_their_stored_responses(llm):
    srv = LiveServer(llm, app=build_app(llm, api_key=["alice", "bob"]))
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            body = {"model": "fake-model", "input": "Hi", "max_output_tokens": 2}
            r = c.post("/v1/responses", json=body, headers=_auth("alice"))
            assert r.status_code == 200, r.text
            rid = r.json()["id"]
            url = f"/v1/responses/{rid}"
            assert_error(c.get(url, headers=_auth("bob")), 404, code="response_not_found")
            assert_error(c.delete(url, headers=_auth("bob")), 404, code="response_not_found")
            assert_error(
                c.post(
                    "/v1/responses",
                    json={**body, "previous_response_id": rid},
                    headers=_auth("bob"),
                ),
                404,
                param="previous_response_id",
                code="previous_response_not_found",
            )
            assert c.get(url, headers=_auth("alice")).json()["id"] == rid  # bob deleted nothing
            more = {**body, "previous_response_id": rid}
            assert c.post("/v1/responses", json=more, headers=_auth("alice")).status_code == 200
            assert c.delete(url, headers=_auth("alice")).json()["deleted"] is True
        assert srv.internal_errors == []
    finally:
        srv.close()


def test_one_key_reads_every_ledger_and_the_route_can_be_removed(llm):
    srv = LiveServer(llm, app=build_app(llm, api_key="alice"))
    off = LiveServer(llm, app=build_app(llm, ledger_route=False))
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            rid = _finished_request(c, "alice")
            assert c.get(f"/v1/requests/{rid}/ledger", headers=_auth("alice")).status_code == 200
        with httpx.Client(base_url=off.url, timeout=10) as c:
            rid = _finished_request(c, "anyone")
            assert_error(c.get(f"/v1/requests/{rid}/ledger"), 404, code="not_found")
            body = {"prompt": "x", "max_tokens": 2, "include_ledger": True}
            assert "ledger" in c.post(COMPL, json=body).json()  # one's own, in the response
            doc = c.get("/openapi.json").json()  # the document names the routes served
            described = {(m.upper(), path) for path, ops in doc["paths"].items() for m in ops}
            assert described == served_routes(off.app)
            assert "/v1/requests/{request_id}/ledger" not in doc["paths"]
    finally:
        srv.close()
        off.close()


def test_api_key_flag_takes_repeats_and_comma_lists():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    serve = add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--api-key", "a,b", "--api-key", " c ", "--no-ledger-route"])
    assert api_keys(args.api_key) == ("a", "b", "c") and args.ledger_route is False
    assert serve.parse_args([]).ledger_route is True
    assert api_keys(None) == () and api_keys("a,,a") == ("a",)
