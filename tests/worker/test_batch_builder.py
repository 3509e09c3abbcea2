"""Batch builder: buckets, the persistent InputBatch, and exact padded step inputs (numpy only)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.batch_builder import (
    BatchBuilder,
    InputBatch,
    default_token_buckets,
    next_power_of_2,
    pick_bucket,
    resolve_token_buckets,
    seq_bucket,
)

BS = 4  # block size


def test_default_buckets_are_powers_of_two_up_to_the_budget():
    assert default_token_buckets(8192) == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert default_token_buckets(100) == (16, 32, 64, 100)
    assert default_token_buckets(8) == (8,)
    many = default_token_buckets(1 << 20)
    assert len(many) == 16 and many[-1] == 1 << 20 and many[0] == 1 << 5
    # the CPU's ladder starts at one token (a lone decode row is not padded to 16)
    assert default_token_buckets(512, min_bucket=1) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert resolve_token_buckets((), 512, min_bucket=1)[:2] == (1, 2)
    assert resolve_token_buckets((), 64, multiple=8, min_bucket=1) == (8, 16, 32, 64)


def test_configured_buckets_must_reach_the_budget():
    assert resolve_token_buckets((16, 64), 64) == (16, 64)
    with pytest.raises(ValueError, match="token_buckets"):
        resolve_token_buckets((16, 32), 64)
    with pytest.raises(ValueError, match="token_buckets"):
        resolve_token_buckets(tuple(2**i for i in range(4, 22)), 16)


def test_seq_bucket_and_pick_bucket():
    assert [next_power_of_2(n) for n in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]
    assert seq_bucket(16, 256) == 16
    assert seq_bucket(8192, 256) == 256
    assert seq_bucket(8192, 100) == 128
    assert seq_bucket(16, 1) == 1
    assert pick_bucket((16, 32, 64), 1) == 16
    assert pick_bucket((16, 32, 64), 17) == 32
    assert pick_bucket((16, 32, 64), 64) == 64
    with pytest.raises(AssertionError):
        pick_bucket((16, 32, 64), 65)


def _new(req_id, prompt, blocks, computed=0, output=(), params=None):
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        sampling_params=params or SamplingParams(temperature=0.0),
        eos_token_id=2,
        block_ids=(list(blocks),),
        num_computed_tokens=computed,
    )


def _sched(new=(), cached=None, num_scheduled=None, finished=(), preempted=()):
    cached = cached or CachedRequestData()
    num_scheduled = dict(num_scheduled or {})
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        preempted_req_ids=set(preempted),
        finished_req_ids=set(finished),
    )


def _builder(max_reqs=4, max_len=32, buckets=(16, 32), num_groups=1):
    batch = InputBatch(max_reqs, max_len, BS, num_groups)
    return batch, BatchBuilder(batch, buckets, max_reqs)


def test_mixed_step_inputs_are_exact():
    batch, builder = _builder()
    # a: 10-token prompt, 4 tokens already cached (prefix hit), 6 computed now -> samples.
    # b: 7-token prompt, first chunk of 3 -> partial prefill, samples nothing.
    a = _new("a", range(100, 110), [7, 3, 9], computed=4)
    b = _new("b", range(200, 207), [5, 6])
    sched = _sched(new=[a, b], num_scheduled={"a": 6, "b": 3})
    builder.update_states(sched)
    step = builder.build(sched)
    inp = step.inputs
    assert step.token_bucket == 16 and step.seq_bucket == 4 and step.num_tokens == 9
    assert step.req_ids == ["a", "b"]
    np.testing.assert_array_equal(inp.input_ids[:9], [104, 105, 106, 107, 108, 109, 200, 201, 202])
    assert not inp.input_ids[9:].any()
    np.testing.assert_array_equal(inp.positions[:9], [4, 5, 6, 7, 8, 9, 0, 1, 2])
    # a: positions 4..7 -> block 3 (slots 12..15), 8..9 -> block 9 (slots 36, 37); b: block 5
    assert inp.slot_mapping.shape == (1, 16)  # one KV-cache group
    np.testing.assert_array_equal(inp.slot_mapping[0, :9], [12, 13, 14, 15, 36, 37, 20, 21, 22])
    assert (inp.slot_mapping[0, 9:] == -1).all()
    np.testing.assert_array_equal(inp.query_start_loc, [0, 6, 9, 9, 9])
    np.testing.assert_array_equal(inp.context_lens, [10, 3, 0, 0])
    assert int(inp.num_seqs) == 2
    np.testing.assert_array_equal(inp.logits_indices, [5, 8, 0, 0])
    assert inp.block_tables.shape == (1, 4, 8)
    np.testing.assert_array_equal(inp.block_tables[0, 0, :4], [7, 3, 9, 0])
    np.testing.assert_array_equal(inp.block_tables[0, 1, :3], [5, 6, 0])
    assert not inp.block_tables[0, 2:].any()
    np.testing.assert_array_equal(step.sample_mask, [True, False])
    assert step.prompt_logprob_targets is None
    for arr in (
        inp.input_ids,
        inp.positions,
        inp.slot_mapping,
        inp.block_tables,
        inp.context_lens,
        inp.query_start_loc,
        inp.logits_indices,
    ):
        assert arr.dtype == np.int32


def test_cached_requests_append_blocks_and_tokens_and_rows_are_reused():
    batch, builder = _builder()
    a = _new("a", [11, 12, 13], [4])
    sched = _sched(new=[a], num_scheduled={"a": 3})
    builder.update_states(sched)
    builder.build(sched)
    # decode step: the sampled token 14 arrives as new_token_ids; a block boundary is crossed
    cached = CachedRequestData(
        req_ids=["a"], new_block_ids=[([8],)], num_computed_tokens=[3], new_token_ids=[[14]]
    )
    sched = _sched(cached=cached, num_scheduled={"a": 1})
    builder.update_states(sched)
    step = builder.build(sched)
    assert step.inputs.input_ids[0] == 14 and step.inputs.positions[0] == 3
    assert step.inputs.slot_mapping[0, 0] == 4 * BS + 3
    np.testing.assert_array_equal(batch.block_table[0, batch.req_id_to_row["a"], :2], [4, 8])
    assert step.sample_mask.tolist() == [True]
    cached = CachedRequestData(
        req_ids=["a"], new_block_ids=[None], num_computed_tokens=[4], new_token_ids=[[15]]
    )
    sched = _sched(cached=cached, num_scheduled={"a": 1})
    builder.update_states(sched)
    step = builder.build(sched)
    assert step.inputs.slot_mapping[0, 0] == 8 * BS + 0
    row_a = batch.req_id_to_row["a"]
    # finishing frees the row; the next new request takes it over with a clean block table
    sched = _sched(new=[_new("b", [1, 2], [5])], num_scheduled={"b": 2}, finished=["a"])
    builder.update_states(sched)
    assert "a" not in batch and batch.req_id_to_row["b"] == row_a
    assert batch.block_table[0, row_a, 1] == 0 and batch.num_tokens[row_a] == 2


def test_preempted_request_is_dropped_and_resumes_with_its_outputs():
    batch, builder = _builder()
    sched = _sched(new=[_new("a", [1, 2, 3], [4])], num_scheduled={"a": 3})
    builder.update_states(sched)
    sched = _sched(preempted=["a"])
    builder.update_states(sched)
    assert len(batch) == 0
    resumed = _new("a", [1, 2, 3], [9, 10], output=[7, 8])
    sched = _sched(new=[resumed], num_scheduled={"a": 5})
    builder.update_states(sched)
    step = builder.build(sched)
    np.testing.assert_array_equal(step.inputs.input_ids[:5], [1, 2, 3, 7, 8])
    np.testing.assert_array_equal(step.inputs.slot_mapping[0, :5], [36, 37, 38, 39, 40])
    assert step.sample_mask.tolist() == [True]


def test_padding_never_exceeds_buckets_and_large_steps_pick_larger_bucket():
    batch, builder = _builder(max_reqs=4, max_len=64, buckets=(16, 32, 64))
    news = [_new(f"r{i}", range(10 * i, 10 * i + 5), [i + 1, i + 5]) for i in range(4)]
    sched = _sched(new=news, num_scheduled={f"r{i}": 5 for i in range(4)})
    builder.update_states(sched)
    step = builder.build(sched)
    assert step.token_bucket == 32 and step.seq_bucket == 4
    np.testing.assert_array_equal(step.inputs.query_start_loc, [0, 5, 10, 15, 20])
    np.testing.assert_array_equal(step.inputs.logits_indices, [4, 9, 14, 19])


def test_prompt_logprob_targets_mark_next_prompt_tokens():
    batch, builder = _builder()
    want = SamplingParams(temperature=0.0, prompt_logprobs=2)
    a = _new("a", [10, 11, 12, 13, 14], [1, 2], params=want)
    b = _new("b", [20, 21], [3])
    sched = _sched(new=[a, b], num_scheduled={"a": 3, "b": 2})
    builder.update_states(sched)
    step = builder.build(sched)
    # a computes positions 0..2 -> scores prompt tokens at 1..3; b asked for none
    np.testing.assert_array_equal(step.prompt_logprob_targets[:5], [11, 12, 13, -1, -1])
    assert (step.prompt_logprob_targets[5:] == -1).all()
    cached = CachedRequestData(
        req_ids=["a"], new_block_ids=[None], num_computed_tokens=[3], new_token_ids=[[13, 14]]
    )
    sched = _sched(cached=cached, num_scheduled={"a": 2}, finished=["b"])
    builder.update_states(sched)
    step = builder.build(sched)
    # positions 3, 4: position 3 scores token 4 (14); the last prompt position scores nothing
    np.testing.assert_array_equal(step.prompt_logprob_targets[:2], [14, -1])


def test_scheduling_past_known_tokens_is_an_error():
    batch, builder = _builder()
    sched = _sched(new=[_new("a", [1, 2], [1])], num_scheduled={"a": 3})
    builder.update_states(sched)
    with pytest.raises(AssertionError):
        builder.build(sched)


@pytest.mark.parametrize("pipelined,num_groups", [(False, 1), (True, 1), (True, 3)])
def test_steady_build_equals_the_full_build(pipelined, num_groups):
    """build_steady (a steady-decode step made from the previous batch) gives the inputs build
    gives, step after step, across block boundaries and a block-table row that grows; both when
    each step's tokens are recorded before the next step is built (synchronous) and when the
    next step is built while they are in flight (async scheduling: prev_index); with several
    KV-cache groups, each with its own block ids (slots and tables per group)."""
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8, 9], "c": list(range(10, 21))}
    ids = list(prompts)
    blocks = {r: [] for r in ids}
    next_block = iter(range(1, 100))

    def grow(r, end):  # blocks for positions < end; the new ones, per group (None: none)
        new = []
        while (len(blocks[r]) + len(new)) * BS < end:
            new.append(next(next_block))
        blocks[r] += new
        return tuple([b + 100 * g for b in new] for g in range(num_groups)) if new else None

    def new_req(r, p):
        return dataclasses.replace(_new(r, p, []), block_ids=grow(r, len(p)))

    builders = [
        _builder(max_reqs=4, max_len=64, buckets=(4, 32), num_groups=num_groups) for _ in range(2)
    ]
    first = _sched(
        new=[new_req(r, p) for r, p in prompts.items()],
        num_scheduled={r: len(p) for r, p in prompts.items()},
    )
    lasts = []
    for _, builder in builders:
        builder.update_states(first)
        lasts.append(builder.build(first))
    computed = {r: len(p) for r, p in prompts.items()}

    def record(ends, tokens):  # what collect does: the sampled tokens join their rows
        for ib, _ in builders:
            for r, end, token in zip(ids, ends, tokens):
                row = ib.req_id_to_row[r]
                ib.token_ids[row, end] = token
                ib.num_tokens[row] = end + 1

    in_flight = ([computed[r] for r in ids], [100, 200, 300])
    if not pipelined:
        record(*in_flight)
    num_steady = 0
    for step in range(1, 20):
        cached = CachedRequestData(
            req_ids=list(ids),
            new_block_ids=[grow(r, computed[r] + 1) for r in ids],
            num_computed_tokens=[computed[r] for r in ids],
            new_token_ids=[],
        )
        sched = _sched(cached=cached, num_scheduled=dict.fromkeys(ids, 1))
        sched.steady_decode = True
        prev = {r: i for i, r in enumerate(ids)}
        prev_tokens = np.arange(8, dtype=np.int32) + 1000 * step
        (ib_s, steady), (ib_f, full) = builders
        steady.update_states(sched)
        full.update_states(sched)
        got = steady.build_steady(sched, lasts[0], prev_tokens)
        if step == 1:  # after a prefill: not a run yet (built in full)
            assert got is None
            got = steady.build(sched, prev, prev_tokens)
        else:
            assert got is not None, step
            num_steady += 1
        want = full.build(sched, prev, prev_tokens)
        np.testing.assert_array_equal(got.inputs.packed, want.inputs.packed)
        assert got.inputs.layout == want.inputs.layout
        assert got.inputs.prev_tokens is want.inputs.prev_tokens
        for field in ("rows", "num_scheduled", "start_positions", "sample_mask"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
        assert (got.req_ids, got.token_bucket, got.seq_bucket, got.num_tokens) == (
            want.req_ids,
            want.token_bucket,
            want.seq_bucket,
            want.num_tokens,
        )
        assert got.prompt_logprob_targets is None
        lasts = [got, want]
        if pipelined:
            record(*in_flight)  # the previous step's tokens land after this one is built
        in_flight = ([computed[r] + 1 for r in ids], [100 * (i + 1) + step for i in range(3)])
        if not pipelined:
            record(*in_flight)
        for r in ids:
            computed[r] += 1
    assert num_steady == 18
    # a step that is not the previous one's (a request left): no steady build
    (_, steady) = builders[0]
    sched = _sched(
        cached=CachedRequestData(["a", "b"], [None, None], [computed["a"], computed["b"]], []),
        num_scheduled={"a": 1, "b": 1},
        finished=["c"],
    )
    sched.steady_decode = True
    steady.update_states(sched)
    assert steady.build_steady(sched, lasts[0], None) is None
