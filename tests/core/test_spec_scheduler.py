"""Speculative decoding in the scheduler: drafts in the step and the budget, rollback of rejected
drafts (no block leak, prefix-cache blocks only over accepted tokens), the ledger and stats,
lock-step under async scheduling, lookahead slots, disable_by_batch_size. Pure Python: a fake
runner plays a deterministic greedy "model" and a proposer whose drafts are right for a random
number of positions."""

from __future__ import annotations

import random

import pytest
from core_testing import (
    EOS,
    check_scheduler_invariants,
    expected_tokens,
    fake_token,
    make_request,
)

from jaxserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from jaxserve.core.runner_output import ModelRunnerOutput
from jaxserve.core.sched_output import SchedulerOutput
from jaxserve.core.scheduler import Scheduler

K = 3


def spec_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 8,
    budget: int = 64,
    k: int = K,
    method: str = "ngram",
    disable_by_batch_size: int | None = None,
    max_model_len: int = 256,
    threshold: int = 0,
) -> Scheduler:
    spec = SpeculativeConfig(
        method=method,
        num_speculative_tokens=k,
        model="draft" if method == "draft_model" else None,
        disable_by_batch_size=disable_by_batch_size,
    )
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            long_prefill_token_threshold=threshold,
        ),
        CacheConfig(block_size=block_size),
        num_gpu_blocks=num_blocks,
        speculative_config=spec,
    )


class SpecFakeRunner:
    """A greedy "model" (``fake_token(req_id, position)``) that verifies drafts as the real
    runner does and proposes K drafts after each sampled token, right for a random number of
    positions (``rng``), wrong after. It keeps each request's row and a simulated K/V cache
    (slot -> (token, position)) to check what the scheduler registers in the prefix cache."""

    def __init__(self, scheduler: Scheduler, seed: int = 0, k: int = K) -> None:
        self.s = scheduler
        self.rng = random.Random(seed)
        self.k = k
        self.rows: dict[str, dict] = {}
        self.slots: dict[int, tuple[int, int]] = {}
        self.drafted = self.accepted = 0

    def truth(self, req_id: str, pos: int) -> int:
        return fake_token(req_id, pos)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.s.block_size
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.rows.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.rows[new.req_id] = {
                "tokens": list(new.prompt_token_ids) + list(new.output_token_ids),
                "blocks": list(new.block_ids),
            }
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self.rows[req_id]["blocks"].extend(cached.new_block_ids[i])
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        req_ids = list(out.num_scheduled_tokens)
        sampled, drafts_out = [], {}
        for i, req_id in enumerate(cached.req_ids):  # known tokens only, drafts apart
            k = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
            start = cached.num_computed_tokens[i]
            n = out.num_scheduled_tokens[req_id] - k
            assert cached.new_token_ids[i] == self.rows[req_id]["tokens"][start : start + n]
        for req_id in req_ids:
            row = self.rows[req_id]
            tokens = row["tokens"]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            start, n = starts[req_id], out.num_scheduled_tokens[req_id]
            assert start + n - len(drafts) <= len(tokens)
            for pos in range(start, start + n):  # K/V of known tokens, then of the drafts
                block = row["blocks"][pos // bs]
                assert block != 0, "null block written"
                token = tokens[pos] if pos < len(tokens) else drafts[pos - len(tokens)]
                self.slots[block * bs + pos % bs] = (token, pos)
            if start + n - len(drafts) < len(tokens):
                sampled.append([])  # a partial prompt chunk
                continue
            assert start + n - len(drafts) == len(tokens)
            new = []
            for j in range(len(drafts) + 1):
                t = self.truth(req_id, len(tokens) + j)
                new.append(t)
                if j == len(drafts) or drafts[j] != t:
                    break
            if drafts:
                self.drafted += len(drafts)
                self.accepted += len(new) - 1
            tokens.extend(new)
            sampled.append(new)
            if out.speculate:  # proposals for the next step: right for `good` positions
                good = self.rng.randint(0, self.k)
                length = len(tokens)
                drafts_out[req_id] = [
                    self.truth(req_id, length + j) if j < good else EOS - 1 - j
                    for j in range(self.k)
                ]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            draft_token_ids=drafts_out or None,
        )

    def check_cached_blocks(self) -> None:
        """Every block a running request has registered in the prefix cache holds that
        request's accepted tokens (no rejected draft's K/V)."""
        bs = self.s.block_size
        kv = self.s.kv_cache_manager
        for request in self.s.running:
            blocks = kv.req_to_blocks[request.request_id]
            for b in range(kv.num_cached_block[request.request_id]):
                for pos in range(b * bs, (b + 1) * bs):
                    slot = blocks[b].block_id * bs + pos % bs
                    assert self.slots[slot] == (request.all_token_ids[pos], pos), (
                        request.request_id,
                        pos,
                    )


def run(s: Scheduler, runner: SpecFakeRunner, requests, max_steps: int = 3000):
    for r in requests:
        s.add_request(r)
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        check_scheduler_invariants(s, out)
        for req_id, drafts in out.scheduled_spec_decode_tokens.items():
            assert out.num_scheduled_tokens[req_id] == 1 + len(drafts) <= 1 + runner.k
        for o in s.update_from_output(out, runner.execute(out)):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
        runner.check_cached_blocks()
    assert not s.has_unfinished_requests()
    return outputs


@pytest.mark.parametrize("num_blocks", [64, 14])  # 14: preemptions
def test_exact_outputs_rollback_and_no_leak(num_blocks):
    s = spec_scheduler(num_blocks=num_blocks, budget=24)
    runner = SpecFakeRunner(s, seed=num_blocks)
    rng = random.Random(1)
    requests = [
        make_request(f"r{i}", [rng.randrange(1, 900) for _ in range(rng.randint(1, 13))])
        for i in range(6)
    ]
    lens = {r.request_id: (r.num_prompt_tokens, r.sampling_params.max_tokens) for r in requests}
    outputs = run(s, runner, requests)
    for req_id, (prompt_len, max_tokens) in lens.items():
        assert outputs[req_id] == expected_tokens(req_id, prompt_len, max_tokens), req_id
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == num_blocks - 1 and not kv.req_to_blocks  # no block leaked
    assert runner.drafted > runner.accepted > 0
    stats = s.make_stats()
    assert stats.spec_decode_num_draft_tokens == runner.drafted
    assert stats.spec_decode_num_accepted_tokens == runner.accepted
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == runner.accepted
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert list(per_pos) == sorted(per_pos, reverse=True)  # position j needs j - 1 accepted
    ledgers = [r.ledger for r in requests]
    assert sum(led.num_draft_tokens for led in ledgers) == runner.drafted
    assert sum(led.num_accepted_tokens for led in ledgers) == runner.accepted
    assert sum(led.num_drafts for led in ledgers) == stats.spec_decode_num_drafts
    if num_blocks == 14:
        assert s.make_stats().num_preemptions == 0  # counters were reset above
        assert any(led.preemptions for led in ledgers)
    d = ledgers[0].to_dict()["speculative"]
    assert d["num_accepted_tokens"] <= d["num_draft_tokens"]


def test_drafts_fit_budget_max_tokens_and_min_tokens():
    s = spec_scheduler(budget=64)
    a = make_request("a", [1, 2, 3], max_tokens=3)
    b = make_request("b", [1, 2, 3], max_tokens=20, min_tokens=2)
    s.add_request(a)
    s.add_request(b)
    s.update_from_output(*_prefill(s))
    for r in (a, b):
        r.spec_token_ids = [7, 8, 9]
    out = s.schedule()
    # a: 1 output of 3, so at most 1 draft (2 drafts accepted + 1 would pass max_tokens);
    # b: under min_tokens (1 of 2): none, and its stale proposals are dropped.
    assert out.scheduled_spec_decode_tokens == {"a": [7]}
    assert out.num_scheduled_tokens == {"a": 2, "b": 1}
    assert b.spec_token_ids == []
    assert out.speculate


def test_budget_truncates_drafts():
    s = spec_scheduler(budget=3)
    a = make_request("a", [1, 2], max_tokens=20)
    s.add_request(a)
    s.update_from_output(*_prefill(s))
    a.spec_token_ids = [5, 6, 7]
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [5, 6]}
    assert out.total_num_scheduled_tokens == 3


def test_stop_token_inside_drafts_ends_the_request_there():
    s = spec_scheduler()
    a = make_request("a", [1, 2], max_tokens=20, stop_token_ids=[42])
    s.add_request(a)
    s.update_from_output(*_prefill(s))
    a.spec_token_ids = [5, 42, 6]
    out = s.schedule()
    outputs = s.update_from_output(out, _output(out, {"a": [5, 42, 6, 9]}))
    (o,) = outputs
    assert o.new_token_ids == [5, 42] and o.finish_reason == "stop" and o.stop_reason == 42
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.num_gpu_blocks - 1


def test_async_lock_step_waits_for_drafts_in_flight():
    s = spec_scheduler()
    a = make_request("a", [1, 2, 3], max_tokens=20)
    s.add_request(a)
    out1 = s.schedule()
    out2 = s.schedule()  # a's first token is in flight: speculation on, it waits for it
    assert out2.is_empty
    s.update_from_output(out1, _output(out1, {"a": [4]}))
    s.update_from_output(out2, _output(out2, {}))
    a.spec_token_ids = [5, 6]
    out3 = s.schedule()
    assert out3.scheduled_spec_decode_tokens == {"a": [5, 6]} and a.num_spec_in_flight == 2
    assert s.schedule().is_empty  # its drafts are in flight
    s.update_from_output(out3, _output(out3, {"a": [5, 7]}))  # one accepted
    assert a.num_computed_tokens == 5 and a.all_token_ids == [1, 2, 3, 4, 5, 7]
    assert a.num_spec_in_flight == 0 and a.ledger.num_accepted_tokens == 1


def test_draft_model_lookahead_slots_are_allocated_not_registered():
    s = spec_scheduler(method="draft_model", block_size=8)
    a = make_request("a", list(range(1, 14)), max_tokens=20)
    s.add_request(a)
    out = s.schedule()
    kv = s.kv_cache_manager
    # 13 prompt tokens + 3 lookahead slots for the draft's own writes: 2 blocks, 1 registered
    assert kv.num_blocks_held("a") == 2 and kv.num_cached_block["a"] == 1
    s.update_from_output(out, _output(out, {"a": [14]}))
    a.spec_token_ids = [15, 16, 17]
    out = s.schedule()  # 13 computed + 1 + 3 drafts, + 3 lookahead = 20 slots: 3 blocks
    assert out.num_scheduled_tokens == {"a": 4}
    assert kv.num_blocks_held("a") == 3 and kv.num_cached_block["a"] == 1


def test_disable_by_batch_size():
    s = spec_scheduler(disable_by_batch_size=1)
    for name in ("a", "b"):
        s.add_request(make_request(name, [1, 2], max_tokens=20))
    out = s.schedule()
    assert not out.speculate  # two requests > 1
    s.update_from_output(out, _output(out, {"a": [3], "b": [3]}))
    s.abort_requests("b")
    assert s.schedule().speculate


def _prefill(s: Scheduler):
    out = s.schedule()
    return out, _output(out, {r: [100] for r in out.num_scheduled_tokens})


def _output(out: SchedulerOutput, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[tokens.get(r, []) for r in req_ids],
    )
