"""The engine's greedy tokens equal the dense reference generator's (full recompute, no cache),
under every scheduling knob that changes how the work is cut: chunked prefill thresholds, prefix
caching, preemption, max_num_seqs, arrival pattern. Plus the shared cases greedy-batch-invariance,
mixed-hit-batch and full-hit-last-block, and seeded sampling alone vs in a crowd."""

from __future__ import annotations

import random

import pytest
from conftest import MAX_TOKENS

from jaxserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _requests(prompts, params=GREEDY, prefix="r"):
    return [(f"{prefix}{i}", p, params) for i, p in enumerate(prompts)]


def _tokens(done, prefix="r", n=None):
    n = len(done) if n is None else n
    return [done[f"{prefix}{i}"].outputs[0].token_ids for i in range(n)]


@pytest.mark.parametrize(
    "threshold,caching", [(16, True), (64, True), (4096, True), (16, False), (4096, False)]
)
def test_greedy_equals_oracle_chunked_prefill_and_prefix_caching(
    make_engine, run, prompts, oracle, threshold, caching
):
    engine = make_engine(long_prefill_token_threshold=threshold, enable_prefix_caching=caching)
    done = run(engine, _requests(prompts))
    assert _tokens(done) == oracle
    stats = engine.get_stats()
    if caching:  # every fourth prompt shares a 40-token prefix with the one before
        assert stats.prefix_cache_hits_total > 0
    else:
        assert stats.prefix_cache_hits_total == 0
    assert stats.kv_cache_usage == 0.0 and stats.num_running_reqs == 0


def test_greedy_equals_oracle_under_preemption(make_engine, run, prompts, oracle):
    # 40 blocks = 624 usable tokens for ~2,300 tokens of work: requests get preempted and
    # recomputed (their blocks partly come back through the prefix cache).
    engine = make_engine(num_gpu_blocks=40, long_prefill_token_threshold=64)
    done = run(engine, _requests(prompts))
    assert engine.get_stats().num_preemptions_total > 0
    assert _tokens(done) == oracle


@pytest.mark.parametrize("max_num_seqs", [1, 4, 256])
def test_greedy_equals_oracle_max_num_seqs(make_engine, run, prompts, oracle, max_num_seqs):
    engine = make_engine(max_num_seqs=max_num_seqs)
    done = run(engine, _requests(prompts))
    assert _tokens(done) == oracle


def test_greedy_batch_invariance_one_at_a_time_all_at_once_shuffled(
    make_engine, run, prompts, oracle
):
    """Shared case "greedy-batch-invariance"."""
    subset = list(range(0, len(prompts), 3))  # 11 prompts, lengths 1..150
    engine = make_engine()
    alone = []
    for i in subset:
        alone.append(run(engine, [(f"a{i}", prompts[i], GREEDY)])[f"a{i}"].outputs[0].token_ids)
    together_done = run(engine, [(f"t{i}", prompts[i], GREEDY) for i in subset])
    together = [together_done[f"t{i}"].outputs[0].token_ids for i in subset]
    order = subset[:]
    random.Random(0).shuffle(order)
    shuffled_done = run(engine, [(f"s{i}", prompts[i], GREEDY) for i in order])
    shuffled = [shuffled_done[f"s{i}"].outputs[0].token_ids for i in subset]
    assert alone == together == shuffled == [oracle[i] for i in subset]


def test_mixed_hit_batch(base, make_engine, run):
    """Shared case "mixed-hit-batch": warm the cache with S+x (S >= 3 blocks); then S+y together
    with an unrelated Q under a token budget smaller than either prompt; each output equals its
    cold-cache (dense) output."""
    from jaxserve.model.dense_oracle import generate_dense

    rng = random.Random(1)
    vocab = base.arch.vocab_size
    shared = [1] + [rng.randrange(3, vocab) for _ in range(3 * 16 + 5)]
    x = [rng.randrange(3, vocab) for _ in range(9)]
    y = [rng.randrange(3, vocab) for _ in range(13)]
    q = [1] + [rng.randrange(3, vocab) for _ in range(70)]
    engine = make_engine(max_num_batched_tokens=32, long_prefill_token_threshold=32)
    warm = run(engine, [("sx", shared + x, GREEDY)])
    done = run(engine, [("sy", shared + y, GREEDY), ("q", q, GREEDY)])
    assert done["sy"].num_cached_tokens >= 3 * 16
    assert done["q"].num_cached_tokens == 0
    for rid, prompt, out in (("sx", shared + x, warm), ("sy", shared + y, done), ("q", q, done)):
        assert out[rid].outputs[0].token_ids == generate_dense(
            base.model, prompt, MAX_TOKENS, eos_token_ids=[2]
        )


def test_full_hit_last_block(base, make_engine, run):
    """Shared case "full-hit-last-block": a prompt of exactly 4 blocks, repeated, is served from
    the cache except the last block (one token must be computed to sample)."""
    from jaxserve.model.dense_oracle import generate_dense

    prompt = [1] + [random.Random(2).randrange(3, base.arch.vocab_size) for _ in range(63)]
    expect = generate_dense(base.model, prompt, MAX_TOKENS, eos_token_ids=[2])
    engine = make_engine()
    first = run(engine, [("p0", prompt, GREEDY)])["p0"]
    assert first.num_cached_tokens == 0
    for k in range(1, 3):
        again = run(engine, [(f"p{k}", prompt, GREEDY)])[f"p{k}"]
        assert again.num_cached_tokens >= 3 * 16
        assert again.outputs[0].token_ids == first.outputs[0].token_ids == expect


def test_seeded_sampling_alone_equals_in_a_crowd(make_engine, run, prompts):
    seeded = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i in range(4)
    ]
    engine = make_engine()
    alone = [
        run(engine, [(f"a{i}", prompts[i + 3], seeded[i])])[f"a{i}"].outputs[0].token_ids
        for i in range(4)
    ]
    crowd = [(f"s{i}", prompts[i + 3], seeded[i]) for i in range(4)]
    crowd += [(f"g{i}", p, GREEDY) for i, p in enumerate(prompts[10:22])]
    crowd += [
        (f"u{i}", p, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS))
        for i, p in enumerate(prompts[:6])
    ]
    random.Random(3).shuffle(crowd)
    done = run(engine, crowd)
    assert [done[f"s{i}"].outputs[0].token_ids for i in range(4)] == alone
    assert all(len(t) == MAX_TOKENS for t in alone)
    # different seeds give different samples (a 4096-token vocabulary makes a clash unlikely)
    assert len({tuple(t) for t in alone}) == 4


def test_penalties_and_min_tokens_alone_equal_in_a_crowd(make_engine, run, prompts):
    """Rows whose sampling depends on their output so far (penalties, min_tokens bans) sample
    the same alone and among steady decode rows (whose sampling metadata is reused)."""
    special = [
        SamplingParams(
            temperature=1.0,
            seed=5,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            presence_penalty=1.5,
            repetition_penalty=1.3,
        ),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=8, frequency_penalty=0.5),
    ]
    engine = make_engine()
    alone = [
        run(engine, [(f"a{i}", prompts[20 + i], p)])[f"a{i}"].outputs[0].token_ids
        for i, p in enumerate(special)
    ]
    crowd = [(f"s{i}", prompts[20 + i], p) for i, p in enumerate(special)]
    crowd += [
        (f"g{i}", p, SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS))
        for i, p in enumerate(prompts[:10])
    ]
    done = run(engine, crowd)
    assert [done[f"s{i}"].outputs[0].token_ids for i in range(2)] == alone
    assert len(alone[1]) >= 8
