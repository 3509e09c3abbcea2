"""Scheduler: token budget, chunked prefill, stop conditions, aborts, outputs (fake runner, no jax)."""

import random

import pytest
from core_testing import (
    EOS,
    FakeRunner,
    expected_tokens,
    fake_token,
    make_request,
    make_scheduler,
    run_until_done,
    step,
)

from jaxserve.core.request import RequestStatus
from jaxserve.core.runner_output import ModelRunnerOutput, TokenLogprobs


def assert_no_blocks_left(s):
    kv = s.kv_cache_manager
    assert kv.req_to_blocks == {} and kv.usage == 0.0
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_prefill_and_decode_share_a_step():
    s = make_scheduler(budget=64)
    runner = FakeRunner(s)
    s.add_request(make_request("a", list(range(10)), max_tokens=5))
    out, res = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 10} and [n.req_id for n in out.scheduled_new_reqs] == [
        "a"
    ]
    assert (
        out.scheduled_new_reqs[0].block_ids == [1]
        and out.scheduled_new_reqs[0].num_computed_tokens == 0
    )
    assert [o.new_token_ids for o in res] == [expected_tokens("a", 10, 1)]
    s.add_request(make_request("b", list(range(100, 140)), max_tokens=5))
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 40}  # one step, no phases
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["a"] and cached.num_computed_tokens == [10]
    assert cached.new_token_ids == [expected_tokens("a", 10, 1)] and cached.new_block_ids == [[]]
    assert out.total_num_scheduled_tokens == 41


def test_chunks_obey_threshold_and_budget():
    s = make_scheduler(budget=100, threshold=64)
    runner = FakeRunner(s)
    s.add_request(make_request("long", list(range(300)), max_tokens=3))
    s.add_request(make_request("short", list(range(500, 520)), max_tokens=3))
    chunks = []
    outs = run_until_done(s, runner, on_step=lambda o: chunks.append(dict(o.num_scheduled_tokens)))
    assert [c.get("long") for c in chunks[:5]] == [64, 64, 64, 64, 44]
    assert chunks[0]["short"] == 20  # 64 + 20 <= 100: both in the first step
    assert outs["long"] == expected_tokens("long", 300, 3)


def test_budget_and_max_num_seqs_never_exceeded_and_all_finish():
    rng = random.Random(0)
    s = make_scheduler(num_blocks=40, budget=48, max_num_seqs=4, threshold=32)
    runner = FakeRunner(s)
    want = {}
    for i in range(25):
        p, m = rng.randint(1, 120), rng.randint(1, 30)
        s.add_request(make_request(f"r{i}", [rng.randrange(900) for _ in range(p)], max_tokens=m))
        want[f"r{i}"] = expected_tokens(f"r{i}", p, m)
    admitted = []

    def on_step(out):
        admitted.extend(n.req_id for n in out.scheduled_new_reqs if n.req_id not in admitted)

    outs = run_until_done(s, runner, on_step=on_step)  # checks budget / max_num_seqs each step
    assert outs == want
    assert admitted == [f"r{i}" for i in range(25)]  # fcfs: first admissions in arrival order
    assert_no_blocks_left(s)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preempted_requests_produce_the_same_tokens(policy):
    rng = random.Random(1)
    specs = [
        (
            f"r{i}",
            [rng.randrange(900) for _ in range(rng.randint(20, 90))],
            rng.randint(10, 40),
            rng.randint(0, 3),
        )
        for i in range(10)
    ]

    def run(num_blocks):
        s = make_scheduler(num_blocks=num_blocks, budget=64, policy=policy, max_model_len=256)
        for k, (req_id, prompt, m, prio) in enumerate(specs):
            s.add_request(
                make_request(req_id, prompt, max_tokens=m, priority=prio, arrival_time=float(k))
            )
        outs = run_until_done(s, FakeRunner(s))
        assert_no_blocks_left(s)
        return outs, s.make_stats().num_preemptions

    tight, n_preempt = run(num_blocks=10)
    ample, n_none = run(num_blocks=200)
    assert n_preempt > 0 and n_none == 0
    assert tight == ample == {r: expected_tokens(r, len(p), m) for r, p, m, _ in specs}


def test_resumed_request_is_sent_again_with_its_outputs():
    s = make_scheduler(num_blocks=6, block_size=16, budget=64)  # 5 usable blocks = 80 tokens
    runner = FakeRunner(s)
    s.add_request(make_request("a", list(range(30)), max_tokens=40))
    s.add_request(make_request("b", list(range(100, 130)), max_tokens=40))
    resumed = None
    for _ in range(200):
        out, _ = step(s, runner)
        if "b" in out.preempted_req_ids:
            assert (
                s.requests["b"].status == RequestStatus.PREEMPTED
                and s.requests["b"].num_computed_tokens == 0
            )
            assert s.kv_cache_manager.get_block_ids("b") == []
        for new in out.scheduled_new_reqs:
            if new.req_id == "b" and s.requests["b"].num_preemptions:
                resumed = new
        if not s.has_unfinished_requests():
            break
    assert resumed is not None
    assert resumed.output_token_ids == expected_tokens("b", 30, len(resumed.output_token_ids))
    assert len(resumed.output_token_ids) > 0


def test_empty_prompt_and_duplicate_id_rejected():
    s = make_scheduler()
    with pytest.raises(ValueError, match="prompt_token_ids.*empty"):
        s.add_request(make_request("a", []))
    s.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(make_request("a", [2]))


def test_max_tokens_zero_is_prompt_only():
    s = make_scheduler(budget=16)
    runner = FakeRunner(s)
    s.add_request(make_request("a", list(range(40)), max_tokens=0))
    results = []
    while s.has_unfinished_requests():
        results.extend(step(s, runner)[1])
    assert (
        len(results) == 1
        and results[0].new_token_ids == []
        and results[0].finish_reason == "length"
    )
    assert_no_blocks_left(s)


def test_max_tokens_one():
    s = make_scheduler()
    runner = FakeRunner(s)
    s.add_request(make_request("a", list(range(5)), max_tokens=1))
    out, res = step(s, runner)
    assert [(o.new_token_ids, o.finish_reason) for o in res] == [
        (expected_tokens("a", 5, 1), "length")
    ]
    assert not s.has_unfinished_requests() and s.has_finished_requests()
    assert s.schedule().finished_req_ids == {"a"}
    assert_no_blocks_left(s)


def test_stop_conditions():
    s = make_scheduler(max_model_len=30)
    runner = FakeRunner(s, eos_at={"eos": 12, "min": 11, "ign": 11})
    stop_tok = fake_token("stopid", 10 + 3)
    s.add_request(make_request("eos", list(range(10)), max_tokens=20, ignore_eos=False))
    s.add_request(
        make_request("min", list(range(10)), max_tokens=20, ignore_eos=False, min_tokens=2)
    )
    s.add_request(make_request("ign", list(range(10)), max_tokens=4, ignore_eos=True))
    s.add_request(make_request("stopid", list(range(10)), max_tokens=20, stop_token_ids=[stop_tok]))
    s.add_request(make_request("cap", list(range(25)), max_tokens=None))  # max_model_len leaves 5
    outs = run_until_done(s, runner)
    fin = runner.finish_reasons
    assert outs["eos"][-1] == EOS and len(outs["eos"]) == 3 and fin["eos"] == "stop"
    # EOS as the 2nd token does not stop a request with min_tokens=2; it runs to max_tokens.
    assert outs["min"][1] == EOS and len(outs["min"]) == 20 and fin["min"] == "length"
    assert outs["ign"][1] == EOS and len(outs["ign"]) == 4 and fin["ign"] == "length"
    assert outs["stopid"] == expected_tokens("stopid", 10, 4) and fin["stopid"] == "stop"
    assert len(outs["cap"]) == 5 and fin["cap"] == "length"


def test_stop_reason_reported():
    s = make_scheduler()
    stop_tok = fake_token("a", 3)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=5, stop_token_ids=[stop_tok]))
    runner = FakeRunner(s)
    _, res = step(s, runner)
    assert res[0].finished and res[0].stop_reason == stop_tok and res[0].finish_reason == "stop"


def test_tokens_after_a_stop_in_one_list_are_dropped():
    s = make_scheduler()
    s.add_request(make_request("a", [1, 2, 3], max_tokens=5, ignore_eos=False))
    out = s.schedule()
    lp = [TokenLogprobs([t], [-0.5], 1) for t in (7, EOS, 8)]
    res = s.update_from_output(
        out, ModelRunnerOutput(["a"], {"a": 0}, [[7, EOS, 8]], logprobs=[lp])
    )
    assert (
        res[0].new_token_ids == [7, EOS]
        and res[0].new_logprobs == lp[:2]
        and res[0].finish_reason == "stop"
    )


def test_partial_prefill_samples_nothing_but_forwards_prompt_logprobs():
    s = make_scheduler(budget=16)
    s.add_request(make_request("a", list(range(40)), max_tokens=2, prompt_logprobs=1))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 16}
    plp = [TokenLogprobs([p, 0], [-1.0, -0.1], 3) for p in range(1, 17)]
    # A token sampled for a partial chunk (a runner bug) is ignored.
    res = s.update_from_output(
        out, ModelRunnerOutput(["a"], {"a": 0}, [[5]], prompt_logprobs_dict={"a": plp})
    )
    assert len(res) == 1 and res[0].new_token_ids == [] and res[0].new_prompt_logprobs is plp
    assert s.requests["a"].num_output_tokens == 0 and s.requests["a"].num_computed_tokens == 16


def test_finish_requests_from_engine_stop_string():
    s = make_scheduler()
    runner = FakeRunner(s)
    s.add_request(make_request("a", list(range(5)), max_tokens=10))
    step(s, runner)
    s.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert not s.has_unfinished_requests()
    assert s.schedule().finished_req_ids == {"a"}
    assert_no_blocks_left(s)
    with pytest.raises(ValueError, match="finished_status"):
        s.finish_requests("a", RequestStatus.RUNNING)


def test_abort_waiting_running_and_preempted_leaves_no_blocks():
    s = make_scheduler(num_blocks=6, budget=64, max_num_seqs=2)  # 80 tokens of cache
    runner = FakeRunner(s)
    s.add_request(make_request("run", list(range(30)), max_tokens=45))
    s.add_request(make_request("pre", list(range(100, 130)), max_tokens=45))
    s.add_request(make_request("wait", list(range(200, 280)), max_tokens=0))
    for _ in range(100):
        out, _ = step(s, runner)
        if s.requests["pre"].status == RequestStatus.PREEMPTED:
            break
    assert s.requests["pre"].status == RequestStatus.PREEMPTED
    assert s.requests["wait"].status == RequestStatus.WAITING
    s.abort_requests(["pre", "wait", "unknown"])
    assert s.get_request_counts() == (1, 0)
    s.abort_requests("run")
    out = s.schedule()
    assert out.finished_req_ids == {"run", "pre", "wait"} and out.total_num_scheduled_tokens == 0
    assert_no_blocks_left(s)
    assert s.get_num_unfinished_requests() == 0


def test_aborted_between_schedule_and_update_is_skipped():
    s = make_scheduler()
    runner = FakeRunner(s)
    s.add_request(make_request("a", [1, 2, 3]))
    out = s.schedule()
    result = runner.execute(out)
    s.abort_requests("a")
    assert s.update_from_output(out, result) == []
    assert_no_blocks_left(s)


def test_num_cached_tokens_and_prefix_stats():
    s = make_scheduler(budget=256)
    runner = FakeRunner(s)
    prompt = list(range(70))
    s.add_request(make_request("a", prompt, max_tokens=2))
    run_until_done(s, runner)
    s.add_request(make_request("b", prompt + [1, 2], max_tokens=2))
    out, res = step(s, runner)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 64 and out.num_scheduled_tokens == {
        "b": 8
    }
    assert res[0].num_cached_tokens == 64
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.prefix_cache_requests) == (
        142,
        64,
        2,
    )
    assert stats.num_running_reqs == 1 and stats.num_waiting_reqs == 0 and stats.num_steps == 3
    assert s.make_stats().num_steps == 0  # interval counters reset


def test_runner_without_logprobs_for_request():
    s = make_scheduler()
    s.add_request(make_request("a", [1], max_tokens=3))
    s.add_request(make_request("b", [2], max_tokens=3, logprobs=2))
    out = s.schedule()
    lp = TokenLogprobs([4, 4, 9], [-0.1, -0.1, -3.0], 1)
    res = s.update_from_output(
        out, ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[3], [4]], logprobs=[[], [lp]])
    )
    assert {o.req_id: o.new_logprobs for o in res} == {"a": None, "b": [lp]}


def test_runner_order_and_output_copies_do_not_matter():
    import copy

    s = make_scheduler()
    for k in range(3):
        s.add_request(make_request(f"r{k}", [k + 1] * 3, max_tokens=3))
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)[::-1]  # the runner may reorder its batch
    res = s.update_from_output(
        copy.copy(out),
        ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[10 + int(r[1])] for r in ids]),
    )
    assert {o.req_id: o.new_token_ids for o in res} == {"r0": [10], "r1": [11], "r2": [12]}
    out = s.schedule()
    res = s.update_from_output(
        out,
        ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[20 + int(r[1])] for r in ids]),
    )
    assert {o.req_id: o.new_token_ids for o in res} == {"r0": [20], "r1": [21], "r2": [22]}
    assert s.requests["r1"].output_token_ids == [11, 21]
