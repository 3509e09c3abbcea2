"""Two engine replicas on a local Ray cluster behind the ingress (one cluster for the module):
the openai client, routing on a shared-prefix workload, metrics, and a killed replica."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import pytest

ray = pytest.importorskip("ray")

import httpx2 as httpx  # noqa: E402
import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from server_harness import MODEL_DIR, LiveServer, small_engine_args  # noqa: E402

from jaxserve.core.kv_cache_utils import none_hash_from_seed  # noqa: E402
from jaxserve.entrypoints.http.ray_ingress import make_ingress  # noqa: E402
from jaxserve.entrypoints.ray_cluster import (  # noqa: E402
    NONE,
    connected_gcs_address,
    is_loopback,
    warn_if_unauthenticated,
)
from jaxserve.entrypoints.ray_serve import start_replicas  # noqa: E402
from jaxserve.entrypoints.router import Router  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow
COMPL = "/v1/completions"


@pytest.fixture(scope="module")
def cluster():
    if not os.path.isfile(os.path.join(MODEL_DIR, "config.json")):
        pytest.skip("the bundled model config is missing")
    # The same engine as test_openai_server_real's, so replicas find its compiled buckets.
    args = small_engine_args(long_prefill_token_threshold=0, metrics_namespace="vllm")
    # Without token authentication (loopback only), so the --ray-address check has a cluster
    # to warn about.
    auth_mode = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        actors, described = start_replicas(args, 2)
    finally:
        if auth_mode is None:
            os.environ.pop("RAY_AUTH_MODE")
        else:
            os.environ["RAY_AUTH_MODE"] = auth_mode
    ingress = make_ingress(actors, described, "round-robin")
    server = LiveServer(ingress.frontend, app=ingress.build_app())
    client = httpx.Client(base_url=server.url, timeout=60)
    yield ingress, server, client, described
    client.close()
    server.close()
    for actor in actors:
        ray.kill(actor, no_restart=True)
    ray.shutdown()
    assert not server.internal_errors


def _use(ingress, policy):
    first = ingress.router.replicas
    router = Router(len(first), policy, ingress.router.block_size, ingress.router.none_hash)
    for mine, theirs in zip(router.replicas, first):
        mine.capacity_blocks = theirs.capacity_blocks
    ingress.router = router


def _complete(client, prompt, **extra):
    r = client.post(COMPL, json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return int(r.headers["x-jaxserve-replica"]), r.json()


def test_openai_client_health_and_metrics(cluster):
    ingress, server, client, described = cluster
    _use(ingress, "round-robin")
    assert client.get("/health").json() == {"replicas": 2, "replicas_up": 2}
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = oai.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=8)
    assert out.usage.completion_tokens == 8 and out.choices[0].text
    chunks = oai.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=6,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with pytest.raises(openai.BadRequestError):  # validated at the ingress, like one server
        oai.completions.create(model="tiny-llama", prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="other", prompt="x", max_tokens=1)
    assert {_complete(client, f"round {k}")[0] for k in range(4)} == {0, 1}
    # A request's ledger comes from whichever replica served it.
    assert client.get(f"/v1/requests/{out.id}/ledger").status_code == 200
    assert client.get("/v1/requests/cmpl-unknown/ledger").json()["error"]["code"] == (
        "ledger_not_found"
    )
    # Every replica shares one hash seed, and the router's chain is the engines'.
    assert len({d["hash_seed"] for d in described}) == 1
    assert (
        {d["none_hash"] for d in described}
        == {none_hash_from_seed(described[0]["hash_seed"])}
        == {ingress.router.none_hash}
    )
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    engines = {s.labels["engine"] for s in families["vllm:num_requests_running"].samples}
    assert engines == {"0", "1"}
    assert sum(s.value for s in families["vllm:request_success"].samples) >= 5


def test_prefix_aware_routing_keeps_each_prefix_on_one_replica(cluster):
    ingress, server, client, _ = cluster
    tok = ingress.frontend.tokenizer
    prefixes = [tok.decode(list(range(100 + 40 * p, 164 + 40 * p))) for p in range(3)]
    results = {}
    for policy in ("round-robin", "prefix-aware"):
        _use(ingress, policy)
        homes, cached = {}, 0
        for k in range(12):
            p = k % 3
            replica, body = _complete(client, prefixes[p] + f" question {k}?", cache_salt=policy)
            homes.setdefault(p, set()).add(replica)
            cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
        results[policy] = homes, cached
    homes, cached = results["prefix-aware"]
    assert all(len(h) == 1 for h in homes.values()), homes  # each prefix stays home
    assert len(set().union(*homes.values())) == 2  # and the prefixes spread over both
    assert any(len(h) == 2 for h in results["round-robin"][0].values())
    assert cached > results["round-robin"][1] > 0  # 3 cold misses instead of 6


def test_replica_set_is_an_engine_client(cluster):
    """The set's own add_request (an engine request, routed by its prompt) streams the replica's
    outputs back; ledgers come from the replica that ran it; a refusal is the engine's."""
    ingress, _, _, _ = cluster
    replicas = ingress.frontend
    ids = replicas.tokenizer.encode("Hello there")

    async def run(request_id, prompt):
        stream = await replicas.add_request(request_id, prompt, SamplingParams(max_tokens=3))
        return [output async for output in stream]

    outputs = asyncio.run(run("direct-0", ids))
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
    assert outputs[-1].prompt_token_ids == ids
    assert asyncio.run(replicas.get_ledger("direct-0"))["request_id"] == "direct-0"
    with pytest.raises(ValueError, match="vocab"):
        asyncio.run(run("direct-1", [replicas.vocab_size + 5]))
    assert replicas.num_pending_requests == 0


def _sse_events(lines):
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_killed_replica_fails_in_flight_reroutes_the_rest_and_restarts(cluster):
    ingress, server, client, _ = cluster
    _use(ingress, "round-robin")
    body = {"prompt": "A long story:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with client.stream("POST", COMPL, json=body) as r:
        assert r.status_code == 200
        victim = int(r.headers["x-jaxserve-replica"])
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is running
        ray.kill(ingress.actors[victim], no_restart=False)  # Ray restarts it
        events = _sse_events(lines)
    assert events[-1] == "[DONE]"
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and errors[-1]["error"]["code"] == "replica_died", events[-3:]
    # Requests sent now never wait on the dead replica: the ones routed there before the
    # ingress noticed (forced here: the router still counts it up) are re-routed unstarted.
    # (Ray may have restarted it by the last of the four: a warm-up takes seconds on CPU since
    # the C++ decode kernel, so only the first request is sure to find it dead.)
    t0 = time.monotonic()
    ingress.router.update(victim, up=True)
    rerouted = ingress.num_rerouted
    served_by = [_complete(client, f"after the crash {k}")[0] for k in range(4)]
    assert served_by[0] == 1 - victim and time.monotonic() - t0 < 60
    assert ingress.num_rerouted > rerouted  # one was routed to the dead replica, then moved
    assert client.get("/health").json()["replicas"] == 2
    # Ray restarts the replica; the ingress sees it back and routes to it again.
    deadline = time.monotonic() + 150
    while client.get("/health").json()["replicas_up"] < 2:
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(1)
    assert victim in {_complete(client, f"back {k}")[0] for k in range(4)}


def test_local_cluster_listens_on_loopback_only(cluster):
    psutil = pytest.importorskip("psutil")
    gcs = ray.get_runtime_context().gcs_address
    assert is_loopback(gcs.rpartition(":")[0]), gcs
    # Every socket the cluster's processes (GCS, raylet, replica workers, agents, the autoscaler
    # monitor; all started under this one) listen on.
    listening = []
    for proc in psutil.Process().children(recursive=True):
        try:
            name, cmdline = proc.name(), " ".join(proc.cmdline())
            if not (name.startswith(("ray", "gcs_server")) or "/ray/" in cmdline):
                continue  # another test's process
            conns = proc.net_connections(kind="inet")
        except psutil.Error:  # exited meanwhile
            continue
        listening += [(name, c.laddr.ip, c.laddr.port) for c in conns if c.status == "LISTEN"]
    names = {name for name, _, _ in listening}
    assert {"gcs_server", "raylet"} <= names, listening
    assert all(is_loopback(ip) for _, ip, _ in listening), listening


def test_ray_address_without_authentication_is_warned_about(cluster, caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.entrypoints.ray_cluster")
    gcs = connected_gcs_address("unused")  # the fixture's cluster, started without tokens
    assert warn_if_unauthenticated(gcs) == NONE
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "without authentication" in record.getMessage()
