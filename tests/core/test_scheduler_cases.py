"""The shared scheduler cases: preempt-resume-thrash, long-prompt-blocks-queue, mixed-hit-batch;
plus randomized workloads with arrivals and aborts."""

import random

import pytest
from core_testing import (
    FakeRunner,
    check_scheduler_invariants,
    expected_tokens,
    make_request,
    make_scheduler,
    run_random_workload,
    run_until_done,
)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempt_resume_thrash(prefix_caching):
    # 12 blocks of 16 tokens (11 usable: 176 tokens), budget 32; each request needs 160 tokens.
    s = make_scheduler(num_blocks=12, block_size=16, budget=32, prefix_caching=prefix_caching)
    runner = FakeRunner(s)
    prompts = {f"r{i}": [(13 * i + t) % 700 for t in range(100)] for i in range(3)}
    for req_id, prompt in prompts.items():
        s.add_request(make_request(req_id, prompt, max_tokens=60, ignore_eos=True))
    reqs = dict(s.requests)
    with pytest.raises(ValueError) as err:  # 100 + 80 = 180 > 176: fails fast, at admission
        s.add_request(make_request("huge", list(range(100)), max_tokens=80))
    assert "180" in str(err.value) and "176" in str(err.value)
    steps = []
    outs = run_until_done(s, runner, max_steps=1000, on_step=steps.append)
    assert outs == {r: expected_tokens(r, 100, 60) for r in prompts}
    preemptions = {r: q.num_preemptions for r, q in reqs.items()}
    assert sum(preemptions.values()) <= 4 and max(preemptions.values()) <= 2, preemptions
    assert len(steps) < 250  # 3 * 160 tokens at <= 32 per step, plus decode steps: no livelock
    # No request is preempted in two consecutive steps.
    for a, b in zip(steps, steps[1:]):
        assert not (a.preempted_req_ids & b.preempted_req_ids)


def test_long_prompt_blocks_queue():
    s = make_scheduler(budget=64, max_model_len=256, chunked=True)
    with pytest.raises(ValueError) as err:
        s.add_request(make_request("too-long", list(range(300)), max_tokens=4))
    assert "300" in str(err.value) and "256" in str(err.value)
    s.add_request(make_request("ok", list(range(10)), max_tokens=4))
    runner = FakeRunner(s)
    assert run_until_done(s, runner) == {"ok": expected_tokens("ok", 10, 4)}
    assert s.get_request_counts() == (0, 0)

    s = make_scheduler(budget=64, max_model_len=256, chunked=False)
    with pytest.raises(ValueError) as err:
        s.add_request(make_request("over-budget", list(range(100)), max_tokens=4))
    assert "100" in str(err.value) and "64" in str(err.value) and "chunked" in str(err.value)
    s.add_request(make_request("fits", list(range(64)), max_tokens=3))
    s.add_request(make_request("after", list(range(5)), max_tokens=3))
    chunks = []
    outs = run_until_done(s, FakeRunner(s), on_step=chunks.append)
    assert outs == {"fits": expected_tokens("fits", 64, 3), "after": expected_tokens("after", 5, 3)}
    assert chunks[0].num_scheduled_tokens == {"fits": 64}  # whole prompt, one step
    assert s.get_request_counts() == (0, 0) and len(s.waiting) == 0


def test_long_prompt_is_chunked_and_others_keep_running():
    s = make_scheduler(budget=64, threshold=32, max_model_len=4096, num_blocks=400)
    runner = FakeRunner(s)
    s.add_request(make_request("short1", list(range(8)), max_tokens=40))
    s.add_request(make_request("long", list(range(2000)), max_tokens=2))
    s.add_request(make_request("short2", list(range(5)), max_tokens=5))
    steps = []
    outs = run_until_done(s, runner, on_step=steps.append)
    assert outs["short2"] == expected_tokens("short2", 5, 5)
    # short2 finished long before the 2000-token prompt was done (no head-of-line blocking).
    first_long_decode = next(
        i for i, o in enumerate(steps) if o.num_scheduled_tokens.get("long") == 1
    )
    last_short2 = max(i for i, o in enumerate(steps) if "short2" in o.num_scheduled_tokens)
    assert last_short2 < first_long_decode
    assert all(o.num_scheduled_tokens.get("long", 0) <= 32 for o in steps)


def test_mixed_hit_batch():
    s = make_scheduler(budget=40, block_size=16)
    runner = FakeRunner(s)
    shared = [(5 * t) % 311 for t in range(64)]
    s.add_request(make_request("warm", shared, max_tokens=1))
    run_until_done(s, runner)
    s.add_request(make_request("hit", shared + list(range(16)), max_tokens=3))
    s.add_request(make_request("miss", list(range(400, 464)), max_tokens=3))
    out = s.schedule()
    check_scheduler_invariants(s, out)
    new = {n.req_id: n for n in out.scheduled_new_reqs}
    assert new["hit"].num_computed_tokens == 64 and new["miss"].num_computed_tokens == 0
    assert (
        out.num_scheduled_tokens == {"hit": 16, "miss": 24} and out.total_num_scheduled_tokens == 40
    )
    assert new["hit"].block_ids[0][:4] == [1, 2, 3, 4]  # the warm request's cached blocks
    res = s.update_from_output(
        out, runner.execute(out)
    )  # the runner checks the hit blocks' content
    assert [(o.req_id, o.num_cached_tokens) for o in res] == [("hit", 64)]
    outs = run_until_done(s, runner)
    outs["hit"] = [o for o in res if o.req_id == "hit"][0].new_token_ids + outs["hit"]
    assert outs == {"hit": expected_tokens("hit", 80, 3), "miss": expected_tokens("miss", 64, 3)}


def test_same_prompt_twice_in_one_step_shares_blocks():
    """n > 1 fan-out: children admitted in the same step share the prompt's full blocks."""
    s = make_scheduler(budget=512)
    runner = FakeRunner(s)
    prompt = list(range(50))
    for k in range(3):
        s.add_request(make_request(f"p-{k}", prompt, max_tokens=2))
    out = s.schedule()
    new = {n.req_id: n for n in out.scheduled_new_reqs}
    assert new["p-0"].block_ids == ([1, 2, 3, 4],) and new["p-0"].num_computed_tokens == 0
    assert new["p-1"].block_ids[0][:3] == [1, 2, 3] and new["p-1"].num_computed_tokens == 48
    assert out.num_scheduled_tokens == {"p-0": 50, "p-1": 2, "p-2": 2}
    s.update_from_output(
        out, runner.execute(out)
    )  # the runner checks that the shared blocks hold the prompt


@pytest.mark.parametrize(
    "seed,policy,chunked,caching",
    [
        (0, "fcfs", True, True),
        (1, "priority", True, True),
        (2, "fcfs", False, True),
        (3, "priority", False, False),
        (4, "fcfs", True, False),
        (5, "priority", True, True),
    ],
)
def test_random_workloads(seed, policy, chunked, caching):
    rng = random.Random(seed)
    s = make_scheduler(
        num_blocks=rng.choice([12, 20, 40]),
        block_size=16,
        budget=rng.choice([32, 64, 128]),
        max_num_seqs=rng.choice([2, 4, 8]),
        threshold=rng.choice([0, 24, 48]),
        chunked=chunked,
        policy=policy,
        prefix_caching=caching,
        max_model_len=160,
    )
    run_random_workload(s, rng)
