"""Writes the compressed-tensors fixtures under tests/fixtures/quant/<scheme>/.

Each is a tiny random Llama quantized with compressed-tensors (the library llm-compressor saves
its checkpoints with: ``apply_quantization_config``, then ``ModelCompressor.compress_model`` and
``update_config``), in the layout llm-compressor writes, plus ``golden.npz``: token-id prompts
and the float32 logits of the same model run by compressed-tensors' own fake quantization in
torch (weights and input activations quantized and dequantized in every Linear). Scales are set
by hand the way llm-compressor's min-max observers set them (absmax per channel / tensor /
group; static input scales from a calibration prompt), which spares llm-compressor's
calibration machinery.

Schemes (llm-compressor's preset names): FP8_DYNAMIC (FP8 W8A8, per-token activations), FP8
(W8A8 static per-tensor; this fixture also has an FP8 kv_cache_scheme with k_scale / v_scale),
FP8_W8A16 (FP8 weights per channel, activations unquantized), W8A8 (INT8, per-token), W8A16
(INT8 per group of 32, pack-quantized into int32).

Needs torch + transformers + compressed-tensors (vLLM's CPU venv has them; see
/work/shared/peer): ``/work/vllm-venv/bin/python scripts/make_quant_fixtures.py``.
"""

from __future__ import annotations

import argparse
import copy
import os

import numpy as np
import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)
from make_golden import randomize  # the golden fixtures' weights: N(0, 1/fan_in), bf16-rounded

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
PROMPTS = [[1, 17, 42, 99, 3, 250, 7, 8, 9, 10, 128], [1, 200, 5]]
SCHEMES = ("FP8_DYNAMIC", "FP8", "FP8_W8A16", "W8A8", "W8A16")


def scheme_of(name: str) -> QuantizationScheme:
    if name == "FP8_W8A16":
        scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
        scheme.input_activations = None
        return scheme
    scheme = preset_name_to_scheme(name, ["Linear"])
    if name == "W8A16":  # the preset's groups of 128 are wider than this model's rows
        scheme.weights.group_size = 32
    return scheme


@torch.no_grad()
def set_scales(model: torch.nn.Module, name: str) -> None:
    """Absmax scales, as llm-compressor's min-max observers compute them."""
    static_inputs: dict[str, float] = {}
    if name == "FP8":  # calibrate static input scales (and k/v scales) on the prompts
        hooks = []
        for mod_name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):

                def grab(m, args, out, key=mod_name):
                    static_inputs[key] = max(
                        static_inputs.get(key, 0.0), args[0].abs().max().item()
                    )
                    static_inputs[key + ".out"] = max(
                        static_inputs.get(key + ".out", 0.0), out.abs().max().item()
                    )

                hooks.append(mod.register_forward_hook(grab))
        for p in PROMPTS:
            model(torch.tensor([p]))
        for h in hooks:
            h.remove()
    for mod_name, mod in model.named_modules():
        scheme = getattr(mod, "quantization_scheme", None)
        if scheme is None or not isinstance(mod, torch.nn.Linear):
            if scheme is not None and hasattr(mod, "k_scale"):  # attention: FP8 KV scales
                prefix = mod_name
                mod.k_scale.data.fill_(static_inputs[prefix + ".k_proj.out"] / 448.0)
                mod.v_scale.data.fill_(static_inputs[prefix + ".v_proj.out"] / 448.0)
            continue
        w = mod.weight.data.float()
        args = scheme.weights
        qmax = 448.0 if args.type == "float" else 127.0
        if args.strategy == "tensor":
            scale = w.abs().max().reshape(1) / qmax
        elif args.strategy == "channel":
            scale = w.abs().amax(dim=1, keepdim=True) / qmax
        else:  # group
            scale = w.reshape(w.shape[0], -1, args.group_size).abs().amax(-1) / qmax
        mod.weight_scale.data = scale.to(mod.weight_scale.dtype).reshape(mod.weight_scale.shape)
        if hasattr(mod, "weight_zero_point"):
            mod.weight_zero_point.data.zero_()
        if scheme.input_activations is not None and not scheme.input_activations.dynamic:
            mod.input_scale.data.fill_(static_inputs[mod_name] / 448.0)


def make_fixture(name: str, out_root: str, seed: int, head_dim: int = 16) -> None:
    config = transformers.LlamaConfig(**{**CONFIG, "head_dim": head_dim})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    randomize(model, torch.Generator().manual_seed(seed))
    kv = (
        QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
        if name == "FP8"
        else None
    )
    qconfig = QuantizationConfig(
        config_groups={"group_0": scheme_of(name)},
        ignore=["lm_head"],
        kv_cache_scheme=kv,
        quantization_status=QuantizationStatus.FROZEN,
    )
    reference = copy.deepcopy(model)
    apply_quantization_config(model, qconfig)
    for mod in model.modules():  # calibration runs the model wide
        mod.quantization_enabled = False
    set_scales(model, name)
    for mod in model.modules():
        # fake-quantized Linears for the reference logits; the KV cache stays wide there (the
        # jaxserve test compares with an FP8 cache separately)
        mod.quantization_enabled = isinstance(mod, torch.nn.Linear)
    with torch.no_grad():
        logits = [model(torch.tensor([p])).logits[0].float().numpy() for p in PROMPTS]
        wide = [reference(torch.tensor([p])).logits[0].float().numpy() for p in PROMPTS]

    out = os.path.join(out_root, name.lower())
    os.makedirs(out, exist_ok=True)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out, safe_serialization=True)
    compressor.update_config(out)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(out)
    arrays = {f"prompt_{i}": np.asarray(p, np.int32) for i, p in enumerate(PROMPTS)}
    arrays.update({f"logits_{i}": lg.astype(np.float32) for i, lg in enumerate(logits)})
    arrays.update({f"wide_logits_{i}": lg.astype(np.float32) for i, lg in enumerate(wide)})
    np.savez_compressed(os.path.join(out, "golden.npz"), **arrays)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    diff = max(np.abs(a - b).max() for a, b in zip(logits, wide))
    print(f"{name}: {size / 1024:.0f} KiB, max |quantized - wide| logit {diff:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "quant"),
    )
    parser.add_argument(
        "--head-dim",
        type=int,
        default=16,
        help="16: the committed fixtures; 32: the peer check's (vLLM's CPU attention refuses 16)",
    )
    args = parser.parse_args()
    for seed, name in enumerate(SCHEMES):
        make_fixture(name, args.out, seed, args.head_dim)


if __name__ == "__main__":
    main()
