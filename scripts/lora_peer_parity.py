"""Greedy tokens of a tiny Llama with two PEFT adapters, vLLM's CPU build vs jaxserve (#33).

vLLM's CPU build needs head_dim 32, 64, ...; the parity fixture has 16, so this makes its own
base model (transformers, float32) and adapters (peft) in a scratch folder, then prints each
side's greedy tokens per (adapter, prompt) as JSON:

    /work/vllm-venv/bin/python scripts/lora_peer_parity.py make /tmp/lora_peer
    VLLM_CPU_KVCACHE_SPACE=1 /work/vllm-venv/bin/python scripts/lora_peer_parity.py vllm /tmp/lora_peer
    JAX_PLATFORMS=cpu .venv/bin/python scripts/lora_peer_parity.py jaxserve /tmp/lora_peer
"""

from __future__ import annotations

import json
import os
import sys

PROMPTS = [[1, 17, 42, 99, 3, 250, 7], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 200], [1, 64, 128]]
ADAPTERS = ("a1", "a2")
MAX_TOKENS = 8


def make(out: str) -> None:
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(os.path.join(out, "base"), safe_serialization=True)
    targets = {
        "a1": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "a2": ["q_proj", "v_proj"],
    }
    for name in ADAPTERS:
        base = transformers.LlamaForCausalLM.from_pretrained(os.path.join(out, "base"))
        lora = peft.get_peft_model(
            base,
            peft.LoraConfig(
                r=8, lora_alpha=16, target_modules=targets[name], init_lora_weights=False
            ),
        )
        with torch.no_grad():
            for pname, p in lora.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn_like(p) * 0.3)
        lora.save_pretrained(os.path.join(out, name), safe_serialization=True)


def run_vllm(out: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(
        os.path.join(out, "base"),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        skip_tokenizer_init=True,
        max_model_len=128,
        enforce_eager=True,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    result = {}
    for i, name in enumerate((None, *ADAPTERS)):
        req = None if name is None else LoRARequest(name, i, os.path.join(out, name))
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, lora_request=req)
        result[name or "base"] = [list(o.outputs[0].token_ids) for o in outs]
    return result


def run_jaxserve(out: str) -> dict:
    from jaxserve import LLM, SamplingParams

    llm = LLM(
        os.path.join(out, "base"),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        lora_modules=[f"{n}={os.path.join(out, n)}" for n in ADAPTERS],
        max_model_len=128,
        max_num_batched_tokens=64,
        token_buckets="64",
        warmup=False,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=False)
    names = [None, *ADAPTERS]
    outs = llm.generate(
        [p for _ in names for p in PROMPTS],
        sp,
        use_tqdm=False,
        lora_name=[n for n in names for _ in PROMPTS],
    )  # one mixed batch
    tokens = [o.outputs[0].token_ids for o in outs]
    return {n or "base": tokens[k * 3 : k * 3 + 3] for k, n in enumerate(names)}


if __name__ == "__main__":
    side, folder = sys.argv[1], sys.argv[2]
    if side == "make":
        make(folder)
    else:
        print("RESULT", json.dumps((run_vllm if side == "vllm" else run_jaxserve)(folder)))
