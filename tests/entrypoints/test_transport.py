"""The server's transport options: TLS (``--ssl-keyfile`` / ``--ssl-certfile``) with a
self-signed certificate made here by the ``openssl`` command and the official openai client;
CORS (``--allowed-origins`` ...: preflights, headers on plain and streamed answers); and
``--root-path`` (routes with and without the prefix, named in ``/openapi.json``)."""

from __future__ import annotations

import shutil
import signal
import ssl
import subprocess

import httpx2 as httpx
import openai
import pytest
from fake_engine import FakeEngine
from server_harness import MODEL_DIR, FakeServeProcess, LiveServer, assert_error

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.http.api_server import build_app, make_ssl_context
from jaxserve.entrypoints.http.cors import CORSPolicy

ORIGIN = "http://app.example"
KEY = {"Authorization": "Bearer key"}
BODY = {"prompt": "Hello", "max_tokens": 3}


@pytest.fixture(scope="module")
def llm():
    engine = AsyncLLM(FakeEngine(MODEL_DIR, step_s=0.0005))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and its key (PEM files)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        + ["-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-keyout", str(key)]
        + ["-out", str(cert), "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


@pytest.mark.slow
def test_serve_flags_tls_cors_root_path(certificate):
    """``jaxserve serve``'s flags (parsed and wired by ``serve_until_signal``, over the fake
    engine in a subprocess): HTTPS with the self-signed certificate, the openai client trusting
    it, CORS for one origin and a root path."""
    cert, key = certificate
    proc = FakeServeProcess(
        "--step-s", "0.001", "--ssl-certfile", cert, "--ssl-keyfile", key,
        "--allowed-origins", f'["{ORIGIN}"]', "--root-path", "/llm",
    )  # fmt: skip
    try:
        assert proc.url.startswith("https://") and proc.url.endswith("/llm")
        trust = ssl.create_default_context(cafile=cert)
        client = openai.OpenAI(
            base_url=proc.url + "/v1",
            api_key="unused",
            http_client=openai.DefaultHttpxClient(verify=trust),
            max_retries=0,
        )
        done = client.completions.create(model="fake-model", prompt="Hello", max_tokens=3)
        assert done.usage.completion_tokens == 3
        answer = client.responses.create(model="fake-model", input="Hi", max_output_tokens=3)
        assert answer.usage.output_tokens == 3
        preflight = httpx.options(
            proc.url + "/v1/responses",
            headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
            verify=trust,
        )
        assert preflight.headers["Access-Control-Allow-Origin"] == ORIGIN
        with pytest.raises(openai.APIConnectionError):  # an untrusted certificate is refused
            openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0).models.list()
        with pytest.raises(httpx.HTTPError):  # and plain HTTP gets nothing on that port
            httpx.get(proc.url.replace("https", "http") + "/health", timeout=2)
    finally:
        proc.p.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0


def test_tls_with_the_app(llm, certificate):
    cert, key = certificate
    srv = LiveServer(llm, ssl_context=make_ssl_context(cert, key))
    try:
        trust = ssl.create_default_context(cafile=cert)
        assert httpx.get(srv.url + "/health", verify=trust).status_code == 200
    finally:
        srv.close()


def test_tls_flags_are_checked(certificate):
    cert, key = certificate
    assert make_ssl_context(None, None) is None
    with pytest.raises(ValueError, match="ssl_keyfile"):
        make_ssl_context(cert, None)
    with pytest.raises(ValueError, match="ssl_certfile: cannot load"):
        make_ssl_context(key, cert)  # swapped: the key is no certificate
    with pytest.raises(ValueError, match="ssl_certfile: cannot load"):
        make_ssl_context("/no/such/cert.pem", key)


@pytest.fixture(scope="module")
def proxied(llm):
    """A server with CORS for ORIGIN (credentials allowed), an API key and root path /llm."""
    policy = CORSPolicy((ORIGIN,), ("GET", "POST"), ("authorization", "content-type"), True)
    srv = LiveServer(llm, app=build_app(llm, api_key="key", cors=policy, root_path="/llm"))
    yield srv
    srv.close()
    assert not srv.internal_errors


def _preflight(
    url: str, origin: str = ORIGIN, method: str = "POST", headers: str = ""
) -> httpx.Response:
    asked = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers:
        asked["Access-Control-Request-Headers"] = headers
    return httpx.options(url, headers=asked)


def test_cors_preflight(proxied):
    r = _preflight(proxied.url + "/v1/completions", headers="Authorization, Content-Type")
    assert r.status_code == 200  # no API key needed: browsers send none with a preflight
    assert r.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert r.headers["Access-Control-Allow-Credentials"] == "true"
    assert r.headers["Access-Control-Allow-Methods"] == "GET, POST"
    assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert int(r.headers["Access-Control-Max-Age"]) > 0
    assert_error(_preflight(proxied.url + "/v1/completions", origin="http://evil.example"), 400)
    assert_error(_preflight(proxied.url + "/v1/completions", method="DELETE"), 400)
    assert_error(_preflight(proxied.url + "/v1/completions", headers="X-Secret"), 400)


def test_cors_headers_on_answers_to_allowed_origins_only(proxied):
    url = proxied.url + "/v1/completions"
    r = httpx.post(url, json=BODY, headers={**KEY, "Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert r.headers["Vary"] == "Origin"
    denied = httpx.post(url, json=BODY, headers={"Origin": ORIGIN})  # no key: a 401, readable
    assert denied.status_code == 401 and denied.headers["Access-Control-Allow-Origin"] == ORIGIN
    with httpx.stream(
        "POST", url, json={**BODY, "stream": True}, headers={**KEY, "Origin": ORIGIN}
    ) as streamed:
        assert streamed.headers["Access-Control-Allow-Origin"] == ORIGIN
        streamed.read()
    other = httpx.post(url, json=BODY, headers={**KEY, "Origin": "http://evil.example"})
    assert other.status_code == 200 and "Access-Control-Allow-Origin" not in other.headers


def test_cors_off_by_default(llm):
    srv = LiveServer(llm)
    try:
        r = _preflight(srv.url + "/v1/completions")
        assert r.status_code == 405 and "Access-Control-Allow-Origin" not in r.headers
        plain = httpx.post(srv.url + "/v1/completions", json=BODY, headers={"Origin": ORIGIN})
        assert "Access-Control-Allow-Origin" not in plain.headers
    finally:
        srv.close()


def test_wildcard_origin_without_credentials_answers_star():
    policy = CORSPolicy(("*",))
    assert policy.origin_header("http://any.example") == {"Access-Control-Allow-Origin": "*"}
    headers = policy.preflight("http://any.example", "PATCH", "X-Custom")
    assert headers["Access-Control-Allow-Headers"] == "X-Custom"
    assert "Access-Control-Allow-Credentials" not in headers


def test_root_path(proxied):
    for path in ("/llm/v1/models", "/v1/models"):
        assert httpx.get(proxied.url + path, headers=KEY).json()["data"][0]["id"] == "fake-model"
    r = httpx.post(proxied.url + "/llm/v1/completions", json=BODY, headers=KEY)
    assert r.status_code == 200
    assert_error(httpx.post(proxied.url + "/llm/v1/completions", json=BODY), 401)
    doc = httpx.get(proxied.url + "/llm/openapi.json").json()
    assert doc["servers"] == [{"url": "/llm"}] and "/v1/completions" in doc["paths"]
    with pytest.raises(ValueError, match="root_path"):
        build_app(None, root_path="llm/")
