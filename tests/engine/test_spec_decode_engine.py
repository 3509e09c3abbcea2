"""Speculative decoding (n-gram) end to end: outputs identical with speculation on and off across
the engine matrix (async and synchronous loops, chunked prefill, prefix caching off, preemption;
stop strings and ids, max_tokens inside a draft, n > 1, logprobs, seeded sampling with filters,
logit_bias, and the requests that fall back to one token per step: penalties, bad_words), no KV
block leaked, drafts counted in the stats and the ledgers."""

from __future__ import annotations

import math

import pytest

from jaxserve.config import SpeculativeConfig
from jaxserve.sampling_params import SamplingParams

NGRAM = SpeculativeConfig(
    method="ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1
)
COPY_TEXTS = (
    "one two three four five six seven eight nine ten. one two three four five six seven",
    "And God said, Let there be light: and there was light. And God saw the light",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
)
MAX_TOKENS = 24


def _greedy_requests(base, prompts, stops: tuple[int, str] | None = None) -> list:
    """Copy-heavy texts and random-token prompts, greedy, with max_tokens ending inside a
    draft; with ``stops`` (a stop id and a stop string that occur mid-output), two requests that
    stop on them."""
    tok = base.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reqs = [(f"copy{i}", tok.encode(t), greedy) for i, t in enumerate(COPY_TEXTS)]
    reqs += [(f"rand{i}", prompts[i], greedy) for i in (3, 9, 13)]
    text = tok.encode(COPY_TEXTS[0])
    reqs += [(f"max{n}", text, greedy.clone(max_tokens=n)) for n in (1, 3, 6)]  # K = 4
    if stops is not None:
        stop_id, stop_str = stops
        other = tok.encode(COPY_TEXTS[1])
        reqs.append(("stop_id", other, greedy.clone(stop_token_ids=[stop_id])))
        reqs.append(("stop_str", other, greedy.clone(stop=[stop_str])))
    return reqs


def _feature_requests(base) -> list:
    """One request per sampling feature on a copy-heavy prompt: logprobs, seeded sampling with
    top-k / top-p / min-p, n > 1, logit_bias, min_tokens, and the two that fall back to one
    token per step (a penalty, bad_words)."""
    tok = base.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    features = {
        "logprobs": greedy.clone(logprobs=3),
        "seeded": SamplingParams(
            temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7, max_tokens=MAX_TOKENS
        ),
        "n2": SamplingParams(temperature=1.0, n=2, seed=11, max_tokens=MAX_TOKENS),
        "bias": greedy.clone(logit_bias={tok.encode(" two")[-1]: 3.0}),
        "min_tokens": greedy.clone(min_tokens=5, ignore_eos=False),
        "penalty": greedy.clone(repetition_penalty=1.3),
        "bad_words": greedy.clone(bad_words=["three"]),
    }
    text = tok.encode(COPY_TEXTS[0])
    return [(name, text, params) for name, params in features.items()]


def _outputs(done) -> dict:
    return {
        rid: [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]
        for rid, out in done.items()
    }


@pytest.fixture(scope="module")
def baseline(base, make_engine, run, prompts):
    """(greedy requests, features requests, their outputs without speculation)."""
    probe = run(make_engine(), [("probe", *_greedy_requests(base, prompts)[1][1:])])
    out = probe["probe"].outputs[0]
    stops = (out.token_ids[MAX_TOKENS // 2], out.text[len(out.text) // 2 :][:4])
    greedy = _greedy_requests(base, prompts, stops)
    features = _feature_requests(base)
    return greedy, features, run(make_engine(), greedy + features)


def _assert_drained(engine):
    kv = engine.scheduler.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_gpu_blocks - 1 and not kv.req_to_blocks


def _check(engine, got, want) -> dict:
    """Same outputs as without speculation, drained, drafts counted; returns the ledgers."""
    assert _outputs(got) == {rid: _outputs(want)[rid] for rid in got}
    _assert_drained(engine)
    stats = engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens_total > 0
    assert 0 < stats.spec_decode_num_drafts_total <= stats.spec_decode_num_draft_tokens_total
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos_total) == (
        stats.spec_decode_num_accepted_tokens_total
    )
    ledgers = {rid: led for rid, out in got.items() for led in out.ledgers}
    assert sum(led.num_accepted_tokens for led in ledgers.values()) == (
        stats.spec_decode_num_accepted_tokens_total
    )
    return ledgers


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_sampling_features_identical_with_speculation(make_engine, run, baseline, async_scheduling):
    greedy, features, want = baseline
    engine = make_engine(speculative=NGRAM, async_scheduling=async_scheduling)
    got = run(engine, greedy + features)
    ledgers = _check(engine, got, want)
    for a, b in zip(got["logprobs"].outputs[0].logprobs, want["logprobs"].outputs[0].logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert math.isclose(a[t].logprob, b[t].logprob, rel_tol=1e-4, abs_tol=1e-4)
    for rid in ("penalty", "bad_words"):  # one token per step: never a draft
        assert ledgers[rid].num_drafts == 0, rid
    assert ledgers["seeded"].num_drafts > 0 and ledgers["logprobs"].num_accepted_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "knobs",
    [
        {"max_num_batched_tokens": 32, "long_prefill_token_threshold": 16},
        {"enable_prefix_caching": False},
        {"num_gpu_blocks": 24},  # preemptions
    ],
    ids=["chunked", "no-prefix-cache", "preempt"],
)
def test_greedy_identical_with_speculation(make_engine, run, baseline, knobs):
    greedy, _, want = baseline
    engine = make_engine(speculative=NGRAM, **knobs)
    _check(engine, run(engine, greedy), want)
    if "num_gpu_blocks" in knobs:
        assert engine.get_stats().num_preemptions_total > 0


def test_small_verification_steps_read_the_lm_head_once(
    base, make_engine, run, baseline, monkeypatch
):
    """A verification step in a small bucket (``ModelRunner.one_head_buckets``) runs the
    forward without its head, then one head pass over the sampled and the verified rows
    (``verify_logits_step``), never the drafts' second pass (``spec_logits_step``); its
    outputs are those of the non-speculative engine."""
    from jaxserve.worker import model_runner

    calls = {"one": 0, "again": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(
        model_runner, "verify_logits_step", counting("one", model_runner.verify_logits_step)
    )
    monkeypatch.setattr(
        model_runner, "spec_logits_step", counting("again", model_runner.spec_logits_step)
    )
    greedy, _, want = baseline
    engine = make_engine(speculative=NGRAM)
    assert base.runner.one_head_buckets == {16}  # the first bucket holding 1 + K tokens
    got = run(engine, greedy[:3])  # the copy prompts: drafts, verification steps <= 15 tokens
    _check(engine, got, want)
    assert calls["one"] > 0 and calls["again"] == 0, calls


def test_prompt_logprobs_beside_a_one_head_verification(
    base, make_engine, run, baseline, monkeypatch
):
    """A prompt scored (``prompt_logprobs``) in the same small step as a verification: the
    one-head forward's hidden states feed the prompt scoring (its jitted function, not the
    executable compiled for ``forward_step``'s hidden states), which gives what it gives
    without speculation."""
    from jaxserve.worker import model_runner

    jitted = {"calls": 0}
    real = model_runner.prompt_logprobs_step

    def counted(*args, **kwargs):
        jitted["calls"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(model_runner, "prompt_logprobs_step", counted)
    greedy, _, want = baseline
    tok = base.tokenizer
    scored = (
        "scored",
        tok.encode("The king said"),
        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2),
    )
    plain = make_engine()
    ref = run(plain, [scored])["scored"]
    # the synchronous loop: an async step would dispatch the prefill while copy0 waits for
    # its step in flight (its drafts), so the two would not share a step
    engine = make_engine(speculative=NGRAM, async_scheduling=False)
    engine.add_request(*greedy[0])  # copy0: drafts from its first decoded tokens on
    done, added = {}, []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        drafting = engine.get_stats().spec_decode_num_drafts_total > 0
        if drafting and jitted["calls"] == 0 and len(added) < 12 and "copy0" not in done:
            # a prompt to score each step until one prefills beside a verification (copy0
            # has no drafts on some steps: the proposer finds no match)
            rid = f"scored{len(added)}"
            engine.add_request(rid, *scored[1:])
            added.append(rid)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert jitted["calls"] > 0  # a step held both (every bucket's executable is warm)
    assert set(done) == {"copy0", *added}
    assert _outputs({"copy0": done["copy0"]}) == {"copy0": _outputs(want)["copy0"]}
    for rid in added:
        got = done[rid]
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(got.prompt_logprobs) == len(ref.prompt_logprobs)
        for a, b in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            for t in a:
                assert math.isclose(a[t].logprob, b[t].logprob, rel_tol=1e-4, abs_tol=1e-4)
    _assert_drained(engine)


def test_batch1_speculation_overlaps_the_next_step(base, make_engine, run, baseline):
    """Async scheduling, one speculating request: each engine step collects and updates the
    step in flight, dispatches the next (its drafts known), and makes the outputs while that
    one runs: one engine step per device step, never an empty step between."""
    greedy, _, want = baseline
    engine = make_engine(speculative=NGRAM, async_scheduling=True)
    timing = base.runner.timing
    device0 = timing.num_steps
    calls = overlapped = 0
    process = engine.output_processor.process_outputs

    def counted(core_outputs, *args):
        nonlocal overlapped
        if core_outputs and engine._in_flight is not None and engine._in_flight[1] is not None:
            overlapped += 1  # the next step is on the device while these outputs are made
        return process(core_outputs, *args)

    engine.output_processor.process_outputs = counted
    step = engine.step

    def counted_step():
        nonlocal calls
        calls += 1
        return step()

    engine.step = counted_step
    got = run(engine, [greedy[0]])  # copy0: drafts accepted
    _check(engine, got, want)
    device_steps = timing.num_steps - device0
    # the prefill step, then one call per device step (plus the last call that collects)
    assert calls <= device_steps + 2, (calls, device_steps)
    assert engine.num_early_updates >= device_steps - 2
    assert overlapped >= device_steps - 2
