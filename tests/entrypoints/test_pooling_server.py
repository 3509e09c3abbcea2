"""A ``--convert embed`` server on the bundled model: the official openai client's
``embeddings.create`` (float and base64, strings and token ids, ``dimensions``, ``usage``),
vLLM's ``/pooling`` and ``/v1/score``, and the 400s (bad input, text generation on a pooling
server). Parity with transformers is tests/engine/test_pooling_engine.py's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx2 as httpx
import numpy as np
import openai
import pytest
from server_harness import assert_error, running_server, small_engine_args

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server():
    with running_server(small_engine_args(convert="embed", warmup=False)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_embeddings(server, oai):
    texts = ["The capital of France", "A cat sat on the mat"]
    resp = oai.embeddings.create(model=MODEL, input=texts)  # the client asks for base64
    hidden = len(resp.data[0].embedding)
    assert [d.index for d in resp.data] == [0, 1] and hidden > 8
    tok = server.llm.tokenizer
    ids = [tok.encode(t) for t in texts]
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(map(len, ids))
    vecs = np.array([d.embedding for d in resp.data])
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    as_float = oai.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in as_float.data], vecs, atol=1e-6)
    by_ids = oai.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in by_ids.data], vecs, atol=1e-5)
    one = oai.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, vecs[0], atol=1e-5)
    short = oai.embeddings.create(model=MODEL, input=texts[0], dimensions=8)
    raw = np.array(
        oai.embeddings.create(
            model=MODEL, input=texts[0], encoding_format="float", extra_body={"normalize": False}
        )
        .data[0]
        .embedding
    )
    want = raw[:8] / np.linalg.norm(raw[:8])
    np.testing.assert_allclose(short.data[0].embedding, want, atol=1e-5)
    assert np.linalg.norm(raw) > 1.5  # truly not normalised


def test_readme_embeddings_example(server):
    """The README's embeddings example runs as printed against a ``--convert embed`` server,
    with the ``client`` and ``model`` its first client example makes."""
    import contextlib
    import io
    import re

    path = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    with open(path, encoding="utf-8") as f:
        blocks = re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)
    (block,) = [b for b in blocks if "embeddings.create" in b]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    namespace = {"client": client, "model": client.models.list().data[0].id}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(block, namespace)  # noqa: S102
    dims, tokens = out.getvalue().split()
    assert int(dims) == 64 and int(tokens) > 0


def test_score_and_pooling(client):
    texts = ["hello there", "hello world", "numbers 1 2 3"]
    emb = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "float"}).json()
    vecs = [np.array(d["embedding"]) for d in emb["data"]]
    assert emb["object"] == "list" and emb["data"][0]["object"] == "embedding"
    score = client.post("/v1/score", json={"text_1": texts[0], "text_2": texts[1:]}).json()
    assert [d["object"] for d in score["data"]] == ["score", "score"]
    for d, other in zip(score["data"], vecs[1:]):
        assert d["score"] == pytest.approx(float(vecs[0] @ other), abs=1e-5)
    pairwise = client.post("/score", json={"text_1": texts[:2], "text_2": texts[1:]}).json()
    assert pairwise["data"][1]["score"] == pytest.approx(float(vecs[1] @ vecs[2]), abs=1e-5)
    pooled = client.post("/pooling", json={"input": texts[0]}).json()
    assert pooled["data"][0]["object"] == "pooling"
    np.testing.assert_allclose(pooled["data"][0]["data"], vecs[0], atol=1e-6)


def test_bad_pooling_requests_are_400s(client, server):
    assert_error(client.post("/v1/embeddings", json={"input": []}), 400, "input")
    assert_error(client.post("/v1/embeddings", json={"input": "x", "dimensions": 0}), 400)
    too_many = client.post("/v1/embeddings", json={"input": "x", "dimensions": 10**6})
    assert_error(too_many, 400, "dimensions")
    assert_error(client.post("/v1/embeddings", json={"input": [[10**9]]}), 400, "input")
    assert_error(client.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c"]}), 400)
    assert_error(client.post("/v1/embeddings", json={"input": "x", "model": "other"}), 404)
    error = assert_error(
        client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}),
        400,
        "model",
        "model_not_supported",
    )
    assert "--runner pooling" in error["message"]
    assert server.llm.num_pending_requests == 0
    ok = client.post("/v1/embeddings", json={"input": "still serving"})
    assert ok.status_code == 200


def test_openapi_lists_the_pooling_routes(client):
    paths = client.get("/openapi.json").json()["paths"]
    for url in ("/v1/embeddings", "/pooling", "/v1/score", "/score"):
        assert "post" in paths[url]


@pytest.mark.slow
def test_fuzz_pooling_server_no_5xx(server):
    from fuzz import fuzz_server

    # not strict: a 256-token context refuses long inputs the document allows (the strict
    # checks run over the FakeEngine: test_openapi_fuzz.test_fuzz_pooling_server_strict_checks)
    seen = fuzz_server(server.url, max_examples=16, strict=False)
    assert server.internal_errors == [] and not any(s >= 500 for s in seen), seen


def _jaxserve(*args: str) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", *args]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_serve_refuses_convert_embed_with_the_generate_runner():
    proc = _jaxserve("--convert", "embed", "--runner", "generate", "--port", "0")
    err = proc.communicate(timeout=240)[0]
    assert proc.returncode == 2, err
    assert "--runner pooling" in err and "Traceback" not in err


@pytest.mark.slow
def test_openai_client_against_jaxserve_serve():
    """``jaxserve serve --convert embed`` in its own process: the resolved-config line names the
    pooling runner and the openai client's ``embeddings.create`` answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = "--convert embed --no-warmup --attention-backend xla --max-model-len 256"
    flags += " --num-gpu-blocks-override 64 --max-num-seqs 4 --token-buckets 64"
    proc = _jaxserve(*flags.split(), "--max-num-batched-tokens", "64", "--port", str(port))
    lines = []
    try:
        for line in proc.stdout:  # the start-up report, then "serving tiny-llama on http://..."
            lines.append(line)
            if "serving tiny-llama on http://" in line:
                break
        log = "".join(lines)
        assert "'runner': 'pooling'" in log and "'pooling_type': 'LAST'" in log, log
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=3)
        resp = oai.embeddings.create(model="tiny-llama", input=["hello", "world"])
        assert len(resp.data) == 2 and len(resp.data[0].embedding) == 256
        assert resp.usage.prompt_tokens > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
