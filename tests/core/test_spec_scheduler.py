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
from jaxserve.core.request import RequestStatus
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
    kv_cache_groups: tuple[int | None, ...] = (),
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
        CacheConfig(block_size=block_size, kv_cache_groups=kv_cache_groups),
        num_gpu_blocks=num_blocks,
        speculative_config=spec,
    )


class SpecFakeRunner:
    """A greedy "model" (``fake_token(req_id, position)``) that verifies drafts as the real
    runner does and proposes K drafts after each sampled token, right for a random number of
    positions (``rng``), wrong after. It keeps each request's row (one block table per KV-cache
    group, as the real runner) and a simulated K/V cache ((group, slot) -> (token, position))
    to check what the scheduler registers in the prefix cache and, in sliding-window groups,
    that every key a step's tokens (known and draft) read in their window is still there.
    With the draft_model method it also "writes" the draft's K/V at the lookahead positions
    after each kept token, in the group the draft's cache uses (the first full-attention one),
    checking the scheduler allocated them to the request."""

    def __init__(self, scheduler: Scheduler, seed: int = 0, k: int = K) -> None:
        self.s = scheduler
        self.rng = random.Random(seed)
        self.k = k
        self.rows: dict[str, dict] = {}
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}
        self.drafted = self.accepted = 0
        self.windows = scheduler.kv_cache_manager.sliding_windows
        spec = scheduler.speculative_config
        self.lookahead = 0 if spec is None else spec.num_lookahead_tokens
        self.draft_group = next((g for g, w in enumerate(self.windows) if w is None), None)
        self.lookahead_writes = 0

    def truth(self, req_id: str, pos: int) -> int:
        return fake_token(req_id, pos)

    def _check_reads(self, req_id: str, start: int, end: int, drafts: list[int]) -> None:
        """Every key that positions ``[start, end)`` read in every sliding group holds the
        request's token (or this step's draft) at that position."""
        bs = self.s.block_size
        row = self.rows[req_id]
        tokens = row["tokens"]
        held = self.s.kv_cache_manager.req_to_blocks[req_id]
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            for pos in range(max(0, start - window + 1), end):
                block = row["blocks"][g][pos // bs]
                assert block != 0, (req_id, g, pos, "a key in the window sits in the null block")
                assert held[g][pos // bs].block_id == block, (req_id, g, pos, "freed too early")
                want = tokens[pos] if pos < len(tokens) else drafts[pos - len(tokens)]
                assert self.slots.get((g, block * bs + pos % bs)) == (want, pos), (req_id, g, pos)

    def _draft_writes(self, req_id: str, first: int) -> None:
        """The draft model's K/V writes at positions ``first .. first + lookahead - 1`` (its
        pool, so the target's simulated cache is not touched): each lies in a block the
        request holds in the draft's group, unless past max_model_len."""
        if not self.lookahead or self.draft_group is None:
            return
        bs = self.s.block_size
        held = self.s.kv_cache_manager.req_to_blocks[req_id][self.draft_group]
        table = self.rows[req_id]["blocks"][self.draft_group]
        for pos in range(first, min(first + self.lookahead, self.s.max_model_len)):
            if pos // bs >= len(table):
                # Admission fell back to no lookahead (the pool was short): the table's
                # padding is the null block, which the draft does not write.
                assert self.rows[req_id]["admitted_short"], (req_id, pos)
                continue
            assert table[pos // bs] == held[pos // bs].block_id != 0, (req_id, pos)
            self.lookahead_writes += 1

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.s.block_size
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.rows.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert len(new.block_ids) == len(self.windows), new.block_ids
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.rows[new.req_id] = {
                "tokens": tokens,
                "blocks": [list(t) for t in new.block_ids],
                # its tables stop before its first lookahead slots (admission without them)
                "admitted_short": len(new.block_ids[0]) * bs < len(tokens) + self.lookahead,
            }
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.new_block_ids[i] is not None:
                for table, ids in zip(self.rows[req_id]["blocks"], cached.new_block_ids[i]):
                    table.extend(ids)
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        req_ids = list(out.num_scheduled_tokens)
        sampled, drafts_out = [], {}
        for i, req_id in enumerate(cached.req_ids):  # known tokens only, drafts apart
            k = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
            start = cached.num_computed_tokens[i]
            n = out.num_scheduled_tokens[req_id] - k
            assert cached.new_token_ids[i] == self.rows[req_id]["tokens"][start : start + n]
        for req_id in req_ids:  # K/V of known tokens, then of the drafts, in every group
            row = self.rows[req_id]
            tokens = row["tokens"]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            start, n = starts[req_id], out.num_scheduled_tokens[req_id]
            assert start + n - len(drafts) <= len(tokens)
            for pos in range(start, start + n):
                token = tokens[pos] if pos < len(tokens) else drafts[pos - len(tokens)]
                for g, table in enumerate(row["blocks"]):
                    block = table[pos // bs]
                    assert block != 0, "null block written"
                    self.slots[(g, block * bs + pos % bs)] = (token, pos)
        for new in out.scheduled_new_reqs:  # a full group's prefix hit: this request's tokens
            tokens = self.rows[new.req_id]["tokens"]
            for g, window in enumerate(self.windows):
                if window is None:
                    for pos in range(new.num_computed_tokens):
                        slot = new.block_ids[g][pos // bs] * bs + pos % bs
                        assert self.slots.get((g, slot)) == (tokens[pos], pos), (new.req_id, pos)
        for req_id in req_ids:  # after every write of the step, as the kernels read
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            start = starts[req_id]
            self._check_reads(req_id, start, start + out.num_scheduled_tokens[req_id], drafts)
        for req_id in req_ids:
            row = self.rows[req_id]
            tokens = row["tokens"]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            start, n = starts[req_id], out.num_scheduled_tokens[req_id]
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
                self._draft_writes(req_id, len(tokens) - 1)
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
        request's accepted tokens (no rejected draft's K/V), in every group (a block a sliding
        window has freed since is skipped)."""
        bs = self.s.block_size
        kv = self.s.kv_cache_manager
        for request in self.s.running:
            tables = kv.req_to_blocks[request.request_id]
            for g, blocks in enumerate(tables):
                for b in range(kv.num_cached_block[request.request_id]):
                    if blocks[b].is_null:
                        continue
                    for pos in range(b * bs, (b + 1) * bs):
                        slot = blocks[b].block_id * bs + pos % bs
                        assert self.slots[(g, slot)] == (request.all_token_ids[pos], pos), (
                            request.request_id,
                            g,
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
    assert not s.waits_for_in_flight()  # nothing in flight
    out1 = s.schedule()
    # a's first token is in flight: speculation on, it waits for it (the engine updates first)
    assert s.waits_for_in_flight()
    out2 = s.schedule()
    assert out2.is_empty
    s.update_from_output(out1, _output(out1, {"a": [4]}))
    s.update_from_output(out2, _output(out2, {}))
    assert not s.waits_for_in_flight()
    a.spec_token_ids = [5, 6]
    out3 = s.schedule()
    assert out3.scheduled_spec_decode_tokens == {"a": [5, 6]} and a.num_spec_in_flight == 2
    assert s.waits_for_in_flight()
    b = make_request("b", [1, 2], max_tokens=20)
    s.add_request(b)  # a waiting request can be admitted: no waiting for the step in flight
    assert not s.waits_for_in_flight()
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert s.waits_for_in_flight()
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


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("groups", [(None, 6), (6,), (None, 11, 6)])
@pytest.mark.parametrize("small", [False, True])  # small: a pool where requests preempt
def test_hybrid_groups_lookahead_rollback_prefix_hits_and_no_leak(method, groups, small):
    """Speculation over the hybrid KV cache's groups (sliding windows of 6 and 11 tokens beside
    a full-attention group, or every layer sliding): the drafts' and lookahead positions lie in
    blocks the request holds in every group, a window's freeing leaves every key a known or
    draft token reads, rejected drafts are rolled back with the per-group tables, the prefix
    cache holds accepted tokens only (a second wave's prompts are the first wave's whole
    sequences: their hits cover blocks where drafts were rejected), outputs are exact and no
    block leaks."""
    num_blocks = {1: 10, 2: 24, 3: 30}[len(groups)] if small else 64
    s = spec_scheduler(num_blocks=num_blocks, budget=24, method=method, kv_cache_groups=groups)
    assert s.kv_cache_manager.sliding_windows == groups
    runner = SpecFakeRunner(s, seed=num_blocks)
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 900) for _ in range(rng.randint(1, 13))] for _ in range(6)]
    first = [make_request(f"a{i}", p) for i, p in enumerate(prompts)]
    outputs = run(s, runner, first)
    for r, p in zip(first, prompts):
        assert outputs[r.request_id] == expected_tokens(r.request_id, len(p), 16)
    second_prompts = [p + outputs[f"a{i}"] for i, p in enumerate(prompts)]
    second = [make_request(f"b{i}", p, max_tokens=12) for i, p in enumerate(second_prompts)]
    outputs = run(s, runner, second)
    for r, p in zip(second, second_prompts):
        assert outputs[r.request_id] == expected_tokens(r.request_id, len(p), 12)
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == num_blocks - 1 and not kv.req_to_blocks  # no block leaked
    assert runner.drafted > runner.accepted > 0
    if method == "draft_model" and None in groups:
        assert runner.lookahead_writes > 0
    if small:
        assert any(r.ledger.preemptions for r in first + second)
    else:  # (a small pool evicts the first wave's blocks before the second asks for them)
        assert s.make_stats().prefix_cache_hits > 0
