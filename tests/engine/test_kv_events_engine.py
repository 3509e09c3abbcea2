"""--kv-events-endpoint end to end: a ZMQ subscriber decodes the events of a served request
(vLLM's frames and msgpack layout, our hashes, sequence numbers)."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from jaxserve.config import ObservabilityConfig  # noqa: E402
from jaxserve.core.kv_cache_utils import AllBlocksCleared, hash_token_blocks  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402


def _receive(sub, until, timeout_s=10.0):
    """(seq, payload) messages until ``until(messages)`` or the timeout."""
    messages = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not until(messages):
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b""
            messages.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    return messages


def test_subscriber_decodes_a_requests_events(base, run):
    from jaxserve.engine.llm_engine import LLMEngine

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    base.runner.reset_requests()
    config = dataclasses.replace(
        base.config,
        observability=ObservabilityConfig(
            kv_events_endpoint=f"tcp://127.0.0.1:{port}", data_parallel_rank=3
        ),
    )
    engine = LLMEngine(config, base.runner, base.arch, base.tokenizer, base.generation_config)
    try:
        # PUB drops what it sends before the subscription arrives: probe until one gets through.
        probe = []
        for _ in range(50):
            engine.kv_event_publisher.publish([AllBlocksCleared()])
            probe = _receive(sub, lambda m: m, timeout_s=0.2)
            if probe:
                break
        assert probe, "the subscriber never connected"
        time.sleep(0.3)
        while sub.poll(0):  # drain the other probes
            probe.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        next_seq = max(probe[-1] if isinstance(probe[-1], int) else probe[-1][0], 0) + 1
        bs = config.cache.block_size
        prompt = [(7 * i) % 200 + 3 for i in range(3 * bs + 5)]
        run(engine, [("r", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))])
        expected = hash_token_blocks(
            prompt, bs, none_hash=engine.scheduler.kv_cache_manager.none_hash
        )

        def stored(msgs):
            return [e for _, p in msgs for e in p["events"] if e["type"] == "BlockStored"]

        msgs = _receive(sub, lambda m: sum(len(e["block_hashes"]) for e in stored(m)) >= 3)
        assert [seq for seq, _ in msgs] == list(range(next_seq, next_seq + len(msgs)))  # no gap
        batch = msgs[0][1]
        assert set(batch) == {"ts", "events", "data_parallel_rank"}
        assert batch["data_parallel_rank"] == 3 and abs(batch["ts"] - time.time()) < 60
        first = stored(msgs)[0]
        assert first["parent_block_hash"] is None
        assert first["block_size"] == bs and first["medium"] == "GPU"
        hashes = [h for e in stored(msgs) for h in e["block_hashes"]]
        tokens = [t for e in stored(msgs) for t in e["token_ids"]]
        assert hashes[:3] == expected and tokens[: 3 * bs] == prompt[: 3 * bs]
        # A salted request (a tenant): its blocks are published as hashes, without token ids.
        engine.add_request(
            "t", prompt, SamplingParams(max_tokens=2, temperature=0), cache_salt="tenantA"
        )
        run(engine, [])
        salted = hash_token_blocks(
            prompt, bs, cache_salt="tenantA", none_hash=engine.scheduler.kv_cache_manager.none_hash
        )
        msgs = _receive(sub, lambda m: sum(len(e["block_hashes"]) for e in stored(m)) >= 3)
        events = [e for e in stored(msgs) if set(e["block_hashes"]) & set(salted)]
        assert [h for e in events for h in e["block_hashes"]][:3] == salted
        assert all(e["token_ids"] == [] for e in events)
        # A reset of the (now idle) cache is an AllBlocksCleared.
        assert engine.scheduler.kv_cache_manager.reset_prefix_cache()
        run(engine, [("s", prompt[:3], SamplingParams(max_tokens=1))])
        msgs = _receive(
            sub, lambda m: any(e["type"] == "AllBlocksCleared" for _, p in m for e in p["events"])
        )
        assert any(e == {"type": "AllBlocksCleared"} for _, p in msgs for e in p["events"])
    finally:
        engine.close()
        sub.close(linger=0)
        ctx.term()


def test_endpoint_offsets_only_where_bound():
    from jaxserve.kv_events import offset_endpoint

    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint("tcp://10.0.0.1:5557", 2) == "tcp://10.0.0.1:5557"  # connects: shared
    with pytest.raises(ValueError, match="kv_events_endpoint"):
        offset_endpoint("tcp://*:x", 1)


def test_star_binds_loopback_and_every_interface_warns(caplog):
    from jaxserve.kv_events import KVEventPublisher

    caplog.set_level(logging.WARNING, logger="jaxserve.kv_events")
    default = KVEventPublisher("tcp://*:*", 16)  # vLLM's bind form: loopback here
    public = KVEventPublisher("tcp://0.0.0.0:*", 16)
    try:
        assert default.address.startswith("tcp://127.0.0.1:")
        assert public.address.startswith("tcp://0.0.0.0:")
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 2
        assert "binds 127.0.0.1" in warned[0] and "every interface" in warned[1]
    finally:
        default.close()
        public.close()
