"""jaxserve.pooling (jax-free): runner choice, the pooler config (sentence-transformers files,
--pooler-config), Matryoshka truncation and normalisation, cosine."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxserve.config import EngineArgs
from jaxserve.pooling import (
    PoolerConfig,
    cosine_similarity,
    finish_embedding,
    read_sentence_transformers_pooling,
    resolve_pooler_config,
    resolve_runner,
)

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "pooling", "qwen3-embed")


def test_resolve_runner():
    assert resolve_runner("auto", "auto", "Qwen3ForCausalLM") == "generate"
    assert resolve_runner("auto", "auto", "Qwen3Model") == "pooling"
    assert resolve_runner("auto", "embed", "LlamaForCausalLM") == "pooling"
    assert resolve_runner("pooling", "auto", "Qwen3ForCausalLM") == "pooling"
    assert resolve_runner("generate", "none", "Qwen3Model") == "generate"
    with pytest.raises(ValueError, match="--runner pooling"):
        resolve_runner("generate", "embed", "LlamaForCausalLM")
    with pytest.raises(ValueError, match="runner must be one of"):
        resolve_runner("embed", "auto", "")


def test_sentence_transformers_config_is_read(tmp_path):
    assert read_sentence_transformers_pooling(FIXTURE) == PoolerConfig(
        "LAST", True, "sentence-transformers"
    )
    assert read_sentence_transformers_pooling(str(tmp_path)) is None
    # MEAN without a Normalize module
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(
        json.dumps([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )
    pooling = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    assert read_sentence_transformers_pooling(str(tmp_path)) == PoolerConfig(
        "MEAN", False, "sentence-transformers"
    )
    pooling["pooling_mode_max_tokens"] = True
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(ValueError, match="--pooler-config"):
        read_sentence_transformers_pooling(str(tmp_path))


def test_pooler_config_flag_overrides_the_checkpoint():
    cfg = resolve_pooler_config(FIXTURE, '{"pooling_type": "mean"}')
    assert (cfg.pooling_type, cfg.normalize) == ("MEAN", True)
    assert resolve_pooler_config("/nonexistent", None) == PoolerConfig()
    for bad, match in [
        ("{", "not JSON"),
        ('{"pooling": "LAST"}', "a JSON object"),
        ('{"pooling_type": "MAX"}', "pooling_type must be one of"),
        ('{"normalize": 1}', "normalize must be"),
    ]:
        with pytest.raises(ValueError, match=match):
            resolve_pooler_config(FIXTURE, bad)


def test_engine_config_resolves_the_runner_and_turns_prefix_caching_off_for_mean():
    cfg = EngineArgs(model=FIXTURE, runner="pooling").create_engine_config(512)
    assert (cfg.model.runner, cfg.model.pooling_type, cfg.model.pooling_normalize) == (
        "pooling",
        "LAST",
        True,
    )
    assert cfg.cache.enable_prefix_caching
    cfg = EngineArgs(
        model=FIXTURE, convert="embed", pooler_config='{"pooling_type": "CLS"}'
    ).create_engine_config(512)
    assert (cfg.model.runner, cfg.model.pooling_type) == ("pooling", "CLS")
    assert not cfg.cache.enable_prefix_caching  # CLS / MEAN read every prompt token
    assert EngineArgs(model=FIXTURE).create_engine_config(512).model.runner == "generate"


def test_finish_embedding_truncates_then_normalises():
    vec = np.array([3.0, 4.0, 12.0], np.float32)
    np.testing.assert_allclose(finish_embedding(vec, normalize=True), vec / 13.0, rtol=1e-6)
    np.testing.assert_allclose(
        finish_embedding(vec, normalize=True, dimensions=2), [0.6, 0.8], rtol=1e-6
    )
    np.testing.assert_array_equal(finish_embedding(vec, normalize=False, dimensions=1), [3.0])
    for dims in (0, 4):
        with pytest.raises(ValueError, match="^dimensions"):
            finish_embedding(vec, normalize=True, dimensions=dims)
    assert finish_embedding(np.zeros(2), normalize=True).tolist() == [0.0, 0.0]


def test_cosine_similarity():
    assert cosine_similarity([1, 0], [0, 2]) == 0.0
    assert cosine_similarity([1, 1], [2, 2]) == pytest.approx(1.0)
    assert cosine_similarity([1, 0], [-3, 0]) == pytest.approx(-1.0)
    assert cosine_similarity([0, 0], [1, 0]) == 0.0
