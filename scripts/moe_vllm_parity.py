"""Greedy float32 tokens of jaxserve and vLLM's CPU build on tiny random MoE checkpoints (#30).

vLLM's CPU attention refuses the golden fixtures' head dims (16, 24), so this makes its own
checkpoints with head_dim 64 (transformers, in the peer venv), then runs each engine on the same
token-id prompts and compares:

  /work/vllm-venv/bin/python scripts/moe_vllm_parity.py make OUT
  VLLM_CPU_KVCACHE_SPACE=1 /work/vllm-venv/bin/python scripts/moe_vllm_parity.py vllm OUT/mixtral
  JAX_PLATFORMS=cpu .venv/bin/python scripts/moe_vllm_parity.py jaxserve OUT/mixtral
  python3 scripts/moe_vllm_parity.py compare OUT/mixtral

(``make`` writes mixtral, qwen2_moe and qwen3_moe under OUT; the others write/read
``vllm.json`` / ``jaxserve.json`` in the model directory.)
"""

from __future__ import annotations

import json
import os
import random
import sys

LENGTHS = (5, 9, 16, 23, 31, 47, 64, 100)
MAX_TOKENS = 16


def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[1] + [rng.randrange(3, 256) for _ in range(n - 1)] for n in LENGTHS]


def make(out: str) -> None:
    import torch
    import transformers

    common = dict(
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        intermediate_size=64,
    )
    specs = {
        "mixtral": ("Mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
        "qwen2_moe": (
            "Qwen2Moe",
            dict(
                num_experts=8,
                num_experts_per_tok=4,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                norm_topk_prob=False,
                use_sliding_window=False,
            ),
        ),
        "qwen3_moe": (
            "Qwen3Moe",
            dict(
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                use_sliding_window=False,
            ),
        ),
    }
    torch.manual_seed(0)
    for name, (prefix, extra) in specs.items():
        config = getattr(transformers, prefix + "Config")(**common, **extra)
        model = getattr(transformers, prefix + "ForCausalLM")(config).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                scale = p.shape[-1] ** 0.5 if p.ndim > 1 else 10.0
                p.copy_(
                    1 + 0.1 * torch.randn(p.shape) if "norm" in n else torch.randn(p.shape) / scale
                )
        model.save_pretrained(os.path.join(out, name), safe_serialization=True)


def run_vllm(model: str) -> list[list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=256,
        seed=0,
        skip_tokenizer_init=True,
        block_size=32,
        enforce_eager=True,
    )
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()], sp, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in res]


def run_jaxserve(model: str) -> list[list[int]]:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from jaxserve import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=256, max_num_batched_tokens=256, warmup=False)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(r.outputs[0].token_ids) for r in llm.generate(prompts(), sp, use_tqdm=False)]


def compare(model: str) -> None:
    a = json.load(open(os.path.join(model, "vllm.json")))
    b = json.load(open(os.path.join(model, "jaxserve.json")))
    same = sum(x == y for x, y in zip(a, b))
    print(f"{model}: {same}/{len(a)} prompts with identical {MAX_TOKENS} greedy tokens")


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "make":
        make(path)
    elif mode == "compare":
        compare(path)
    else:
        tokens = run_vllm(path) if mode == "vllm" else run_jaxserve(path)
        with open(os.path.join(path, f"{mode}.json"), "w") as f:
            json.dump(tokens, f)


if __name__ == "__main__":
    main()
