"""Async scheduling is exact: every output equals the synchronous loop's, whatever happens while a
step is in flight (chunked prefill, prefix hits, preemption storms, n > 1, stop strings, max_tokens
1, seeded sampling, aborts), and every KV block comes back."""

from __future__ import annotations

import pytest

from jaxserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _run_both(make_engine, run, requests, **knobs):
    """Final outputs {id: (token ids, text, finish_reason)} with async on and off, plus the
    engines (to check their pools)."""
    results, engines = [], []
    for on in (True, False):
        engine = make_engine(async_scheduling=on, **knobs)
        done = run(engine, requests)
        results.append(
            {
                rid: [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]
                for rid, out in done.items()
            }
        )
        engines.append(engine)
    return results, engines


def _assert_idle(engine):
    kv = engine.scheduler.kv_cache_manager
    assert kv.usage == 0.0, "KV blocks leaked"
    assert not engine.scheduler.requests


def test_greedy_equal_under_chunked_prefill_and_prefix_hits(make_engine, run, prompts, oracle):
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    (on, off), engines = _run_both(
        make_engine, run, requests, max_num_batched_tokens=64, long_prefill_token_threshold=24
    )
    assert on == off
    for i in range(len(prompts)):  # the oracle stops at EOS; these requests ignore it
        assert list(on[f"r{i}"][0][0])[: len(oracle[i])] == oracle[i]
    for e in engines:
        _assert_idle(e)


def test_equal_under_a_preemption_storm(make_engine, run, prompts):
    """A pool far too small for the batch: requests are preempted (some while a token of theirs
    is in flight) and recomputed; outputs still equal the synchronous loop's."""
    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    (on, off), engines = _run_both(
        make_engine, run, requests, num_gpu_blocks=40, long_prefill_token_threshold=64
    )
    assert on == off
    assert engines[0].get_stats().num_preemptions_total > 0
    for e in engines:
        _assert_idle(e)


def test_seeded_sampling_n2_penalties_and_stops_equal(make_engine, run, prompts):
    params = [
        SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.8, seed=3, max_tokens=9),
        SamplingParams(temperature=0.8, seed=5, presence_penalty=1.0, max_tokens=8),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=0),
    ]
    requests = [(f"r{i}", prompts[i % 8], params[i % len(params)]) for i in range(18)]
    (on, off), engines = _run_both(make_engine, run, requests, num_gpu_blocks=40)
    assert on == off
    assert all(len(toks) == 1 for toks, _, _ in on["r3"])  # max_tokens 1: exactly one token
    for e in engines:
        _assert_idle(e)


def test_stop_string_and_eos_end_exactly(base, make_engine, run):
    """A stop string found in step N's text ends the request although step N+1 already holds it:
    no token after the stop is emitted."""
    text_prompt = base.tokenizer.encode("Once upon a time")
    ref = run(make_engine(async_scheduling=False), [("x", text_prompt, GREEDY)])["x"].outputs[0]
    stop = ref.text[len(ref.text) // 2 : len(ref.text) // 2 + 3]
    if not stop.strip():
        pytest.skip("the bundled model's text has no usable stop string here")
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=[stop])
    (on, off), engines = _run_both(make_engine, run, [("s", text_prompt, params)])
    assert on == off
    assert on["s"][0][2] == "stop"
    for e in engines:
        _assert_idle(e)


def test_abort_while_a_step_is_in_flight(make_engine, prompts):
    engine = make_engine(async_scheduling=True)
    for i in range(6):
        engine.add_request(f"a{i}", prompts[i + 8], GREEDY)
    engine.step()  # step 1 dispatched, nothing collected yet
    engine.step()  # step 2 dispatched, step 1 collected
    engine.abort_request(["a0", "a3"])
    seen = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.add(out.request_id)
    assert not {"a0", "a3"} & seen
    engine.step()  # collects the last step still in flight
    _assert_idle(engine)


def test_outputs_lag_one_step_and_no_step_is_lost(make_engine, prompts):
    """The first step returns nothing (its tokens are still on the device); every token of every
    request still arrives, in order."""
    engine = make_engine(async_scheduling=True)
    engine.add_request("q", prompts[3], SamplingParams(temperature=0.0, max_tokens=5))
    assert engine.step() == []
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    ref_engine = make_engine(async_scheduling=False)
    ref_engine.add_request("q", prompts[3], SamplingParams(temperature=0.0, max_tokens=5))
    ref = []
    while ref_engine.has_unfinished_requests():
        for out in ref_engine.step():
            ref = out.outputs[0].token_ids
    assert list(tokens) == list(ref)


def test_a_block_completed_by_the_last_computed_token_stays_cached(make_engine, run):
    """A 20-token prompt with 13 output tokens: the step that samples the last token computes
    position 31, filling block 2 with a token that was still in flight when it was scheduled.
    The follow-up turn (prompt + 12 outputs + more) hits both blocks, as without async."""
    prompt = list(range(100, 120))
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    hits = []
    for on in (True, False):
        engine = make_engine(async_scheduling=on)
        first = run(engine, [("a", prompt, params)])["a"].outputs[0].token_ids
        turn = prompt + list(first[:12]) + [7, 8, 9]
        hits.append(run(engine, [("b", turn, GREEDY)])["b"].num_cached_tokens)
        _assert_idle(engine)
    assert hits == [32, 32]
