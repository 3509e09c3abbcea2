"""Sampler tests: the documented knob order against a NumPy reference, penalties, seeds, logprobs.

The reference (``reference_probs``) follows the order written in jaxserve/sampling_params.py
step by step on one row; the device code works on a padded batch with a rank order built by
``lax.top_k`` or a full sort, so the two are independent implementations of the same contract.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.sampler import penalized_logits, prompt_logprobs, sample, sampling_probs
from jaxserve.worker.sampling_metadata import PARTIAL_SORT_WIDTH, SamplingMetadata, SamplingRow

_sample = jax.jit(sample)
_probs = jax.jit(sampling_probs)
_penalized = jax.jit(penalized_logits)
_prompt_logprobs = jax.jit(prompt_logprobs, static_argnums=2)
# One compile per static variant for the property test: the distribution and a draw from it.
_probs_and_tokens = jax.jit(
    lambda logits, md: (sampling_probs(logits, md), sample(logits, md).token_ids)
)


def row(params: SamplingParams, seed: int = 0, step: int = 0, output=(), prompt=()) -> SamplingRow:
    return SamplingRow(params, seed, step, list(output), list(prompt))


def reference_penalized(logits, params: SamplingParams, output=(), prompt=()) -> np.ndarray:
    """logit_bias, then repetition, frequency, presence penalties, in float32 like the device."""
    x = np.asarray(logits, np.float32).copy()
    for token, bias in params.logit_bias.items():
        x[token] += np.float32(bias)
    counts = np.bincount(np.asarray(output, np.int64), minlength=x.size)[: x.size]
    seen = counts > 0
    seen[np.asarray(prompt, np.int64)] = True
    rep = np.float32(params.repetition_penalty)
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x).astype(np.float32)
    x = x - np.float32(params.frequency_penalty) * counts.astype(np.float32)
    x = x - np.float32(params.presence_penalty) * (counts > 0).astype(np.float32)
    return x.astype(np.float32)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def reference_probs(logits, params: SamplingParams, output=(), prompt=(), *, margins=None):
    """Final sampling distribution of one row (float64) following the documented order.

    With ``margins`` (a list), appends the distance of every top-p / min-p decision from its
    threshold, so property tests can skip examples that float32 rounding could flip.
    """
    x = reference_penalized(logits, params, output, prompt).astype(np.float64)
    v = x.size
    if params.temperature == 0.0:
        return np.eye(v)[np.argmax(x)]
    z = x / params.temperature
    ranked = np.lexsort((np.arange(v), -z))  # probability descending, ties -> lower id
    if params.top_k > 0:
        ranked = ranked[: params.top_k]
    if params.top_p < 1.0:
        p = _softmax(z[ranked])
        mass_before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
        if margins is not None:
            margins.extend(np.abs(mass_before - params.top_p))
        ranked = ranked[: max(1, int(np.sum(mass_before < params.top_p)))]
    p = _softmax(z[ranked])
    if margins is not None and params.min_p > 0:
        margins.extend(np.abs(p / p.max() - params.min_p))
    ranked = ranked[p >= params.min_p * p.max()]
    out = np.zeros(v)
    out[ranked] = _softmax(z[ranked])
    return out


# ---------------------------------------------------------------- the shared "top-k-top-p-order" case


@pytest.mark.parametrize("logits", [[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0, 4.0]])
@pytest.mark.parametrize(
    "knobs",
    [
        dict(top_k=2, top_p=0.5, min_p=0.2),  # the shared case
        dict(top_k=3, top_p=0.8, min_p=0.2),
        dict(temperature=2.0, top_k=3, top_p=0.9, min_p=0.3),
        dict(temperature=1.5, top_p=0.9),  # full sort (no top_k)
        dict(temperature=0.7, min_p=0.1),  # min-p only
    ],
)
def test_top_k_top_p_order_matches_reference_and_draws(logits, knobs):
    params = SamplingParams(**knobs)
    expected = reference_probs(logits, params)
    n = 10_000  # one row per draw, seeds 0..n-1
    md = SamplingMetadata.from_params([row(params, seed=s) for s in range(n)], pad_to=n)
    probs, tokens = map(
        np.asarray, _probs_and_tokens(jnp.tile(jnp.asarray(logits, jnp.float32), (n, 1)), md)
    )
    np.testing.assert_allclose(probs[0], expected, atol=1e-6)
    np.testing.assert_array_equal(probs[0] > 0, expected > 0)
    counts = np.bincount(tokens, minlength=len(logits))
    sigma = np.sqrt(n * expected * (1 - expected))
    assert np.all(np.abs(counts - n * expected) <= 3 * sigma + 1e-9), (counts, n * expected)


def test_shared_case_by_hand():
    # [1, 2, 3, 4, 4], top_k=2 keeps the two 4s (0.5 each); top_p=0.5 stops after the first
    # (mass before the second = 0.5, not < 0.5), ties broken by token id -> token 3 only.
    params = SamplingParams(top_k=2, top_p=0.5, min_p=0.2)
    np.testing.assert_array_equal(reference_probs([1, 2, 3, 4, 4], params), [0, 0, 0, 1, 0])
    # [1, 2, 3, 4] with top_k=3, top_p=0.9 at temperature 2: softmax of [1, 1.5, 2] over ids 1..3.
    params = SamplingParams(temperature=2.0, top_k=3, top_p=0.9)
    e = np.exp([1.0, 1.5, 2.0])
    np.testing.assert_allclose(
        reference_probs([1, 2, 3, 4], params), [0, *(e / e.sum())], atol=1e-12
    )


def test_partial_and_full_sort_paths_agree_with_reference():
    rng = np.random.default_rng(7)
    v = 1000  # wider than PARTIAL_SORT_WIDTH
    logits = (rng.normal(size=(2, v)) * 2).astype(np.float32)
    logits[0, [10, 20, 30]] = logits[0].max() + 1  # a three-way tie at the top
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.8, min_p=0.02)
    expected = reference_probs(logits[0], params)
    partial = SamplingMetadata.from_params([row(params), row(SamplingParams())], 2)
    full = SamplingMetadata.from_params([row(params), row(SamplingParams(top_p=0.9))], 2)
    assert not partial.needs_full_sort and full.needs_full_sort
    for md in (partial, full):
        got = np.asarray(_probs(jnp.asarray(logits), md))[0]
        np.testing.assert_allclose(got, expected, atol=1e-6)
        np.testing.assert_array_equal(got > 0, expected > 0)
    assert 1 < np.count_nonzero(expected) < 50


# ---------------------------------------------------------------- penalties


def test_penalties_match_formulas():
    rng = np.random.default_rng(0)
    v = 12
    logits = rng.normal(size=(2, v)).astype(np.float32) * 3
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.5)
    output, prompt = [3, 3, 3, 5, 8], [1, 7, 8, 11]
    md = SamplingMetadata.from_params(
        [row(params, output=output, prompt=prompt), row(SamplingParams())], pad_to=2
    )
    got = np.asarray(_penalized(jnp.asarray(logits), md))
    counts = {3: 3, 5: 1, 8: 1}
    for t in range(v):
        x = float(logits[0, t])
        if t in counts or t in prompt:
            x = x / 1.5 if x > 0 else x * 1.5
        x -= 0.3 * counts.get(t, 0)  # frequency: times the count
        x -= 0.5 * (t in counts)  # presence: once
        assert got[0, t] == pytest.approx(x, rel=1e-6, abs=1e-6), t
    np.testing.assert_array_equal(got[1], logits[1])  # row without penalties
    np.testing.assert_allclose(
        got[0], reference_penalized(logits[0], params, output, prompt), rtol=1e-6
    )


def test_repetition_penalty_scales_by_sign():
    logits = jnp.asarray([[2.0, -2.0, 0.0, 1.0]])
    md = SamplingMetadata.from_params(
        [row(SamplingParams(repetition_penalty=2.0), output=[1], prompt=[0, 2])], pad_to=1
    )
    np.testing.assert_allclose(np.asarray(_penalized(logits, md))[0], [1.0, -4.0, 0.0, 1.0])


@pytest.mark.parametrize(
    "knob", [dict(presence_penalty=1.0), dict(frequency_penalty=0.5), dict(repetition_penalty=2.0)]
)
def test_penalized_greedy_pick_differs(knob):
    logits = jnp.asarray([[0.0, 1.0, 3.0, 2.5]])  # token 2 ("a") is the unpenalised argmax
    history = [2, 2, 2, 2]  # "a a a a"
    plain = SamplingMetadata.from_params([row(SamplingParams(temperature=0.0), output=history)], 1)
    assert int(_sample(logits, plain).token_ids[0]) == 2
    md = SamplingMetadata.from_params(
        [row(SamplingParams(temperature=0.0, **knob), output=history)], pad_to=1
    )
    assert md.any_penalties and md.all_greedy
    assert int(_sample(logits, md).token_ids[0]) == 3


def test_presence_counts_output_not_prompt():
    logits = jnp.asarray([[1.0, 1.0, 1.0]])
    md = SamplingMetadata.from_params(
        [row(SamplingParams(presence_penalty=1.0, frequency_penalty=1.0), output=[0], prompt=[1])],
        1,
    )
    np.testing.assert_allclose(np.asarray(_penalized(logits, md))[0], [-1.0, 1.0, 1.0])


# ---------------------------------------------------------------- greedy, temperature, bias, top-p ends


def test_greedy_is_argmax_with_ties_to_lowest_id():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 50)).astype(np.float32)
    logits[2, [7, 30]] = 10.0
    md = SamplingMetadata.from_params(
        [row(SamplingParams(temperature=0.0), seed=i) for i in range(6)], 8
    )
    assert md.all_greedy
    tokens = np.asarray(_sample(jnp.asarray(np.pad(logits, ((0, 2), (0, 0)))), md).token_ids)[:6]
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    assert tokens[2] == 7


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.9])
def test_temperature_scaling(temperature):
    logits = np.asarray([[0.5, -1.0, 2.0, 0.0, 1.0]], np.float32)
    md = SamplingMetadata.from_params([row(SamplingParams(temperature=temperature))], 1)
    assert not md.any_top_k_top_p_min_p
    np.testing.assert_allclose(
        np.asarray(_probs(jnp.asarray(logits), md))[0],
        _softmax(logits[0].astype(np.float64) / temperature),
        atol=1e-6,
    )


def test_logit_bias_applies_and_moves_greedy():
    logits = jnp.asarray([[0.0, 5.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0.0, logit_bias={0: 10.0, 3: -1.5})
    md = SamplingMetadata.from_params([row(params)], 1)
    assert md.any_logit_bias and md.logit_bias_ids.shape == (1, 8)
    np.testing.assert_allclose(np.asarray(_penalized(logits, md))[0], [10.0, 5.0, 1.0, 0.5])
    assert int(_sample(logits, md).token_ids[0]) == 0


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = jnp.asarray([[0.0, 5.0, 4.0, 1.0]])  # EOS = 1, stop token 2
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    early = SamplingMetadata.from_params([row(params, output=[3])], 1, eos_token_id=1)
    assert int(_sample(logits, early).token_ids[0]) == 3
    late = SamplingMetadata.from_params([row(params, output=[3, 3])], 1, eos_token_id=1)
    assert not late.any_logit_bias
    assert int(_sample(logits, late).token_ids[0]) == 1
    ignore = SamplingMetadata.from_params(
        [row(params.clone(ignore_eos=True), output=[3])], 1, eos_token_id=1
    )
    assert int(_sample(logits, ignore).token_ids[0]) == 1  # only the stop token is banned


def test_top_p_one_keeps_everything_even_in_full_sort_batch():
    rng = np.random.default_rng(2)
    logits = (rng.normal(size=(2, 4096)) * 6).astype(np.float32)
    # Row 1 forces the full-sort variant; row 0 (top_p=1) must still keep every token.
    md = SamplingMetadata.from_params(
        [row(SamplingParams(top_p=1.0)), row(SamplingParams(top_p=0.3))], 2
    )
    assert md.needs_full_sort
    probs = np.asarray(_probs(jnp.asarray(logits), md))
    np.testing.assert_allclose(probs[0], _softmax(logits[0].astype(np.float64)), atol=1e-6)
    assert np.all(probs[0] > 0)
    alone = SamplingMetadata.from_params([row(SamplingParams(top_p=1.0)), row(SamplingParams())], 2)
    assert not alone.any_top_k_top_p_min_p
    for step in range(5):
        a = SamplingMetadata.from_params(
            [row(SamplingParams(top_p=1.0), 9, step), row(SamplingParams())], 2
        )
        b = SamplingMetadata.from_params([row(SamplingParams(), 9, step), row(SamplingParams())], 2)
        tokens = [int(_sample(jnp.asarray(logits), md).token_ids[0]) for md in (a, b)]
        assert tokens[0] == tokens[1]


@pytest.mark.parametrize("logits", [[1.0, 4.0, 4.0, 2.0], [3.0, -1.0, 0.5, 2.9]])
def test_top_p_zero_is_greedy(logits):
    rows = [row(SamplingParams(temperature=1.5, top_p=0.0), seed=s, step=s) for s in range(64)]
    md = SamplingMetadata.from_params(rows, 64)
    tokens = np.asarray(_sample(jnp.tile(jnp.asarray(logits), (64, 1)), md).token_ids)
    assert np.all(tokens == np.argmax(logits))


# ---------------------------------------------------------------- seeds and batch invariance


def test_seeded_row_is_batch_invariant():
    rng = np.random.default_rng(3)
    v = 1000
    mine = rng.normal(size=v).astype(np.float32)
    others = rng.normal(size=(5, v)).astype(np.float32) * 4
    target = row(SamplingParams(temperature=0.9, top_k=50, top_p=0.95), seed=1234, step=7)
    extras = [
        row(SamplingParams(top_p=0.5), seed=1),  # full sort
        row(SamplingParams(temperature=0.0, presence_penalty=1.0), output=[1, 2]),  # penalties
        row(SamplingParams(logit_bias={5: 3.0}, logprobs=5)),  # bias, logprobs
        row(SamplingParams(min_p=0.3), seed=2),
        row(SamplingParams(), seed=1234, step=7),  # same seed/step, different knobs
    ]

    def token(batch_rows, logits, pad_to, at):
        md = SamplingMetadata.from_params(batch_rows, pad_to)
        padded = np.zeros((pad_to, v), np.float32)
        padded[: len(logits)] = logits
        return int(_sample(jnp.asarray(padded), md).token_ids[at])

    alone = token([target], [mine], 1, 0)  # partial sort, S = 1
    # With the others (full sort, penalties, bias, logprobs on), S = 8, in three orders.
    assert token([*extras, target], [*others, mine], 8, 5) == alone
    assert token([target, *extras[::-1]], [mine, *others[::-1]], 8, 0) == alone
    order = [2, 0, 4, 1, 3]
    assert (
        token(
            [*(extras[i] for i in order[:2]), target, *(extras[i] for i in order[2:])],
            [*(others[i] for i in order[:2]), mine, *(others[i] for i in order[2:])],
            8,
            2,
        )
        == alone
    )


def test_key_is_fold_in_of_prng_key_and_steps_differ():
    v = 500
    logits = np.zeros((1, v), np.float32)  # uniform: only the key decides
    tokens = []
    for step in range(20):
        md = SamplingMetadata.from_params([row(SamplingParams(), seed=77, step=step)], 1)
        tokens.append(int(_sample(jnp.asarray(logits), md).token_ids[0]))
        key = jax.random.fold_in(jax.random.PRNGKey(77), step)  # the row's documented key
        u = 1.0 - float(jax.random.uniform(jax.random.split(key)[1], (), jnp.float32))
        assert (
            tokens[-1] == min(int(np.floor(u * v - 1e-4)), v - 1)
            or tokens[-1] == int(np.ceil(u * v)) - 1
        )  # inverse CDF of a uniform row
    assert len(set(tokens)) > 10
    seeds = {
        int(
            _sample(
                jnp.asarray(logits),
                SamplingMetadata.from_params([row(SamplingParams(), seed=s, step=0)], 1),
            ).token_ids[0]
        )
        for s in range(20)
    }
    assert len(seeds) > 10


def test_large_and_negative_seeds():
    md = SamplingMetadata.from_params(
        [
            row(SamplingParams(), seed=2**64 - 1),
            row(SamplingParams(), seed=-1),
            row(SamplingParams(), seed=123),
        ],
        3,
    )
    np.testing.assert_array_equal(
        md.rng_key_data[0], md.rng_key_data[1]
    )  # -1 == 2**64 - 1 mod 2**64
    np.testing.assert_array_equal(md.rng_key_data[0], [0xFFFFFFFF, 0xFFFFFFFF])
    np.testing.assert_array_equal(md.rng_key_data[2], jax.random.key_data(jax.random.PRNGKey(123)))


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_sorted_and_ranked():
    rng = np.random.default_rng(4)
    v = 64
    logits = rng.normal(size=(4, v)).astype(np.float32)
    logits[1, [3, 9]] = 5.0  # a tie at the top
    rows = [
        row(SamplingParams(temperature=1.3, logprobs=3, presence_penalty=2.0), seed=1, output=[0]),
        row(SamplingParams(temperature=0.0, logprobs=2)),
        row(SamplingParams(top_k=4, logprobs=0), seed=2),
    ]
    md = SamplingMetadata.from_params(rows, 4)
    assert md.max_logprobs == 5
    out = _sample(jnp.asarray(logits), md)
    lp = out.logprobs
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    tokens = np.asarray(out.token_ids)
    top_ids, top_lp = np.asarray(lp.top_ids), np.asarray(lp.top_logprobs)
    assert top_ids.shape == (4, 5)
    for r in range(3):
        order = np.lexsort((np.arange(v), -ref[r]))
        np.testing.assert_array_equal(top_ids[r], order[:5])
        np.testing.assert_allclose(top_lp[r], ref[r, order[:5]], atol=1e-6)
        assert np.all(np.diff(top_lp[r]) <= 0)
        assert float(lp.token_logprobs[r]) == pytest.approx(ref[r, tokens[r]], abs=1e-6)
        assert int(lp.token_ranks[r]) == 1 + int(np.nonzero(order == tokens[r])[0][0])
    assert tokens[1] == 3 and int(lp.token_ranks[1]) == 1 and top_ids[1, 1] == 9


def test_logprobs_buckets_and_off():
    logits = jnp.zeros((2, 30))
    none = _sample(logits, SamplingMetadata.from_params([row(SamplingParams())], 2))
    assert none.logprobs is None
    zero = _sample(logits, SamplingMetadata.from_params([row(SamplingParams(logprobs=0))], 2))
    assert zero.logprobs.top_ids.shape == (2, 0)
    big = SamplingMetadata.from_params([row(SamplingParams(logprobs=6))], 2)
    assert big.max_logprobs == 20


def test_prompt_logprobs():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(7, 40)).astype(np.float32)
    nxt = rng.integers(0, 40, size=7).astype(np.int32)
    out = _prompt_logprobs(jnp.asarray(logits), jnp.asarray(nxt), 4)
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out.token_logprobs), ref[np.arange(7), nxt], atol=1e-5)
    chosen = ref[np.arange(7), nxt][:, None]
    np.testing.assert_array_equal(np.asarray(out.token_ranks), 1 + (ref > chosen).sum(-1))
    np.testing.assert_array_equal(
        np.asarray(out.top_ids), np.argsort(-ref, axis=-1, kind="stable")[:, :4]
    )
    np.testing.assert_allclose(
        np.asarray(out.top_logprobs), -np.sort(-ref, axis=-1)[:, :4], atol=1e-5
    )


# ---------------------------------------------------------------- padding and the builder


def test_padding_rows_are_harmless():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(3, 100)).astype(np.float32)
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=0.0, logprobs=1))]
    small = SamplingMetadata.from_params(rows, 2)
    padded = SamplingMetadata.from_params(rows, 16)
    assert padded.all_greedy and not padded.any_penalties and not padded.any_top_k_top_p_min_p
    garbage = np.full((14, 100), 3e38, np.float32)
    garbage[:, ::3] = -3e38
    a = _sample(jnp.asarray(logits[:2]), small)
    b = _sample(jnp.asarray(np.concatenate([logits[:2], garbage])), padded)
    np.testing.assert_array_equal(np.asarray(a.token_ids), np.asarray(b.token_ids)[:2])
    np.testing.assert_array_equal(
        np.asarray(a.logprobs.top_ids), np.asarray(b.logprobs.top_ids)[:2]
    )


def test_builder_flags_and_buckets():
    base = SamplingMetadata.from_params(
        [row(SamplingParams(temperature=0.0, top_p=0.1, top_k=3))], 4
    )
    assert base.all_greedy and not base.any_top_k_top_p_min_p  # greedy rows ignore filters
    assert base.output_token_ids.shape == (4, 1) and base.logit_bias_ids.shape == (4, 1)
    partial = SamplingMetadata.from_params(
        [row(SamplingParams(top_k=PARTIAL_SORT_WIDTH, top_p=0.2))], 1
    )
    assert partial.any_top_k_top_p_min_p and not partial.needs_full_sort
    full = SamplingMetadata.from_params([row(SamplingParams(top_k=PARTIAL_SORT_WIDTH + 1))], 1)
    assert full.needs_full_sort
    bias = SamplingMetadata.from_params(
        [row(SamplingParams(logit_bias={i: 1.0 for i in range(9)}))], 1
    )
    assert bias.logit_bias_ids.shape == (1, 64)
    bias = SamplingMetadata.from_params(
        [row(SamplingParams(logit_bias={i: 1.0 for i in range(301)}))], 1
    )
    assert bias.logit_bias_ids.shape == (1, 512)
    pen = SamplingMetadata.from_params(
        [
            row(SamplingParams(frequency_penalty=0.1), output=range(40), prompt=range(500)),
            row(SamplingParams(repetition_penalty=1.2), output=[1], prompt=range(20)),
        ],
        2,
    )
    assert pen.output_token_ids.shape == (2, 64)  # prompt of row 0 is not needed
    assert np.all(pen.prompt_token_ids[0] == -1) and list(pen.prompt_token_ids[1, :20]) == list(
        range(20)
    )


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(pad_to=1), "pad_to"),
        (dict(seed=1.5), "seed"),
        (dict(seed=True), "seed"),
        (dict(step=-1), "step_index"),
    ],
)
def test_builder_rejects_bad_input(bad, field):
    rows = [row(SamplingParams(), seed=bad.get("seed", 0), step=bad.get("step", 0))] * 2
    with pytest.raises(ValueError, match=field):
        SamplingMetadata.from_params(rows, bad.get("pad_to", 2))


# ---------------------------------------------------------------- property test against the reference

_V = 8


@st.composite
def _rows(draw):
    logits = [draw(st.integers(-24, 24)) / 8.0 for _ in range(_V)]  # ties are likely
    params = SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 1.7])),
        top_k=draw(st.sampled_from([0, 0, 1, 2, 3, 5, _V + 2])),
        top_p=draw(st.one_of(st.just(1.0), st.just(0.0), st.floats(0.05, 0.99))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.01, 0.9))),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 0.7, -1.1])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.4, -0.3])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3, 0.8])),
        logit_bias=draw(st.dictionaries(st.integers(0, _V - 1), st.floats(-3, 3), max_size=3)),
    )
    output = draw(st.lists(st.integers(0, _V - 1), max_size=6))
    prompt = draw(st.lists(st.integers(0, _V - 1), max_size=6))
    return logits, params, output, prompt


# The last row is always a greedy row with a penalty and a logit bias, so the penalty and bias
# flags stay on and the test compiles only the greedy / filter variants (about four).
_ANCHOR = (
    _V * [0.0],
    SamplingParams(temperature=0.0, presence_penalty=0.5, logit_bias={0: 0.25}),
    [1],
    [],
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_rows(), min_size=1, max_size=3))
def test_property_sampling_probs_match_reference(batch):
    batch = [*batch, _ANCHOR]
    expected, margins = [], []
    for logits, params, output, prompt in batch:
        expected.append(reference_probs(logits, params, output, prompt, margins=margins))
        z = np.unique(reference_penalized(logits, params, output, prompt))
        if params.temperature > 0 and z.size > 1:
            margins.append(np.min(np.diff(z)) / params.temperature)
    assume(not margins or min(margins) > 1e-4)  # no decision within float32 rounding
    md = SamplingMetadata.from_params(
        [row(p, output=o, prompt=q) for _, p, o, q in batch], pad_to=4
    )
    logits = np.zeros((4, _V), np.float32)
    logits[: len(batch)] = [b[0] for b in batch]
    got, tokens = map(np.asarray, _probs_and_tokens(jnp.asarray(logits), md))
    for r, exp in enumerate(expected):
        np.testing.assert_allclose(got[r], exp, atol=1e-6)
        np.testing.assert_array_equal(got[r] > 0, exp > 0)
        assert exp[tokens[r]] > 0  # never draws a filtered token


def _pack(allowed: np.ndarray) -> np.ndarray:
    """bool [S, V] -> int32 [S, ceil(V / 32)] (bit t % 32 of word t // 32)."""
    s, v = allowed.shape
    padded = np.zeros((s, -(-v // 32) * 32), np.bool_)
    padded[:, :v] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32)


def test_token_bitmask_only_allowed_tokens_are_drawn_and_unmasked_rows_untouched():
    from jaxserve.worker.sampler import allowed_tokens

    rng = np.random.default_rng(0)
    v, s = 100, 4
    allowed = rng.random((s, v)) < 0.1
    allowed[:, 99] = True  # the last, partial word's top bit
    allowed[3] = True  # an unmasked row
    bitmask = _pack(allowed)
    np.testing.assert_array_equal(np.asarray(allowed_tokens(jnp.asarray(bitmask), v)), allowed)
    logits = jnp.asarray(rng.normal(size=(s, v)) * 3, jnp.float32)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0), 0, 0, (), ()),
        SamplingRow(SamplingParams(temperature=1.0), 1, 0, (), ()),
        SamplingRow(SamplingParams(temperature=1.0, top_k=5, top_p=0.9), 2, 0, (), ()),
        SamplingRow(SamplingParams(temperature=0.0), 3, 0, (), ()),
    ]
    md = SamplingMetadata.from_params(rows, pad_to=s, token_bitmask=bitmask)
    assert md.any_token_mask
    probs = np.asarray(sampling_probs(logits, md))
    assert np.all(probs[:3][~allowed[:3]] == 0)
    masked = np.where(allowed[0], np.asarray(logits[0]), -np.inf)
    for step in range(20):
        out = sample(logits, dataclasses.replace(md, step_index=np.full(s, step, np.int32)))
        tokens = np.asarray(out.token_ids)
        assert all(allowed[i, tokens[i]] for i in range(3))
        assert tokens[0] == int(np.argmax(masked))
        assert tokens[3] == int(np.argmax(np.asarray(logits[3])))
    plain = SamplingMetadata.from_params(rows, pad_to=s)
    assert not plain.any_token_mask and plain.token_bitmask.shape == (s, 1)
