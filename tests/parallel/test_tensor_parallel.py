"""Tensor parallelism on simulated CPU devices: greedy float32 tokens at TP 2/4/8 (Gemma 2 and
Gemma 3: TP 2/4) are those of TP 1 (prefix caching, chunked prefill and preemption on the way),
placement by the logical axis rules, KV heads split or replicated, the Pallas kernel per shard,
and heads that cannot split."""

from __future__ import annotations

import os

import pytest
from tp_harness import (
    ENGINE_KWARGS,
    FIXTURE_MODELS,
    GEMMA_MODELS,
    GEMMA_TP_SIZES,
    MAX_TOKENS,
    PROMPTS,
    model_path,
)

from jaxserve.model import cpu_kernels, default_model_path
from jaxserve.model.arch_config import ModelArchConfig
from jaxserve.model.sharding import kv_head_replicas, q_head_replicas

# The shared harness (one session fixture) takes minutes on a loaded 2-core box.
pytestmark = pytest.mark.timeout(1800)


CASES = [(m, tp) for m in ("bundled", *FIXTURE_MODELS) for tp in (2, 4, 8)]
CASES += [(m, tp) for m in GEMMA_MODELS for tp in GEMMA_TP_SIZES[1:]]


def _arch(name: str) -> ModelArchConfig:
    return ModelArchConfig.from_pretrained(model_path(name) or os.fspath(default_model_path()))


@pytest.mark.slow
@pytest.mark.parametrize("model,tp", CASES)
def test_greedy_tokens_equal_one_device(tp_results, model, tp):
    one = tp_results[(model, 1, "xla")]
    many = tp_results[(model, tp, "xla")]
    assert "error" not in many, many.get("error")
    assert many["placement"]["mesh"] == {"model": tp}
    assert many["tokens"] == one["tokens"]


@pytest.mark.slow
def test_speculative_decoding_at_tp_2_keeps_the_greedy_tokens(tp_results):
    """The bundled model at TP 2 speculating with its draft (both models split over the mesh,
    the draft's K/V pool too) gives the one-device tokens, with drafts accepted, through the
    workload's preemptions and prefix-cache hits."""
    spec = tp_results[("bundled", 2, "spec")]
    assert "error" not in spec, spec.get("error")
    assert spec["placement"]["mesh"] == {"model": 2}
    assert spec["tokens"] == tp_results[("bundled", 1, "xla")]["tokens"]
    assert spec["stats"]["spec_decode_drafts"] > 0
    assert spec["stats"]["spec_decode_accepted_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("model", ("bundled", *FIXTURE_MODELS, *GEMMA_MODELS))
def test_workload_covers_prefix_caching_chunked_prefill_and_preemption(tp_results, model):
    stats = tp_results[(model, 1, "xla")]["stats"]
    assert stats["preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert max(map(len, PROMPTS)) > ENGINE_KWARGS["long_prefill_token_threshold"]  # chunked
    assert all(len(t) == MAX_TOKENS for t in tp_results[(model, 1, "xla")]["tokens"])


@pytest.mark.slow
@pytest.mark.parametrize("model,tp", [(m, tp) for m, tp in CASES] + [("llama", 1)])
def test_placement_splits_heads_and_kv_heads(tp_results, model, tp):
    arch = _arch(model)
    p = tp_results[(model, tp, "xla")]["placement"]
    replicas = kv_head_replicas(arch.num_heads, arch.num_kv_heads, tp)
    heads = arch.num_heads * q_head_replicas(arch.num_heads, tp)  # copies only when tp > heads
    # one CPU device: packed for the panel matmul, where our CPU kernels build
    assert p["q_proj_packed"] == (tp == 1 and cpu_kernels.available())
    if p["q_proj_packed"]:
        assert p["q_proj"] == [-(-heads * arch.head_dim // 32), arch.hidden_size, 32]
        assert p["q_proj_shard"] == p["q_proj"]
        return
    assert p["q_proj"] == [arch.hidden_size, heads, arch.head_dim]
    assert p["q_proj_shard"] == [arch.hidden_size, heads // tp, arch.head_dim]
    kv_heads = arch.num_kv_heads * replicas  # the cache holds the replicated heads
    assert p["k_cache"][2] == kv_heads and p["k_cache_shard"][2] == kv_heads // tp
    assert p["k_cache_shard"][2] == max(1, arch.num_kv_heads // tp)


@pytest.mark.slow
def test_heads_that_cannot_split_are_refused_naming_both_numbers(tp_results):
    err = tp_results[("bundled", 3, "xla")]["error"]
    assert "num_attention_heads (4)" in err and "tensor_parallel_size (3)" in err
    err = tp_results[("llama", 3, "xla")]["error"]
    assert "num_attention_heads (8)" in err and "tensor_parallel_size (3)" in err


@pytest.mark.slow
def test_pallas_kernel_per_shard_matches_one_device(tp_results):
    got = tp_results[("qwen3", 2, "pallas")]["tokens"]
    want = tp_results[("qwen3", 1, "xla")]["tokens"]
    assert got == [t[: len(g)] for t, g in zip(want, got)] and all(len(g) == 4 for g in got)
