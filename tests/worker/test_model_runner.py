"""ModelRunner on a tiny random model (CPU): the KV caches are donated (no copy of the pool in the
compiled step), KV sizing from device memory with the profiled activation peak, one step's
outputs, backend resolution and the compilation cache."""

from __future__ import annotations

import os
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.config import EngineArgs
from jaxserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxserve.model.arch_config import ModelArchConfig
from jaxserve.model.loader import abstract_model
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker import kv_cache_alloc
from jaxserve.worker.compilation import forward_step, padding_inputs
from jaxserve.worker.model_runner import ModelRunner, resolve_attention_backend

HF = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "eos_token_id": 2,
}
XLA_CACHE_DIR = os.path.join(tempfile.gettempdir(), f"jaxserve-test-xla-{os.getuid()}")


def _random_model(seed=0):
    cfg = ModelArchConfig.from_hf_config(HF)
    graphdef, state = nnx.split(abstract_model(cfg, jnp.float32))
    rng = np.random.default_rng(seed)
    flat = dict(nnx.to_flat_state(state))
    for path, leaf in flat.items():
        shape = leaf.get_value().shape
        norm = "norm" in "/".join(map(str, path))
        leaf.set_value(
            jnp.asarray(
                np.ones(shape, np.float32)
                if norm
                else (0.05 * rng.standard_normal(shape)).astype(np.float32)
            )
        )
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), cfg


def _engine_config(**overrides):
    """Two token buckets (16, 32), 4 sequences, 128-token context, xla attention."""
    args = dict(
        model="tiny",
        dtype="float32",
        attention_backend="xla",
        token_buckets="16,32",
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=128,
        compilation_cache_dir=XLA_CACHE_DIR,
    )
    return EngineArgs(**{**args, **overrides}).create_engine_config(128)


@pytest.fixture(scope="module")
def runner():
    model, cfg = _random_model()
    r = ModelRunner(
        model,
        cfg,
        _engine_config(num_gpu_blocks_override=1024),
        warmup_sampling=(SamplingParams(temperature=0.0),),
    )
    r.initialize_kv_cache()
    return r


def test_attention_backend_resolution():
    assert resolve_attention_backend("auto", "cpu") == "xla"
    assert resolve_attention_backend("auto", "gpu") == "pallas-gpu"
    assert resolve_attention_backend("auto", "tpu") == "pallas-tpu"
    assert resolve_attention_backend("xla", "gpu") == "xla"
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_attention_backend("flash", "gpu")


def test_compilation_cache_is_configured(runner):
    assert jax.config.jax_compilation_cache_dir == XLA_CACHE_DIR
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0


def test_kv_caches_are_donated_not_copied(runner):
    """The compiled step aliases every KV buffer to its output (no copy of the pool), per
    ``memory_analysis()`` and the HLO; and the donated input buffers are consumed."""
    spec = runner.kv_spec
    layer_bytes = spec.total_bytes // spec.num_layers // 2
    compiled = forward_step.lower(
        runner.graph, runner.params, runner.kv_caches, padding_inputs(runner, 16)
    ).compile()
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes == spec.total_bytes
    assert mem.temp_size_in_bytes < layer_bytes  # no temporary the size of a layer cache
    assert mem.output_size_in_bytes - mem.alias_size_in_bytes < layer_bytes
    shape = "f32[{},{},{},{}]".format(*spec.layer_shape)
    copies = [
        line
        for line in compiled.as_text().splitlines()
        if re.search(r"=\s*" + re.escape(shape) + r".*\bcopy\(", line)
    ]
    assert copies == []
    kv_in = runner.kv_caches
    _, _, runner.kv_caches = forward_step(
        runner.graph, runner.params, kv_in, padding_inputs(runner, 16)
    )
    assert all(k.is_deleted() and v.is_deleted() for k, v in kv_in)
    assert not runner.kv_caches[0][0].is_deleted()


def test_kv_pool_is_the_largest_that_fits_beside_the_profiled_activations(monkeypatch):
    """The profiled peak covers at least the forward's live outputs (logits [S, V] and hidden
    [T, E] of the largest bucket), and the pool is the largest whole number of blocks that fits
    in gpu_memory_utilization x limit beside the memory in use and that peak."""
    model, cfg = _random_model()
    r = ModelRunner(model, cfg, _engine_config(gpu_memory_utilization=0.5))
    peak = r.profile_peak_activation_bytes()
    live_outputs = 4 * cfg.vocab_size * 4 + 32 * cfg.hidden_size * 4  # f32 logits + hidden
    assert peak >= live_outputs
    per_block = 16 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    limit, in_use = 2000 * per_block, 100 * per_block
    monkeypatch.setattr("jaxserve.worker.compilation.device_memory", lambda device: (limit, in_use))
    monkeypatch.setattr(kv_cache_alloc, "device_memory", lambda device: (limit, in_use))
    spec = r.initialize_kv_cache()
    assert spec.source == "memory"
    used = in_use + peak + spec.num_blocks * per_block
    assert used <= 0.5 * limit < used + per_block
    assert r.kv_caches[0][0].shape == (spec.num_blocks, 16, cfg.num_kv_heads, cfg.head_dim)


def test_one_step_samples_only_completed_prompts(runner):
    runner.reset_requests()
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    new = [
        NewRequestData("a", [1, 5, 7], [], greedy, 2, [1], 0),
        NewRequestData("b", list(range(10, 30)), [], greedy, 2, [2, 3], 0),
    ]
    sched = SchedulerOutput(new, CachedRequestData(), {"a": 3, "b": 16}, 19, set(), set())
    out = runner.execute_model(sched)
    assert out.req_ids == ["a", "b"] and out.req_id_to_index == {"a": 0, "b": 1}
    assert len(out.sampled_token_ids[0]) == 1 and out.sampled_token_ids[1] == []
    assert out.logprobs is None and out.prompt_logprobs_dict == {}
    tok = out.sampled_token_ids[0][0]
    # next step: a decodes its token, b finishes its prompt (4 tokens) -> both sample
    cached = CachedRequestData(["a", "b"], [[], []], [3, 16], [[tok], list(range(26, 30))])
    out2 = runner.execute_model(SchedulerOutput([], cached, {"a": 1, "b": 4}, 5, set(), set()))
    assert [len(t) for t in out2.sampled_token_ids] == [1, 1]
    assert all(0 <= t[0] < HF["vocab_size"] for t in out2.sampled_token_ids)
    # the dense forward agrees with the paged step's greedy tokens
    logits = runner_model_logits(runner, [1, 5, 7, tok])
    assert (
        int(np.argmax(logits[2])) == tok
        and int(np.argmax(logits[3])) == out2.sampled_token_ids[0][0]
    )
    runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, set(), {"a", "b"}))
    assert len(runner.input_batch) == 0


def runner_model_logits(runner, ids):
    model = nnx.merge(runner.graphdef, runner.state)
    return np.asarray(model.forward_dense(np.asarray([ids], np.int32))[0])
