"""Writes the Hugging Face parity fixtures under tests/fixtures/golden/<name>/.

Each fixture is a tiny random model of one supported architecture, saved by transformers itself
(config.json, model.safetensors in bfloat16, generation_config.json), plus ``golden.npz``: token-id
prompts and the float32 logits transformers computes for them (eager attention, weights rounded to
bfloat16 first so that the saved weights reproduce them exactly). tests/model/test_hf_parity.py
loads the fixtures with our loader and compares logits; it needs no torch.

Needs torch + transformers, which the jaxserve venv does not carry:

    python3 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch==2.13.0 transformers safetensors numpy
    /tmp/torchvenv/bin/python scripts/make_golden.py [--out tests/fixtures/golden]

Weights are drawn with a larger scale than HF's initializer_range (0.02) so the logits are O(1)
and a wrong RoPE, mask or norm moves them far beyond the tests' 1e-4 tolerance.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import transformers

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

FIXTURES = {
    # Llama 3.1-style llama3 RoPE scaling (all three frequency bands at head_dim 16), untied head,
    # and Llama's optional attention/MLP biases.
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_theta=10000.0,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        [2, 3],
    ),
    # Mistral: a sliding window shorter than the prompts.
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=4, rope_theta=10000.0, tie_word_embeddings=False),
        2,
    ),
    # Qwen2: q/k/v biases, tied embeddings.
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False),
        2,
    ),
    # Qwen3: per-head q/k RMSNorm, head_dim (24) != hidden_size / num_heads (16), tied.
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=24, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False),
        2,
    ),
    # Mixtral: 8 experts of width 32, top-2 renormalised, untied.
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
        2,
    ),
    # Qwen2-MoE: q/k/v bias, top-4 of 8 not renormalised, a shared expert with its sigmoid gate,
    # and layer 1 dense (mlp_only_layers).
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(
            num_experts=8,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            use_sliding_window=False,
        ),
        2,
    ),
    # Qwen3-MoE: q/k norm, head_dim 24, top-2 of 8 renormalised, tied.
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            head_dim=24,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
        2,
    ),
}

PROMPTS = [
    [1, 17, 42, 99, 3, 250, 7, 8, 9, 10, 128],
    [1, 200, 5],
]


@torch.no_grad()
def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms 1 + N(0, 0.1), biases N(0, 0.1);
    then rounded to bfloat16 (the saved precision). Fan-in is the last axis (torch Linear
    ``[out, in]``; transformers' stacked experts ``[E, out, in]``)."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        p.copy_(p.to(torch.bfloat16).to(torch.float32))


def make_fixture(name: str, out_root: str, seed: int) -> None:
    config_cls, model_cls, extra, eos = FIXTURES[name]
    config = config_cls(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize(model, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = [model(torch.tensor([p])).logits[0].float().numpy() for p in PROMPTS]

    out = os.path.join(out_root, name)
    os.makedirs(out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=eos).save_pretrained(out)
    arrays = {f"prompt_{i}": np.asarray(p, np.int32) for i, p in enumerate(PROMPTS)}
    arrays.update({f"logits_{i}": lg.astype(np.float32) for i, lg in enumerate(logits)})
    np.savez_compressed(os.path.join(out, "golden.npz"), **arrays)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(
        f"{name}: {size / 1024:.0f} KiB, logits std {np.std(logits[0]):.2f}, "
        f"transformers {transformers.__version__}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "golden"),
    )
    parser.add_argument(
        "--only", action="append", choices=list(FIXTURES), help="write only these fixtures"
    )
    args = parser.parse_args()
    for seed, name in enumerate(FIXTURES):
        if not args.only or name in args.only:
            make_fixture(name, args.out, seed)


if __name__ == "__main__":
    main()
