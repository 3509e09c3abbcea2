"""Helpers for the engine tests: the model under test, a shared warmed-up runner, engines built
around it with different scheduler/cache knobs, and prompts.

The model is the bundled checkpoint (``checkpoints/tiny-llama``) when its weights exist; until
then a random model of the bundled config (weights drawn with numpy, saved in our orbax layout
next to the bundled tokenizer) stands in, so the same tests run either way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np

from jaxserve.config import EngineArgs, EngineConfig
from jaxserve.model import default_model_path

BUNDLED = default_model_path()
TOKENIZER_FILES = (
    "tokenizer.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
FALLBACK_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 4096,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def bundled_weights_exist() -> bool:
    return (
        os.path.isdir(os.path.join(BUNDLED, "params"))
        or any(f.endswith(".safetensors") for f in os.listdir(BUNDLED))
        if os.path.isdir(BUNDLED)
        else False
    )


def random_model(hf: dict, seed: int = 0):
    """A LlamaForCausalLM of ``hf`` in float32 with N(0, 0.02) weights drawn by numpy (norms 1)."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.model.arch_config import ModelArchConfig
    from jaxserve.model.loader import abstract_model

    cfg = ModelArchConfig.from_hf_config(hf)
    graphdef, state = nnx.split(abstract_model(cfg, jnp.float32))
    rng = np.random.default_rng(seed)
    flat = dict(nnx.to_flat_state(state))
    for path, leaf in flat.items():
        shape = leaf.get_value().shape
        value = (
            np.ones(shape, np.float32)
            if "norm" in "/".join(map(str, path))
            else (0.02 * rng.standard_normal(shape)).astype(np.float32)
        )
        leaf.set_value(jnp.asarray(value))
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), cfg


def make_model_dir(tmp_dir: str) -> str:
    """The bundled checkpoint if its weights exist, else a random stand-in saved in ``tmp_dir``."""
    if bundled_weights_exist():
        return BUNDLED
    from jaxserve.model.checkpoint import save_params

    path = os.path.join(tmp_dir, "tiny-random")
    hf = FALLBACK_HF_CONFIG
    if os.path.isfile(os.path.join(BUNDLED, "config.json")):
        with open(os.path.join(BUNDLED, "config.json")) as f:
            hf = json.load(f)
    hf = {**hf, "torch_dtype": "float32"}
    model, _ = random_model(hf)
    os.makedirs(path)
    save_params(model, path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(BUNDLED, name)):
            shutil.copy(os.path.join(BUNDLED, name), path)
    return path


def engine_args(model_dir: str, cache_dir: str, **overrides) -> EngineArgs:
    """Small, CPU-friendly engine args: float32, xla attention, buckets 16..128."""
    args = dict(
        model=model_dir,
        dtype="float32",
        attention_backend="xla",
        token_buckets="16,32,64,128",
        max_num_batched_tokens=128,
        max_num_seqs=256,
        max_model_len=256,
        compilation_cache_dir=cache_dir,
    )
    args.update(overrides)
    return EngineArgs(**args)


def variant_config(
    base: EngineConfig, *, num_gpu_blocks: int | None = None, **scheduler_or_cache
) -> EngineConfig:
    """``base`` with scheduler/cache fields replaced (names as in SchedulerConfig/CacheConfig)."""
    sched_fields = {f.name for f in dataclasses.fields(base.scheduler)}
    sched = {k: v for k, v in scheduler_or_cache.items() if k in sched_fields}
    cache = {k: v for k, v in scheduler_or_cache.items() if k not in sched_fields}
    if num_gpu_blocks is not None:
        cache["num_gpu_blocks"] = num_gpu_blocks
    return dataclasses.replace(
        base,
        scheduler=dataclasses.replace(base.scheduler, **sched),
        cache=dataclasses.replace(base.cache, **cache),
    )


def make_prompts(vocab_size: int, num: int = 32, seed: int = 0) -> list[list[int]]:
    """``num`` token-id prompts of lengths 1..~150; every fourth shares a 40-token prefix with
    the previous one (prefix-cache hits)."""
    rng = np.random.default_rng(seed)
    lengths = [1, 2, 5, 15, 16, 17, 31, 33, 48, 64, 65, 100, 127, 129, 150, 7, 60, 3] * (
        (num + 17) // 18
    )
    prompts = []
    for i in range(num):
        ids = rng.integers(3, vocab_size, size=lengths[i]).tolist()
        if i % 4 == 3 and len(prompts[-1]) > 40:
            ids = prompts[-1][1:41] + ids
        prompts.append([1] + ids[:200])
    return prompts


def chosen_tokens_and_logprobs(completion) -> tuple[list[int], list[float]]:
    """A finished ``CompletionOutput``'s token ids and the logprob of each chosen token (the
    request asked for ``logprobs >= 0``)."""
    tokens = list(completion.token_ids)
    return tokens, [lp[t].logprob for t, lp in zip(tokens, completion.logprobs)]


def step_until_done(engine, on_step=None, max_steps: int = 100_000) -> dict:
    """Steps ``engine`` until no request is unfinished; ``on_step(step)`` runs before each step
    (to add requests late). Returns ``{request_id: (token ids, chosen logprobs)}`` of the
    requests that finished. Raises AssertionError if requests remain after ``max_steps``."""
    done = {}
    for step in range(max_steps):
        if on_step is not None:
            on_step(step)
        if not engine.has_unfinished_requests() and (on_step is None or step > 3):
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = chosen_tokens_and_logprobs(out.outputs[0])
    assert not engine.has_unfinished_requests()
    return done
