"""Writes the multi-LoRA parity fixtures (#33) under tests/fixtures/lora/.

Two tiny random PEFT adapters on the llama golden fixture (tests/fixtures/golden/llama), saved by
peft itself (``adapter_config.json`` + ``adapter_model.safetensors``, float32), and
``golden.npz``: for the base model and each adapter, transformers + peft's greedy tokens after
each prompt and the float32 log-probability of each (eager attention, float32):

* ``a1``: rank 8, lora_alpha 16, every projection (q/k/v/o, gate/up/down);
* ``a2``: rank 4, lora_alpha 8, rsLoRA, q_proj and v_proj only.

Needs torch, transformers and peft (the peer venv, ../shared/peer; never jaxserve's):

    /work/vllm-venv/bin/python scripts/make_lora_fixtures.py [--out tests/fixtures/lora]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import peft
import torch
import transformers

BASE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "golden", "llama")
ADAPTERS = {
    "a1": dict(
        r=8,
        lora_alpha=16,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    ),
    "a2": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
}
PROMPTS = [[1, 17, 42, 99, 3, 250, 7], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 200], [1, 64, 128]]
GREEDY_TOKENS = 6


def base_model():
    model = transformers.AutoModelForCausalLM.from_pretrained(
        BASE, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def greedy(model, prompt):
    """Greedy tokens after ``prompt`` and each one's float32 log-probability (no cache)."""
    ids = list(prompt)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(GREEDY_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            tok = int(torch.argmax(lp))
            tokens.append(tok)
            logprobs.append(float(lp[tok]))
            ids.append(tok)
    return tokens, logprobs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "lora")
    )
    args = p.parse_args()
    torch.manual_seed(0)
    golden = {}
    for i, prompt in enumerate(PROMPTS):
        golden[f"prompt_{i}"] = np.asarray(prompt, np.int32)
        tokens, lps = greedy(base_model(), prompt)
        golden[f"base_tokens_{i}"] = np.asarray(tokens, np.int32)
        golden[f"base_logprobs_{i}"] = np.asarray(lps, np.float32)
    for name, kw in ADAPTERS.items():
        cfg = peft.LoraConfig(**kw, lora_dropout=0.0, bias="none", init_lora_weights=False)
        model = peft.get_peft_model(base_model(), cfg)
        with torch.no_grad():  # O(1) deltas: a wrong scaling or layout moves logits far
            for pname, param in model.named_parameters():
                if "lora_" in pname:
                    param.copy_(torch.randn_like(param) * 0.3)
        model.eval()
        model.save_pretrained(os.path.join(args.out, name), safe_serialization=True)
        os.remove(os.path.join(args.out, name, "README.md"))  # peft's model-card template
        for i, prompt in enumerate(PROMPTS):
            tokens, lps = greedy(model, prompt)
            golden[f"{name}_tokens_{i}"] = np.asarray(tokens, np.int32)
            golden[f"{name}_logprobs_{i}"] = np.asarray(lps, np.float32)
            print(name, i, tokens, "base", golden[f"base_tokens_{i}"].tolist())
    np.savez(os.path.join(args.out, "golden.npz"), **golden)


if __name__ == "__main__":
    main()
