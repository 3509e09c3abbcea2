"""Writes the Hugging Face parity fixtures under tests/fixtures/golden/<name>/.

Each fixture is a tiny random model of one supported architecture, saved by transformers itself
(config.json, model.safetensors in bfloat16, generation_config.json), plus ``golden.npz``: token-id
prompts and the float32 logits transformers computes for them (eager attention, weights rounded to
bfloat16 first so that the saved weights reproduce them exactly). tests/model/test_hf_parity.py
loads the fixtures with our loader and compares logits; it needs no torch.

The Gemma fixtures (gemma2, gemma3, gemma3_mm: a Gemma3ForConditionalGeneration with a tiny
vision tower) are saved in float32 and carry more: ``greedy_<i>`` (transformers' greedy
``generate`` of ``GREEDY_TOKENS`` tokens after each prompt) and ``greedy_logprobs_<i>`` (the
log-softmax at each generated position, ``[GREEDY_TOKENS, vocab]``), and a small character-level
tokenizer with a Gemma-style chat template in tokenizer_config.json (so ``jaxserve serve`` runs
on them).

Needs torch + transformers, which the jaxserve venv does not carry:

    python3 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch==2.13.0 transformers safetensors numpy
    /tmp/torchvenv/bin/python scripts/make_golden.py [--out tests/fixtures/golden] [--only gemma2 ...]

Weights are drawn with a larger scale than HF's initializer_range (0.02) so the logits are O(1)
and a wrong RoPE, mask or norm moves them far beyond the tests' 1e-4 tolerance.
"""

from __future__ import annotations

import argparse
import json
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

# Gemma: 3 layers, windows of 4 tokens (shorter than the long prompt), query_pre_attn_scalar
# (24) != head_dim, soft caps small enough to bend the scores and logits (the released models'
# 50 and 30 barely touch a tiny random model's).
GEMMA_COMMON = dict(num_hidden_layers=3, sliding_window=4, query_pre_attn_scalar=24)
GEMMA3_TEXT = dict(
    GEMMA_COMMON,
    head_dim=24,  # != hidden_size / num_heads (16), as gemma-3-1b
    # every third layer global (released: 6); global RoPE with linear scaling, local base 10k
    sliding_window_pattern=3,
    rope_theta=1000000.0,
    rope_local_base_freq=10000.0,
    rope_scaling=dict(rope_type="linear", factor=8.0),
)
GEMMA_FIXTURES = {
    # Gemma 2: even layers local, attention-logit and final-logit soft caps.
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(GEMMA_COMMON, head_dim=16, attn_logit_softcapping=1.5, final_logit_softcapping=8.0),
        4,
    ),
    # Gemma 3: q/k norms, local/global RoPE, no soft caps.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, GEMMA3_TEXT, 11),
    # The language model of a Gemma 3 multimodal checkpoint (a one-layer vision tower beside it,
    # never read by jaxserve). transformers' Gemma3ForConditionalGeneration ignores the text
    # config's final_logit_softcapping (set here so that a reader applying it fails parity).
    "gemma3_mm": (
        transformers.Gemma3Config,
        transformers.Gemma3ForConditionalGeneration,
        dict(
            text_config=dict(GEMMA3_TEXT, final_logit_softcapping=8.0),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=16,
                patch_size=8,
            ),
            mm_tokens_per_image=4,
            boi_token_index=253,
            eoi_token_index=254,
            image_token_index=255,
        ),
        6,
    ),
}
# (config class, model class, config kwargs, seed): seeds picked for greedy outputs that follow
# the context (see randomize_gemma).
GREEDY_TOKENS = 16
# The Gemma fixtures' tokenizer: Gemma's special tokens at small ids, then printable ASCII one
# character per token, then unused fillers up to the vocabulary size.
GEMMA_SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# Gemma's turn markup (user/model turns, no system role: it joins the first user turn),
# written for these fixtures.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] | trim + '\n\n' %}"
    "{% else %}"
    "{% if m['role'] not in ('user', 'assistant') %}"
    "{{ raise_exception('Gemma turns are user or assistant, got ' + m['role']) }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' }}"
    "{% if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m['content'] | trim + '<end_of_turn>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

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


@torch.no_grad()
def randomize_gemma(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Gemma's RMSNorms scale by ``1 + weight`` and its tied embeddings are scaled by
    ``sqrt(hidden)``: weights ~ N(0, 1/fan_in), embeddings N(0, 0.25 / hidden), the post-norms'
    scales 3 + N(0, 0.1) and the final norm's 4 + N(0, 0.1) (other norms 1 + N(0, 0.1)). A
    random tiny model whose token embedding dominates its residual stream decodes greedily by
    repeating one token; with the layers' output dominating, greedy tokens follow the context
    (10+ distinct tokens in 16) with top-2 logit gaps of at least ~5e-3."""
    for name, p in model.named_parameters():
        module = name.split(".")[-2] if "." in name else ""
        if module == "norm":
            p.copy_(3 + 0.1 * torch.randn(p.shape, generator=gen))
        elif module.startswith("post_") and "norm" in module:
            p.copy_(2 + 0.1 * torch.randn(p.shape, generator=gen))
        elif "norm" in name:
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(0.5 * torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


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


def write_gemma_tokenizer(out: str, vocab_size: int) -> None:
    """A character-level tokenizer.json (no merges) of ``vocab_size`` ids and a
    tokenizer_config.json carrying the chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = GEMMA_SPECIAL + chars
    vocab += [f"<unused{i}>" for i in range(vocab_size - len(vocab))]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, [], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA_SPECIAL])
    tok.save(os.path.join(out, "tokenizer.json"))
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        add_bos_token=True,
        add_eos_token=False,
        chat_template=GEMMA_CHAT_TEMPLATE,
    )
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def make_gemma_fixture(name: str, out_root: str) -> None:
    """A float32 Gemma checkpoint, its logits, greedy tokens and their log-probabilities."""
    config_cls, model_cls, extra, seed = GEMMA_FIXTURES[name]
    text = {**COMMON, **(extra.get("text_config") or extra)}
    config = config_cls(**dict(extra, text_config=text)) if "text_config" in extra else None
    config = config or config_cls(**text)
    config._attn_implementation = "eager"
    if "text_config" in extra:
        config.text_config._attn_implementation = "eager"
        config.vision_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_gemma(model, torch.Generator().manual_seed(seed))
    arrays, margins = {}, []
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            x = torch.tensor([p])
            arrays[f"prompt_{i}"] = np.asarray(p, np.int32)
            arrays[f"logits_{i}"] = model(x).logits[0].float().numpy()
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=GREEDY_TOKENS,
                min_new_tokens=GREEDY_TOKENS,
                eos_token_id=None,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
            arrays[f"greedy_{i}"] = out.sequences[0, len(p) :].numpy().astype(np.int32)
            arrays[f"greedy_logprobs_{i}"] = np.stack(
                [torch.log_softmax(lg[0].float(), -1).numpy() for lg in out.logits]
            )
            top2 = [lg[0].topk(2).values for lg in out.logits]
            margins.append(min(float(t[0] - t[1]) for t in top2))
    out_dir = os.path.join(out_root, name)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 5]).save_pretrained(out_dir)
    write_gemma_tokenizer(out_dir, text["vocab_size"])
    np.savez_compressed(os.path.join(out_dir, "golden.npz"), **arrays)
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print(
        f"{name}: {size / 1024:.0f} KiB, logits std {np.std(arrays['logits_0']):.2f}, "
        f"greedy {arrays['greedy_0'].tolist()}, smallest top-2 gap {min(margins):.4f}, "
        f"transformers {transformers.__version__}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "golden"),
    )
    parser.add_argument("--only", nargs="*", help="fixture names to write (default: all)")
    parser.add_argument(
        "--head-dim",
        type=int,
        help="Gemma fixtures with this head_dim instead (vLLM's CPU attention takes 32, 64, ...,"
        " not the committed fixtures' 16 / 24): for scripts/gemma_peer_parity.py, not committed",
    )
    args = parser.parse_args()
    if args.head_dim:
        for _, _, extra, _ in GEMMA_FIXTURES.values():
            (extra.get("text_config") or extra)["head_dim"] = args.head_dim
    for seed, name in enumerate([*FIXTURES, *GEMMA_FIXTURES]):
        if args.only and name not in args.only:
            continue
        if name in GEMMA_FIXTURES:
            make_gemma_fixture(name, args.out)
        else:
            make_fixture(name, args.out, seed)


if __name__ == "__main__":
    main()
