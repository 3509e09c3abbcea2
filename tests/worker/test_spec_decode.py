"""Speculative decoding in the worker: the n-gram proposer, the verification plan, and the
rejection sampler's distribution (chi-square over tens of thousands of draws on a small
vocabulary: each emitted token has the non-speculative sampler's distribution with
temperature, top-k, top-p and min-p applied)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from scipy import stats

from jaxserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.batch_builder import BatchBuilder, InputBatch
from jaxserve.worker.ngram_proposer import NgramProposer
from jaxserve.worker.sampler import sample, sampling_probs
from jaxserve.worker.sampling_metadata import SamplingMetadata, SamplingRow
from jaxserve.worker.spec_decode import accept, accept_on_device, plan_verification

# ---------------------------------------------------------------- n-gram proposer


def test_ngram_longest_match_wins_then_latest_occurrence():
    p = NgramProposer(3, 1, 3)
    #            0  1  2  3  4  5  6  7  8  9  10 11
    tokens = [5, 1, 2, 3, 9, 2, 3, 7, 1, 2, 3]
    # suffix (1, 2, 3) occurs at 1..3 (followed by 9, 2, 3); (2, 3) also at 5..6 (later) but
    # shorter: the 3-gram wins
    assert p.propose(np.array(tokens)) == [9, 2, 3]
    # only (3,) repeats: its latest earlier occurrence (6) is followed by 7, 1, 2
    assert p.propose(np.array([3, 8, 3, 7, 1, 2, 4, 3])) == [7, 1, 2]


def test_ngram_min_size_short_tail_and_no_match():
    assert NgramProposer(4, 2, 3).propose(np.array([1, 2, 5, 1, 2])) == [5, 1, 2]
    assert NgramProposer(4, 2, 3).propose(np.array([1, 5, 9, 1])) == []  # only a 1-gram
    assert NgramProposer(4, 1, 1).propose(np.array([6, 7, 6])) == [7, 6]  # the sequence ends
    assert NgramProposer(2, 1, 2).propose(np.array([1, 2, 3])) == []
    assert NgramProposer(2, 1, 2).propose(np.array([4])) == []
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, 3, 2)


# ---------------------------------------------------------------- verification plan


def _spec_batch():
    """A step with a prefill chunk (a), a request with 2 drafts (b), one with none (c)."""
    ib = InputBatch(max_num_reqs=4, max_model_len=64, block_size=8)
    builder = BatchBuilder(ib, (16, 32), max_num_seqs=4)
    params = SamplingParams(temperature=0.0)
    news = [
        NewRequestData(rid, prompt, [], params, None, ([i + 1],), 0)
        for i, (rid, prompt) in enumerate(
            (("a", list(range(10, 16))), ("b", [1, 2, 3]), ("c", [4, 5]))
        )
    ]
    builder.update_states(
        SchedulerOutput(news, CachedRequestData(), {"a": 6, "b": 3, "c": 2}, 11, set(), set())
    )
    for rid, t in (("b", 20), ("c", 30)):  # their sampled tokens landed
        row = ib.req_id_to_row[rid]
        ib.token_ids[row, ib.num_tokens[row]] = t
        ib.num_tokens[row] += 1
    sched = SchedulerOutput(
        [],
        CachedRequestData(["b", "c"], [None, None], [3, 2], [[20], [30]]),
        {"b": 3, "c": 1},
        4,
        set(),
        set(),
        scheduled_spec_decode_tokens={"b": [21, 22]},
    )
    builder.update_states(sched)
    return builder.build(sched)


def test_plan_reads_logits_at_the_known_token_and_each_draft():
    batch = _spec_batch()
    assert batch.num_spec.tolist() == [2, 0]
    assert batch.sample_mask.tolist() == [True, True]
    assert batch.inputs.input_ids[:4].tolist() == [20, 21, 22, 30]
    plan = plan_verification(batch, k=3)
    assert plan.seqs.tolist() == [0] and plan.rows.tolist() == [0] and plan.width == 4
    # b's tokens are step tokens 0..2; position 3 repeats its last (no third draft)
    assert plan.indices.tolist() == [0, 1, 2, 2]
    assert plan.drafts.tolist() == [[21, 22, -1]]
    assert accept(plan, np.array([21, 22, 7, 8])) == [[21, 22, 7]]  # both accepted, then 7
    assert accept(plan, np.array([21, 5, 7, 8])) == [[21, 5]]  # second rejected: 5 instead
    assert accept(plan, np.array([4, 22, 7, 8])) == [[4]]
    last, n_acc = accept_on_device(
        np.array([9, 9, 0, 0], np.int32), np.array([21, 5, 7, 8], np.int32), plan.rows, plan.drafts
    )
    assert last.tolist() == [5, 9, 0, 0] and n_acc.tolist() == [1, 0, 0, 0]


# ---------------------------------------------------------------- distribution


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    p = probs[keep].astype(np.float64)
    expected = p / p.sum() * counts.sum()
    return stats.chisquare(counts[keep], expected).pvalue


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.02),
        SamplingParams(temperature=1.3),
    ],
    ids=["filters", "plain"],
)
def test_rejection_sampling_keeps_the_target_distribution(params):
    """Draws with drafts d1 (a likely token) and d2 (an unlikely one) at two positions, N rows
    with seeds 0..N-1 (one request each): the first emitted token follows p_0, the second
    (given d1 accepted) follows p_1, and each equals the non-speculative sample of its seed."""
    n, vocab = 40_000, 8
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 1.5, size=(2, vocab)).astype(np.float32)
    md = SamplingMetadata.from_params([SamplingRow(params, s, 3, (), ()) for s in range(n)], n)
    expanded = md.expand(np.arange(n), 3)  # positions 0, 1 and the bonus position 2
    rows = np.tile(np.stack([logits[0], logits[1], logits[1]]), (n, 1))  # [3 N, V]
    probs = np.asarray(
        sampling_probs(
            logits, SamplingMetadata.from_params([SamplingRow(params, 0, 0, (), ())] * 2, 2)
        )
    )
    d1 = int(np.argmax(probs[0]))
    d2 = int(np.argsort(probs[1])[-3])  # the third most likely: often rejected
    tokens = np.asarray(jax.jit(sample)(rows, expanded).token_ids)
    plan = type("Plan", (), {})()
    plan.seqs, plan.num_rows, plan.width = np.arange(n), n, 3
    plan.drafts = np.tile(np.array([[d1, d2]], np.int32), (n, 1))
    emitted = accept(plan, tokens)
    first = np.array([e[0] for e in emitted])
    second = np.array([e[1] for e in emitted if len(e) > 1])
    assert _chi_square_p(np.bincount(first, minlength=vocab), probs[0]) > 1e-3
    assert _chi_square_p(np.bincount(second, minlength=vocab), probs[1]) > 1e-3
    # acceptance of d1 is p_0(d1) (Leviathan et al.'s min(1, p/q) for a point-mass draft)
    assert abs(np.mean(first == d1) - probs[0][d1]) < 0.01
    # the same seed without speculation: the same first token
    plain = np.asarray(jax.jit(sample)(np.tile(logits[0], (n, 1)), md).token_ids)
    assert np.array_equal(first, plain)
