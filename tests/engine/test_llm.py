"""The offline API: ``from jaxserve import LLM, SamplingParams``; ``LLM.generate`` end to end
(model directory -> loaded engine -> outputs in input order) and its input checks."""

from __future__ import annotations

import pytest
from conftest import MAX_TOKENS, XLA_CACHE_DIR
from engine_testing import BUNDLED, bundled_weights_exist


@pytest.fixture(scope="module")
def llm(model_dir):
    from jaxserve import LLM

    # warmup=False: buckets compile on first use (from the persistent cache the runner fixture
    # filled); warm-up itself is covered by the shared runner.
    return LLM(
        model_dir,
        dtype="float32",
        attention_backend="xla",
        token_buckets="16,32,64,128",
        max_num_batched_tokens=128,
        max_model_len=256,
        compilation_cache_dir=XLA_CACHE_DIR,
        warmup=False,
    )


def test_generate_returns_outputs_in_input_order(llm, prompts, oracle):
    from jaxserve import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    order = [7, 0, 13, 2, 9]
    outs = llm.generate([prompts[i] for i in order], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [oracle[i] for i in order]
    assert [o.prompt_token_ids for o in outs] == [prompts[i] for i in order]
    assert all(o.finished and o.prompt is None for o in outs)


def test_generate_text_prompts_and_per_prompt_params(llm):
    from jaxserve import SamplingParams

    tok = llm.get_tokenizer()
    texts = ["Once upon a time", "The quick brown fox jumps over"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    ]
    outs = llm.generate(texts, params, use_tqdm=True)
    assert [o.prompt for o in outs] == texts
    assert [o.prompt_token_ids for o in outs] == [tok.encode(t) for t in texts]
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    full = tok.decode(outs[1].prompt_token_ids + outs[1].outputs[0].token_ids)
    assert outs[1].outputs[0].text == full[len(tok.decode(outs[1].prompt_token_ids)) :]
    single = llm.generate(texts[0], params[0], use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_generate_rejects_bad_input_and_leaves_nothing_queued(llm):
    from jaxserve import SamplingParams

    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt"):
        llm.generate([[1, 2, 3], []], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a"], {"temperature": 0.0}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        llm.generate([3.5], use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache_usage == 0.0


def test_unknown_engine_argument_is_named():
    from jaxserve import LLM

    with pytest.raises(ValueError, match="max_num_seq\\b"):
        LLM(max_num_seq=4)


@pytest.mark.skipif(
    not bundled_weights_exist(), reason="the bundled checkpoint's weights are not there yet"
)
def test_llm_without_model_serves_the_bundled_checkpoint():
    from jaxserve import LLM, SamplingParams

    llm = LLM(
        max_model_len=128,
        max_num_batched_tokens=64,
        token_buckets="16,32,64",
        max_num_seqs=4,
        compilation_cache_dir=XLA_CACHE_DIR,
        warmup=False,
    )
    assert llm.engine_args.resolved_model_path() == BUNDLED
    out = llm.generate(
        "Once upon a time", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False
    )
    assert out[0].outputs[0].finish_reason in ("stop", "length") and out[0].outputs[0].token_ids
