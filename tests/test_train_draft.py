"""scripts/train_draft.py on the bundled model: a few training steps on answers (token ids), and
a draft directory the engine's loader reads (reduced head, ``d2t`` onto the answers' tokens,
the target's embedding); the prompt builder. The engine side of such a draft is
tests/engine/test_spec_decode_draft_vocab.py; ``--generate`` is ``LLM.generate``."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))


@pytest.mark.slow
def test_train_draft_writes_a_loadable_reduced_head_draft(tmp_path):
    import train_draft
    from safetensors.numpy import load_file

    from jaxserve.model import default_model_path
    from jaxserve.model.arch_config import ModelArchConfig
    from jaxserve.worker.draft_model import read_d2t

    target = os.fspath(default_model_path())
    rng = np.random.default_rng(0)
    answers = [
        {"prompt": rng.integers(3, 4096, 20).tolist(), "output": rng.integers(3, 4096, 12).tolist()}
        for _ in range(12)
    ]
    data, out = tmp_path / "answers.jsonl", tmp_path / "draft"
    data.write_text("".join(json.dumps(a) + "\n" for a in answers))
    argv = ["--target", target, "--data", str(data), "--draft-vocab-size", "256"]
    argv += ["--seq-len", "48", "--answer-len", "12", "--batch-size", "4", "--epochs", "2"]
    train_draft.main([*argv, "--valid-lines", "4", "--out", str(out)])

    arch = ModelArchConfig.from_pretrained(str(out))
    assert (arch.num_layers, arch.draft_vocab_size, arch.tie_word_embeddings) == (2, 256, False)
    d2t = read_d2t(str(out))
    ids = np.arange(256) + d2t
    assert np.all(np.diff(ids) > 0) and ids.min() >= 0 and ids.max() < arch.vocab_size
    used = {t for a in answers[:-4] for t in a["output"]}  # the training answers' tokens
    assert used <= set(ids.tolist())
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["lm_head.weight"].shape == (256, arch.hidden_size)
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 4 and log["answers"] == 8 and len(log["valid_agreement"]) == 3


def test_make_prompts_holds_out_whole_modules(tmp_path):
    import train_draft

    train_draft.main(["--make-prompts", str(tmp_path)])
    train = json.loads((tmp_path / "train_prompts.json").read_text())
    held_out = json.loads((tmp_path / "valid_prompts.json").read_text())
    assert len(train) > 300 and len(held_out) > 20
    assert not set(train) & set(held_out)
    with pytest.raises(SystemExit):  # --target, --data, --out are needed to train
        train_draft.main(["--target", "x"])
