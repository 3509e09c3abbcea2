"""Writes the tensor-parallel fixtures under tests/fixtures/tp/<name>/: tiny random checkpoints
in the Hugging Face layout (config.json, model.safetensors in float32, generation_config.json)
with 8 query heads, so that tensor_parallel_size 2, 4 and 8 all split them, and KV-head counts
that exercise both splitting and replicating KV heads:

    llama    8 q / 2 kv heads, llama3 RoPE, attention and MLP biases, untied head
    qwen2    8 q / 2 kv heads, q/k/v bias, tied embeddings
    qwen3    8 q / 4 kv heads, per-head q/k norm, head_dim 16 != hidden / heads
    mistral  8 q / 1 kv head (multi-query), sliding window 8

Weights are drawn from our own model's parameter tree (so the tensor names and shapes are the
loader's, the family's ``weight_source(..., "hf")``) at a scale that makes the logits O(10):
greedy decoding then has no near-ties that a different reduction order could flip. Needs only
the jaxserve venv:

    .venv/bin/python scripts/make_tp_fixtures.py [--out tests/fixtures/tp]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from flax import nnx

from jaxserve.model.arch_config import ModelArchConfig
from jaxserve.model.loader import abstract_model

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    head_dim=8,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    hidden_act="silu",
    torch_dtype="float32",
)

FIXTURES = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_key_value_heads=2,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        num_key_value_heads=4,
        head_dim=16,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        num_key_value_heads=1,
        sliding_window=8,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
}


def _draw(rng: np.random.Generator, legacy_name: str, shape: tuple[int, ...]) -> np.ndarray:
    last = legacy_name.split(".")[-1]
    if last in ("embed_tokens", "lm_head"):
        return rng.normal(0.0, 1.0, shape)
    if last == "weight":  # RMSNorm scales
        return 1.0 + 0.1 * rng.normal(size=shape)
    if last.endswith("_bias"):
        return 0.1 * rng.normal(size=shape)
    fan_in = shape[0] if last != "o_proj" else shape[0] * shape[1]
    return rng.normal(0.0, 1.5 / np.sqrt(fan_in), shape)


def write_fixture(out_dir: str, name: str, seed: int) -> None:
    hf = dict(COMMON, **FIXTURES[name])
    cfg = ModelArchConfig.from_hf_config(hf)
    model = abstract_model(cfg, np.float32)
    params = []
    for path, var in nnx.to_flat_state(nnx.state(model)):
        # Drawn in the order of the parameter names before Linear layers (the orbax layout's
        # fallback names), which is the order the committed fixtures were drawn in.
        legacy = model.weight_source(path, cfg, "jaxserve").names[-1]
        order = tuple(int(p) if p.isdigit() else p for p in legacy.split("."))
        params.append((order, legacy, path, var.shape))
    rng = np.random.default_rng(seed)
    tensors = {}
    for _, legacy, path, shape in sorted(params):
        ours = _draw(rng, legacy, shape).astype(np.float32)
        source = model.weight_source(path, cfg, "hf")
        tensors[source.name] = np.ascontiguousarray(source.layout.to_stored(ours))
    from safetensors.numpy import save_file

    path = os.path.join(out_dir, name)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("tests", "fixtures", "tp"))
    args = parser.parse_args()
    for seed, name in enumerate(FIXTURES):
        write_fixture(args.out, name, seed)
        print(f"wrote {os.path.join(args.out, name)}")


if __name__ == "__main__":
    main()
