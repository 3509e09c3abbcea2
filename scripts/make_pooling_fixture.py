"""Writes the pooling (embedding) parity fixture under tests/fixtures/pooling/qwen3-embed/.

A tiny random Qwen3 decoder laid out as Qwen3-Embedding ships: the base model's weights saved by
transformers without the ``model.`` prefix and without an LM head (tied embeddings), config.json
naming ``Qwen3ForCausalLM``, and the sentence-transformers files that say how to pool
(``modules.json``, ``1_Pooling/config.json``: last-token pooling, then ``Normalize``). Plus
``expected.npz``: token-id prompts and, per prompt, transformers' float32 ``last_hidden_state``
pooled three ways (LAST, MEAN, CLS), before normalisation. tests/model/test_pooling_parity.py
serves the fixture with ``--runner pooling`` and compares; it needs no torch.

Needs torch + transformers (the peer venv has both):

    /work/vllm-venv/bin/python scripts/make_pooling_fixture.py [--out tests/fixtures/pooling]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import transformers

PROMPTS = [
    [1, 17, 42, 99, 3, 250, 7, 8, 9, 10, 128, 2],
    [1, 200, 5, 2],
    [1, *range(30, 70), 2],  # 42 tokens: several prefill chunks at a small budget
]


@torch.no_grad()
def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms 1 + N(0, 0.1)."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "pooling"),
    )
    args = parser.parse_args()
    config = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen3Model(config).eval()
    randomize(model, torch.Generator().manual_seed(0))
    arrays = {}
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            h = model(torch.tensor([p])).last_hidden_state[0].float().numpy()
            arrays[f"prompt_{i}"] = np.asarray(p, np.int32)
            arrays[f"last_{i}"] = h[-1]
            arrays[f"mean_{i}"] = h.mean(axis=0)
            arrays[f"cls_{i}"] = h[0]
    out = os.path.join(args.out, "qwen3-embed")
    os.makedirs(os.path.join(out, "1_Pooling"), exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's config.json says
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    with open(os.path.join(out, "modules.json"), "w") as f:
        json.dump(modules, f, indent=2)
    pooling = {
        "word_embedding_dimension": config.hidden_size,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True,
        "include_prompt": True,
    }
    with open(os.path.join(out, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f, indent=2)
    np.savez_compressed(os.path.join(out, "expected.npz"), **arrays)
    with open(os.path.join(out, "model.safetensors"), "rb") as f:
        header = f.read(8)
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(out) for n in names)
    print(
        f"qwen3-embed: {size / 1024:.0f} KiB (header {int.from_bytes(header, 'little')} bytes), "
        f"transformers {transformers.__version__}, torch {torch.__version__}"
    )


if __name__ == "__main__":
    main()
