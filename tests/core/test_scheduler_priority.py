"""Priority policy: a more urgent request never waits behind a less urgent one for sequence
slots, KV blocks or the token budget; fcfs order otherwise."""

from core_testing import (
    FakeRunner,
    expected_tokens,
    make_request,
    make_scheduler,
    run_until_done,
    step,
)

from jaxserve.core.request import RequestStatus


def test_urgent_request_takes_a_full_sequence_slot():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    runner = FakeRunner(s)
    s.add_request(make_request("low", list(range(20)), max_tokens=10, priority=5, arrival_time=0.0))
    step(s, runner)
    step(s, runner)
    s.add_request(
        make_request("urgent", list(range(50, 60)), max_tokens=3, priority=0, arrival_time=1.0)
    )
    out, _ = step(s, runner)
    assert out.preempted_req_ids == {"low"} and list(out.num_scheduled_tokens) == ["urgent"]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["urgent"]
    assert s.requests["low"].status == RequestStatus.PREEMPTED
    outs = run_until_done(s, runner)
    assert outs["urgent"][-2:] == expected_tokens("urgent", 10, 3)[-2:]
    assert s.requests == {} and s.kv_cache_manager.usage == 0.0


def test_urgent_request_takes_blocks_from_the_least_urgent():
    # 7 usable blocks of 16 tokens.
    s = make_scheduler(policy="priority", num_blocks=8, budget=256)
    runner = FakeRunner(s)
    mid = make_request(
        "mid", list(range(40)), max_tokens=20, priority=2, arrival_time=0.0
    )  # 3 blocks
    low = make_request(
        "low", list(range(100, 140)), max_tokens=20, priority=3, arrival_time=1.0
    )  # 3
    s.add_request(mid)
    s.add_request(low)
    step(s, runner)
    s.add_request(
        make_request("urgent", list(range(200, 240)), max_tokens=5, priority=0, arrival_time=2.0)
    )
    out, _ = step(s, runner)
    assert out.preempted_req_ids == {"low"}
    assert set(out.num_scheduled_tokens) == {"mid", "urgent"}
    run_until_done(s, runner)
    assert s.kv_cache_manager.usage == 0.0
    assert mid.output_token_ids == expected_tokens(
        "mid", 40, 20
    ) and low.output_token_ids == expected_tokens("low", 40, 20)
    assert mid.num_preemptions == 0 and low.num_preemptions >= 1


def test_no_preemption_when_it_would_not_be_enough():
    s = make_scheduler(policy="priority", num_blocks=8, budget=256)
    runner = FakeRunner(s)
    s.add_request(
        make_request("urgent-run", list(range(70)), max_tokens=20, priority=0, arrival_time=0.0)
    )  # 5
    s.add_request(
        make_request("low", list(range(100, 120)), max_tokens=5, priority=9, arrival_time=1.0)
    )  # 2
    step(s, runner)
    # Needs 4 blocks; only "low"'s 2 are reclaimable (the running request is more urgent).
    s.add_request(
        make_request("mid", list(range(300, 360)), max_tokens=2, priority=1, arrival_time=2.0)
    )
    out, _ = step(s, runner)
    assert out.preempted_req_ids == set() and "mid" not in out.num_scheduled_tokens
    assert s.requests["low"].status == RequestStatus.RUNNING
    run_until_done(s, runner)


def test_urgent_request_gets_the_token_budget_first():
    s = make_scheduler(
        policy="priority", budget=32, threshold=0, max_model_len=4096, num_blocks=100
    )
    runner = FakeRunner(s)
    s.add_request(make_request("low", list(range(500)), max_tokens=2, priority=5, arrival_time=0.0))
    step(s, runner)
    s.add_request(
        make_request("urgent", list(range(600, 620)), max_tokens=2, priority=0, arrival_time=1.0)
    )
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"urgent": 20, "low": 12}
    assert out.preempted_req_ids == set()


def test_order_by_priority_then_arrival():
    s = make_scheduler(policy="priority", max_num_seqs=1, budget=64)
    runner = FakeRunner(s)
    specs = [("a", 2, 0.0), ("b", 1, 1.0), ("c", 1, 2.0), ("d", 0, 3.0), ("e", 2, 4.0)]
    for req_id, prio, t in specs:
        s.add_request(make_request(req_id, [1, 2, 3], max_tokens=2, priority=prio, arrival_time=t))
    order = []
    run_until_done(
        s, runner, on_step=lambda o: order.extend(n.req_id for n in o.scheduled_new_reqs)
    )
    assert order == ["d", "b", "c", "a", "e"]


def test_fcfs_ignores_priority():
    s = make_scheduler(policy="fcfs", max_num_seqs=1)
    runner = FakeRunner(s)
    s.add_request(make_request("first", [1, 2], max_tokens=3, priority=9, arrival_time=0.0))
    s.add_request(make_request("second", [1, 2], max_tokens=3, priority=0, arrival_time=1.0))
    order = []
    run_until_done(
        s, runner, on_step=lambda o: order.extend(n.req_id for n in o.scheduled_new_reqs)
    )
    assert order == ["first", "second"]
