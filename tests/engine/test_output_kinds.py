"""Output kinds and the stream interval (#34): DELTA outputs hold only what is new (no copies of
the whole text, token ids or logprobs) and add up to the CUMULATIVE outputs of the same request;
``stream_interval`` N buffers N tokens per output, the first token and the final output are
never held back."""

from __future__ import annotations

import pytest

from jaxserve.engine.async_llm import merge_outputs
from jaxserve.request_output import CompletionOutput, RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

PARAMS = dict(temperature=0.0, max_tokens=10, ignore_eos=True, n=2, logprobs=2, prompt_logprobs=1)


def run_all(engine, requests):
    """Adds ``requests`` [(id, prompt, params)] and steps until all finish; every output by id."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def joined(outs, k, field):
    """A sample's field joined over outputs (strings concatenated, lists chained)."""
    parts = [getattr(o.outputs[k], field) for o in outs]
    return "".join(parts) if isinstance(parts[0], str) else [x for p in parts for x in (p or [])]


@pytest.mark.parametrize("interval", [1, 4])
def test_delta_outputs_add_up_to_the_cumulative_ones(make_engine, prompts, interval):
    engine = make_engine(long_prefill_token_threshold=16, stream_interval=interval)
    kinds = {k.name: SamplingParams(**PARAMS, output_kind=k) for k in RequestOutputKind}
    outs = run_all(engine, [(name, prompts[5], p) for name, p in kinds.items()])
    cum, delta, final = outs["CUMULATIVE"], outs["DELTA"], outs["FINAL_ONLY"]
    assert len(final) == 1 and final[0].finished
    last = cum[-1]
    assert last.finished and delta[-1].finished and not any(o.finished for o in delta[:-1])
    for k in range(2):
        whole = last.outputs[k]
        assert len(whole.token_ids) == 10 and final[0].outputs[k].token_ids == whole.token_ids
        assert joined(delta, k, "token_ids") == whole.token_ids == joined(cum, k, "delta_token_ids")
        assert joined(delta, k, "text") == whole.text == joined(cum, k, "delta_text")
        assert joined(delta, k, "logprobs") == whole.logprobs
        for o in delta:  # nothing copied: the output's lists are its deltas
            c = o.outputs[k]
            assert c.token_ids is c.delta_token_ids and c.text == c.delta_text
    assert delta[0].outputs[0].token_ids, "a DELTA stream starts with its first token"
    assert all(o.prompt_logprobs == last.prompt_logprobs for o in delta)
    # one output per token at interval 1; else the first token, then 4 at a time, then the rest
    sizes = [max(len(c.token_ids) for c in o.outputs) for o in delta]
    assert sizes == ([1] * 10 if interval == 1 else [1, 4, 4, 1])
    if interval > 1:
        assert [max(len(c.delta_token_ids) for c in o.outputs) for o in cum] == sizes


def test_final_output_is_never_held_back(make_engine, prompts):
    # samples that stop early (stop token ids) under a long interval: each finish goes out at once
    engine = make_engine(stream_interval=64)
    first = run_all(engine, [("probe", prompts[3], SamplingParams(temperature=0.0, max_tokens=3))])
    stop = first["probe"][-1].outputs[0].token_ids[1]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        stop_token_ids=[stop],
        output_kind=RequestOutputKind.DELTA,
    )
    outs = run_all(engine, [("d", prompts[3], params)])["d"]
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 1]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"


def test_unread_delta_outputs_merge_by_joining():
    def out(text, ids, lps):
        c = CompletionOutput(0, text, ids, None, lps, None, None, text, ids, lps)
        return RequestOutput("r", None, [1], None, [c], False)

    older, newer = out("a", [1], [{1: None}]), out("b", [2], [{2: None}])
    merged = merge_outputs(older, newer, delta=True).outputs[0]
    assert (merged.text, merged.token_ids, merged.logprobs) == (
        "ab",
        [1, 2],
        [{1: None}, {2: None}],
    )
    assert merged.delta_token_ids == [1, 2]


def test_bad_output_kind_and_stream_interval_are_refused():
    from jaxserve.config import SchedulerConfig

    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)
    with pytest.raises(ValueError, match="stream_interval"):
        SchedulerConfig(stream_interval=0)
