"""LLMEngine behaviour beyond greedy parity: validation, prompt-only (echo) requests, prompt and
sample logprobs, n > 1 fan-out, stop strings, aborts, stats, and no compiles while serving."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
import pytest
from conftest import MAX_TOKENS
from flax import nnx

from jaxserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@functools.cache
def _dense_fn(graphdef):
    return jax.jit(
        lambda state, ids: jax.nn.log_softmax(
            nnx.merge(graphdef, state).forward_dense(ids), axis=-1
        )
    )


def _dense_logprobs(base, ids):
    """log_softmax of the dense forward, float32 ``[len(ids), vocab]`` (numpy)."""
    graphdef, state = nnx.split(base.model)
    return np.asarray(_dense_fn(graphdef)(state, np.asarray([ids], np.int32))[0])


def _assert_drained(engine):
    stats = engine.get_stats()
    assert not engine.has_unfinished_requests()
    assert (
        stats.kv_cache_usage == 0.0 and stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    )


@pytest.mark.parametrize("threshold", [16, 4096])
def test_echo_prompt_only_request_returns_prompt_logprobs(
    base, make_engine, run, prompts, threshold
):
    """Shared case "echo-max-tokens-0": max_tokens=0 scores the prompt and generates nothing; with
    a threshold of 16 the prompt logprobs are gathered over several chunks."""
    prompt = prompts[13]  # 130 tokens
    engine = make_engine(long_prefill_token_threshold=threshold)
    params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=3)
    out = run(engine, [("echo", prompt, params)])["echo"]
    comp = out.outputs[0]
    assert comp.token_ids == [] and comp.text == "" and comp.finish_reason == "length"
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    ref = _dense_logprobs(base, prompt)
    for pos in range(1, len(prompt)):
        entry = plp[pos]
        tok = prompt[pos]
        assert tok in entry and len(entry) <= 4
        np.testing.assert_allclose(entry[tok].logprob, ref[pos - 1, tok], atol=2e-4)
        assert entry[tok].rank == 1 + int(np.sum(ref[pos - 1] > ref[pos - 1, tok]))
        top = np.argsort(-ref[pos - 1], kind="stable")[:3].tolist()
        assert set(entry) == {tok, *top}
        for t in top:
            np.testing.assert_allclose(entry[t].logprob, ref[pos - 1, t], atol=2e-4)
    _assert_drained(engine)


def test_prompt_logprobs_and_sample_logprobs_with_generation(base, make_engine, run, prompts):
    prompt = prompts[9]
    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=0)
    out = run(engine, [("lp", prompt, params)])["lp"]
    comp = out.outputs[0]
    assert len(comp.token_ids) == 4 and len(comp.logprobs) == 4
    full = _dense_logprobs(base, prompt + comp.token_ids)
    total = 0.0
    for j, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        pos = len(prompt) - 1 + j
        assert entry[tok].rank == 1  # greedy picks the most likely
        np.testing.assert_allclose(entry[tok].logprob, full[pos, tok], atol=2e-4)
        assert len(entry) <= 3 and entry[tok].decoded_token is not None
        total += entry[tok].logprob
    assert math.isclose(comp.cumulative_logprob, total, rel_tol=1e-6)
    assert len(out.prompt_logprobs) == len(prompt)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # only the actual token


def test_logprob_tokens_join_into_the_output_text(make_engine, run):
    """Each sampled token's decoded text keeps its word-boundary space, so the completion's
    logprob tokens concatenate to exactly its text (OpenAI's ``tokens`` / ``text_offset``)."""
    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    comp = run(engine, [("join", "The king said", params)])["join"].outputs[0]
    pieces = [entry[tok].decoded_token for tok, entry in zip(comp.token_ids, comp.logprobs)]
    assert "".join(pieces) == comp.text
    assert any(p.startswith(" ") for p in pieces)


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], GREEDY, "prompt: the prompt is empty"),
        ([1] * 300, GREEDY, "prompt: the prompt has 300 tokens, more than max_model_len .256."),
        ([1, 5000], GREEDY, "prompt: token id 5000"),
        ([1, -1], GREEDY, "prompt: token id -1"),
        ([1, 2.5], GREEDY, "prompt must be"),
        ([1, 7], SamplingParams(logit_bias={99999: 1.0}), "logit_bias token id 99999"),
        ([1, 7], SamplingParams(stop_token_ids=[4096]), "stop_token_ids token id 4096"),
        ([1, 7], {"temperature": 0.0}, "sampling_params"),
    ],
)
def test_bad_requests_raise_and_engine_keeps_serving(
    make_engine, run, prompts, oracle, prompt, params, match
):
    engine = make_engine()
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    done = run(
        engine, [("ok", prompts[5], GREEDY), ("bad", prompts[6], GREEDY)]
    )  # the id is free again
    assert done["ok"].outputs[0].token_ids == oracle[5]
    assert done["bad"].outputs[0].token_ids == oracle[6]
    _assert_drained(engine)


def test_duplicate_request_id_and_kv_capacity_are_rejected(make_engine, prompts):
    engine = make_engine(num_gpu_blocks=5)  # 64 tokens of KV
    engine.add_request("a", prompts[1], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", prompts[1], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("big", prompts[10], SamplingParams(max_tokens=100, n=2))
    assert engine.get_num_unfinished_requests() == 1
    assert "big-0" not in engine.scheduler.requests and "big-1" not in engine.scheduler.requests
    engine.abort_request("a")
    _assert_drained(engine)


def test_max_tokens_is_clamped_to_max_model_len(make_engine, run, prompts):
    engine = make_engine()
    prompt = (prompts[14] + prompts[13])[:250]  # max_model_len 256
    out = run(
        engine,
        [("long", prompt, SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))],
    )["long"]
    assert len(out.outputs[0].token_ids) == 256 - len(prompt)
    assert out.outputs[0].finish_reason == "length"


def test_n_fans_out_with_seeds_and_shares_the_prompt_blocks(make_engine, run, prompts):
    prompt = prompts[12]  # 101 tokens = 6 full blocks
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine = make_engine()
    out = run(engine, [("fan", prompt, params)])["fan"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 6 for c in out.outputs)
    assert engine.get_stats().prefix_cache_hits_total >= 2 * 6 * 16  # children 1, 2 hit 6 blocks
    for k in range(3):
        single = SamplingParams(temperature=1.0, seed=7 + k, max_tokens=6, ignore_eos=True)
        alone = run(engine, [(f"one{k}", prompt, single)])[f"one{k}"]
        assert alone.outputs[0].token_ids == out.outputs[k].token_ids
    _assert_drained(engine)


def test_streaming_deltas_add_up_to_the_final_output(make_engine, prompts):
    engine = make_engine(long_prefill_token_threshold=16)
    engine.add_request(
        "s", prompts[11], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)
    )
    seen = [[], []]
    texts = ["", ""]
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
            for c in out.outputs:
                seen[c.index] += c.delta_token_ids
                texts[c.index] += c.delta_text
    assert last.finished and last.metrics.finished_time is not None
    m = last.metrics
    assert (
        m.arrival_time
        <= m.first_scheduled_time
        <= m.first_token_time
        <= m.last_token_time
        <= m.finished_time
    )
    assert m.time_in_queue >= 0 and m.num_generation_tokens == 16
    for c in last.outputs:
        assert seen[c.index] == c.token_ids and texts[c.index] == c.text


def test_stop_string_finishes_the_request_and_frees_its_blocks(base, make_engine, run, prompts):
    engine = make_engine()
    free = run(
        engine, [("f", prompts[8], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))]
    )["f"]
    text = free.outputs[0].text
    tok = base.tokenizer
    # a stop string in the middle of the text: the text of tokens 3..4
    stop = tok.decode(free.outputs[0].token_ids[:5])[
        len(tok.decode(free.outputs[0].token_ids[:3])) :
    ].strip()
    assert stop and stop in text
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=[stop])
    out = run(engine, [("s", prompts[8], params)])["s"]
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.text == text[: text.index(stop)]
    assert len(comp.token_ids) < 10
    _assert_drained(engine)


def test_abort_frees_blocks_and_produces_no_output(make_engine, prompts):
    engine = make_engine()
    engine.add_request("a", prompts[12], GREEDY)
    engine.add_request("b", prompts[13], SamplingParams(n=2, max_tokens=5))
    engine.step()
    assert engine.get_stats().kv_cache_usage > 0
    engine.abort_request(["a", "b", "unknown"])
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    _assert_drained(engine)


def test_stats_count_tokens_and_requests(make_engine, run, prompts):
    engine = make_engine()
    done = run(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts[:6])])
    st = engine.get_stats()
    assert st.num_finished_reqs_total == 6
    assert st.num_generation_tokens_total == sum(len(o.outputs[0].token_ids) for o in done.values())
    assert st.num_prompt_tokens_total == sum(len(p) for p in prompts[:6])
    assert st.num_scheduled_tokens_total >= st.num_prompt_tokens_total
    assert st.num_steps_total > 0 and st.runner_device_s > 0 and st.schedule_s > 0


def test_serving_after_warmup_compiles_nothing(base, make_engine, run, prompts):
    """Every token bucket and the everyday sampler variants were compiled at warm-up; serving
    greedy and sampled requests of every size adds no executable."""
    runner = base.runner
    before = runner.compile_counts()
    assert before["forward"] == len(runner.token_buckets)
    engine = make_engine(long_prefill_token_threshold=64)
    reqs = [(f"g{i}", p, GREEDY) for i, p in enumerate(prompts)]
    reqs += [
        (f"s{i}", p, SamplingParams(temperature=1.0, max_tokens=4))
        for i, p in enumerate(prompts[:8])
    ]
    run(engine, reqs)
    assert runner.compile_counts() == before


def test_engine_without_tokenizer_serves_token_ids_only(base, prompts, oracle):
    """A dummy-weights preset has no tokenizer: token-id prompts work (empty texts), text prompts
    and stop strings are refused with the field named."""
    from jaxserve.engine.llm_engine import LLMEngine

    base.runner.reset_requests()
    engine = LLMEngine(base.config, base.runner, base.arch, None, {})
    with pytest.raises(ValueError, match="prompt: this model has no tokenizer"):
        engine.add_request("t", "hello", GREEDY)
    with pytest.raises(ValueError, match="stop"):
        engine.add_request("t", prompts[0], SamplingParams(stop=["x"]))
    engine.add_request("t", prompts[4], GREEDY)
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].outputs[0].token_ids == oracle[4] and outs[0].outputs[0].text == ""
