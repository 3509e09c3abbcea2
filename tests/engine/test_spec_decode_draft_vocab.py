"""A draft model with a reduced LM head (``draft_vocab_size`` + ``d2t``, EAGLE-3's convention):
the bundled draft cut to the tokens its own greedy drafts use most, loaded beside the bundled
model; greedy outputs equal the oracle's, its drafts are mapped to the target's ids (accepted as
often as the full head's), and malformed checkpoints are refused in one line."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from engine_testing import BUNDLED, engine_args

from jaxserve.sampling_params import SamplingParams

DRAFT = os.fspath(BUNDLED) + "-draft"
TEXTS = ("Once upon a time", "The king said unto them", "And God said")
MAX_TOKENS = 24
HEAD = 1024  # of the 4,096-token vocabulary


def draft_args(draft_dir: str):
    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}
    return engine_args(
        os.fspath(BUNDLED),
        "",
        token_buckets="16,64",
        max_num_batched_tokens=64,
        max_num_seqs=4,
        num_gpu_blocks_override=64,
        warmup=False,
        speculative_config=json.dumps(spec),
    )


def write_reduced_draft(out: str, keep: np.ndarray, d2t: np.ndarray | None, **config) -> str:
    """The bundled draft with its tied head replaced by the rows ``keep`` (sorted target ids)."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(out, exist_ok=True)
    tensors = load_file(os.path.join(DRAFT, "model.safetensors"))
    tensors["lm_head.weight"] = np.ascontiguousarray(tensors["model.embed_tokens.weight"][keep])
    if d2t is not None:
        tensors["d2t"] = d2t
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(DRAFT, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(tie_word_embeddings=False, draft_vocab_size=len(keep), **config)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    shutil.copy(os.path.join(DRAFT, "tokenizer.model"), out)
    return out


def run(engine, texts, max_tokens=MAX_TOKENS):
    for i, text in enumerate(texts):
        engine.add_request(
            str(i), text, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        )
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[str(i)] for i in range(len(texts))]


@pytest.fixture(scope="module")
def full_head_run():
    """The bundled draft's own run: outputs, acceptance rate and the target ids it drafts."""
    if not os.path.isfile(os.path.join(DRAFT, "config.json")):
        pytest.skip("the bundled draft model is missing")
    from jaxserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(draft_args(DRAFT))
    outputs = run(engine, TEXTS)
    st = engine.get_stats()
    rate = st.spec_decode_num_accepted_tokens_total / st.spec_decode_num_draft_tokens_total
    return outputs, rate


@pytest.mark.slow
def test_reduced_head_draft_outputs_and_acceptance(tmp_path, full_head_run):
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.model.dense_oracle import generate_dense
    from jaxserve.model.loader import load_model

    outputs, full_rate = full_head_run
    # The head keeps every token the target's answers use (what the draft should propose)
    # plus the lowest ids up to HEAD: a FR-Spec head built from the answers' frequencies.
    used = sorted({t for out in outputs for t in out})
    keep = np.union1d(used, np.setdiff1d(np.arange(4096), used)[: HEAD - len(used)])
    assert len(keep) == HEAD and keep.max() > HEAD  # ids past the head's size: d2t must map
    d2t = (keep - np.arange(HEAD)).astype(np.int64)
    draft = write_reduced_draft(str(tmp_path / "draft"), keep, d2t)
    engine = LLMEngine.from_engine_args(draft_args(draft))
    assert engine.runner.draft.arch.draft_vocab_size == HEAD
    got = run(engine, TEXTS)
    target, _, _ = load_model(os.fspath(BUNDLED), "float32")
    tok = engine.tokenizer
    assert got == [generate_dense(target, tok.encode(t), MAX_TOKENS) for t in TEXTS]
    assert got == outputs
    st = engine.get_stats()
    rate = st.spec_decode_num_accepted_tokens_total / st.spec_decode_num_draft_tokens_total
    # Every token the answers use is in the head, so the reduced draft accepts at least as
    # often as the full one (unmapped ids, or the head's rows out of order, would accept ~0).
    assert full_rate > 0.2 and rate >= full_rate - 0.02, (rate, full_rate)
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_gpu_blocks - 1 and not kv.req_to_blocks


def test_read_d2t_and_refusals(tmp_path):
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.model.arch_config import ModelArchConfig
    from jaxserve.model.loader import ModelLoadError
    from jaxserve.worker.draft_model import read_d2t

    if not os.path.isfile(os.path.join(DRAFT, "config.json")):
        pytest.skip("the bundled draft model is missing")
    keep = np.arange(0, 4096, 4)
    good = write_reduced_draft(str(tmp_path / "good"), keep, keep - np.arange(len(keep)))
    np.testing.assert_array_equal(read_d2t(good), keep - np.arange(len(keep)))
    assert read_d2t(DRAFT) is None and read_d2t(str(tmp_path / "missing")) is None
    # config: a reduced head needs an untied LM head and at most vocab_size rows
    with open(os.path.join(good, "config.json")) as f:
        hf = json.load(f)
    for bad in ({"tie_word_embeddings": True}, {"draft_vocab_size": 5000}):
        with pytest.raises(ModelLoadError, match="draft_vocab_size"):
            ModelArchConfig.from_hf_config({**hf, **bad})
    assert ModelArchConfig.from_hf_config({**hf, "draft_vocab_size": 4096}).draft_vocab_size is None
    # no d2t tensor; d2t mapping past the vocabulary: one-line errors naming the config field
    no_d2t = write_reduced_draft(str(tmp_path / "no_d2t"), keep, None)
    with pytest.raises(ValueError, match="speculative_config.model: .*no d2t tensor"):
        LLMEngine.from_engine_args(draft_args(no_d2t))
    past = keep - np.arange(len(keep))
    past[-1] += 8
    outside = write_reduced_draft(str(tmp_path / "outside"), keep, past)
    with pytest.raises(ValueError, match=r"speculative_config.model: d2t: .*\[0, 4096\)"):
        LLMEngine.from_engine_args(draft_args(outside))
