"""Request ledgers kept by the real scheduler: exact steps, prefix hits, preemptions, the ring."""

from __future__ import annotations

import random

import pytest
from core_testing import FakeRunner, make_request, make_scheduler, run_until_done

from jaxserve.core.ledger import LedgerHistory
from jaxserve.core.request import RequestStatus


def _run(s, requests, runner=None):
    for r in requests:
        s.add_request(r)
    run_until_done(s, runner or FakeRunner(s))
    return {r.request_id: r.ledger.to_dict() for r in requests}


def test_chunks_then_decodes_exactly():
    s = make_scheduler(budget=64, threshold=16)
    (led,) = _run(s, [make_request("a", list(range(40)), max_tokens=5)]).values()
    kinds = [(e["step"], e["kind"], e["tokens"]) for e in led["steps"]]
    # 40 prompt tokens in 16-token chunks (the last one samples the first output token), then
    # one decode step per further output token.
    assert kinds == [
        (1, "prefill", 16),
        (2, "prefill", 16),
        (3, "prefill", 8),
        (4, "decode", 1),
        (5, "decode", 1),
        (6, "decode", 1),
        (7, "decode", 1),
    ]
    assert [e["start"] for e in led["steps"][:3]] == [0, 16, 32]
    assert led["num_prefill_tokens"] == 40 and led["num_decode_steps"] == 4
    assert led["finish_reason"] == "length" and led["num_output_tokens"] == 5
    assert led["prefix_cache_hit_tokens"] == {"device": 0, "host": None}
    assert led["num_preemptions"] == 0 and led["preemptions"] == []


def test_prefix_hit_at_admission_counts_whole_blocks():
    s = make_scheduler(block_size=16)
    runner = FakeRunner(s)  # one simulated device cache for both requests
    prompt = list(range(50))
    _run(s, [make_request("a", prompt, max_tokens=2)], runner)
    led = _run(s, [make_request("b", prompt + [7, 8], max_tokens=2)], runner)["b"]
    assert led["prefix_cache_hit_tokens"]["device"] == 48  # 3 full blocks of the shared 50
    assert led["steps"][0]["start"] == 48 and led["steps"][0]["tokens"] == 4
    assert led["num_prefill_tokens"] == 4


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_requests_account_every_token(prefix_caching):
    """Tight KV pool: each finished ledger's computed tokens add up, recomputed tokens are
    exactly the positions it had lost, and they never show up as prefix-cache hits."""
    rng = random.Random(3)
    shared = [rng.randrange(900) for _ in range(32)]
    requests = []
    for i in range(12):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(900) for _ in range(20 + 5 * i)]
        requests.append(
            make_request(f"r{i}", prompt, max_tokens=rng.randint(10, 40), arrival_time=float(i))
        )
    s = make_scheduler(num_blocks=12, budget=48, threshold=32, prefix_caching=prefix_caching)
    ledgers = _run(s, requests)
    assert sum(r.num_preemptions for r in requests) > 0
    for r in requests:
        led = ledgers[r.request_id]
        assert led["num_preemptions"] == r.num_preemptions
        assert [e["step"] for e in led["steps"]] == sorted({e["step"] for e in led["steps"]})
        computed = sum(e["tokens"] for e in led["steps"])
        hits = led["prefix_cache_hit_tokens"]["device"]
        positions = r.num_prompt_tokens + r.num_output_tokens - 1  # the last token is not fed
        assert computed == positions - hits + led["num_recomputed_tokens"], r.request_id
        recompute_steps = sum(e.get("recomputed", 0) for e in led["steps"])
        assert recompute_steps == led["num_recomputed_tokens"]
        assert all(e["kind"] == "recompute" for e in led["steps"] if "recomputed" in e)
        for p in led["preemptions"]:
            assert p["resumed_step"] > p["step"]
            assert p["tokens_discarded"] > 0
            if not prefix_caching:
                assert p["tokens_restored_from_cache"] == 0
        if not prefix_caching:
            assert hits == 0
    preempted = [ledgers[r.request_id] for r in requests if r.num_preemptions]
    assert any(led["num_recomputed_tokens"] > 0 for led in preempted)
    if prefix_caching:
        assert any(
            p["tokens_restored_from_cache"] > 0 for led in preempted for p in led["preemptions"]
        )


def test_preemption_record_of_one_victim():
    """Two requests outgrow a 5-block pool; the later one is preempted and resumed."""
    s = make_scheduler(num_blocks=6, block_size=16, budget=64, prefix_caching=False)
    a = make_request("a", list(range(30)), max_tokens=40)
    b = make_request("b", list(range(100, 130)), max_tokens=40)
    ledgers = _run(s, [a, b])
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    first = ledgers["b"]["preemptions"][0]
    # Without prefix caching every discarded token is recomputed on resumption.
    assert first["tokens_restored_from_cache"] == 0
    assert first["tokens_recomputed"] == first["tokens_discarded"]
    assert ledgers["b"]["num_recomputed_tokens"] == sum(
        p["tokens_discarded"] for p in ledgers["b"]["preemptions"]
    )


def test_aborted_waiting_request_has_a_ledger():
    s = make_scheduler()
    r = make_request("a", [1, 2, 3])
    s.add_request(r)
    s.abort_requests("a")
    led = r.ledger.to_dict()
    assert led["finish_reason"] == "abort" and led["steps"] == [] and led["queued_s"] is None
    assert r.status == RequestStatus.FINISHED_ABORTED


def test_history_ring_is_bounded_and_finds_response_ids():
    ring = LedgerHistory(3)
    s = make_scheduler()
    reqs = [make_request(f"cmpl-x-{i}", [i + 1] * 5, max_tokens=1) for i in range(2)]
    reqs += [make_request(f"r{i}", [9] * 4, max_tokens=1) for i in range(2)]
    _run(s, reqs)
    for r in reqs[:3]:
        ring.add(r.request_id, [r.ledger])
    both = ring.get("cmpl-x")  # a response id: its prompts' engine requests -0, -1
    assert [p["request_id"] for p in both["prompts"]] == ["cmpl-x-0", "cmpl-x-1"]
    assert ring.get("cmpl-x-1")["num_prompt_tokens"] == 5
    ring.add(reqs[3].request_id, [reqs[3].ledger])
    assert len(ring) == 3
    assert ring.get("cmpl-x-0") is None and ring.get("cmpl-x") is None  # the oldest, dropped
    assert ring.get("r1")["request_id"] == "r1"
    assert ring.get("nope") is None
    assert LedgerHistory(0).get("r1") is None
    with pytest.raises(ValueError, match="ledger_history"):
        LedgerHistory(-1)
