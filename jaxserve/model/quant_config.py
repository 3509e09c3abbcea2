"""What the ``--quantization`` and ``--kv-cache-dtype`` flags and a checkpoint's own
``quantization_config`` ask for, checked before any weight is read. Jax-free.

Weight schemes (``resolve_quantization``):

    none                 wide weights (the checkpoint's, GGUF blocks dequantised on load)
    int8                 quantise on load: int8 weights, one scale per output channel, weight-only;
                         the embedding and LM head too (int8 rows, one scale per row)
    fp8                  quantise on load, as vLLM's ``--quantization fp8`` does: float8_e4m3fn
                         weights, one scale per output channel, in every projection; the
                         embedding and LM head stay wide (vLLM's Fp8Config quantizes
                         ``LinearBase`` layers only, so its ``VocabParallelEmbedding`` /
                         ``ParallelLMHead`` keep the model dtype). Activations as vLLM chooses by
                         device: where the device has FP8 matmuls (a CUDA GPU of compute
                         capability 8.9 or more: Ada, H100/H200) quantised per token (FP8 W8A8
                         dynamic, both operands fp8 into the tensor cores); elsewhere (CPU, TPU,
                         older GPUs) weight-only, FP8 W8A16 (vLLM's Marlin path there: "activations
                         not quantized for marlin"), the weight widened inside the matmul.
                         ``resolve_quantization``'s ``fp8_matmul`` picks; ``jaxserve.model.layers
                         .quant.fp8_matmul_supported`` tells. On SmolLM2-135M the fp8 LM head alone
                         cost +2.0% perplexity and per-token fp8 activations +0.8% on top of
                         W8A16 (benchmarks/RESULTS.md)
    compressed-tensors   llm-compressor's checkpoints (config.json ``quantization_config``):
                         FP8 W8A8 (dynamic per token, static per tensor), FP8 W8A16, INT8 W8A8
                         (dynamic per token), INT8 W8A16 (per channel or per group, packed)
    gguf                 a .gguf file's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K blocks stay blocks on the
                         device (other GGML types are dequantised on load)
    auto (the default)   compressed-tensors when the config has it; for a .gguf file gguf on
                         an accelerator and none on CPU (XLA:CPU widening the blocks in every
                         step decoded SmolLM2-135M 6.4x slower than wide weights: 1.8 vs 11.5
                         tok/s at batch 1, benchmarks/RESULTS.md; a CPU host has the memory);
                         else none

KV cache (``kv_cache_dtype``, vLLM's names): "auto" (the model dtype), "fp8" / "fp8_e4m3"
(float8_e4m3fn) and "fp8_e5m2"; per-tensor scales per layer (the checkpoint's ``k_scale`` /
``v_scale`` when present, else 1.0; see ``jaxserve.model.attention``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxserve.model.arch_config import ModelLoadError

QUANTIZATION_CHOICES = ("auto", "none", "int8", "fp8", "compressed-tensors", "gguf")
"""What ``--quantization`` accepts."""
KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
"""``--kv-cache-dtype`` values other than "auto" -> the cache's element dtype (numpy name)."""
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPES)
GGUF_BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
"""GGML types kept as blocks on the device (``jaxserve.model.layers.quant``)."""
GGUF_WIDE_TYPES = ("F32", "F16", "BF16")
SUPPORTED_CT_SCHEMES = "FP8 W8A8 (dynamic or static), FP8 W8A16, INT8 W8A8 (dynamic), INT8 W8A16"
CT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """How one projection's weight is stored and multiplied (static, hashable).

    Attributes:
      weight_dtype: "int8" or "float8_e4m3fn".
      activations: "none" (weight-only), "dynamic" (per-token scales computed in the step) or
        "static" (one per-tensor scale, the checkpoint's ``input_scale``).
      group_size: 0 for one scale per output channel (a per-tensor checkpoint scale is
        broadcast to every channel), else scales per group of this many inputs.
      packed: the checkpoint packs the int8 values in int32 words (compressed-tensors'
        ``pack-quantized``: ``weight_packed``, ``weight_shape``).
    """

    weight_dtype: str
    activations: str = "none"
    group_size: int = 0
    packed: bool = False

    @property
    def name(self) -> str:
        """The scheme's usual name, e.g. "FP8 W8A8 dynamic", "INT8 W8A16 group 128"."""
        kind = "FP8" if self.weight_dtype.startswith("float8") else "INT8"
        acts = "W8A16" if self.activations == "none" else f"W8A8 {self.activations}"
        return f"{kind} {acts}" + (f" group {self.group_size}" if self.group_size else "")


INT8_ON_LOAD = WeightScheme("int8")
FP8_ON_LOAD = WeightScheme("float8_e4m3fn")
"""``--quantization fp8`` where the device has no FP8 matmul (CPU, TPU, GPUs before sm_89):
weight-only, FP8 W8A16."""
FP8_W8A8_ON_LOAD = WeightScheme("float8_e4m3fn", activations="dynamic")
"""``--quantization fp8`` on a device with FP8 matmuls: FP8 W8A8, per-token activations."""


@dataclasses.dataclass(frozen=True)
class CompressedTensorsConfig:
    """A checkpoint's supported ``compressed-tensors`` quantization config.

    Attributes:
      groups: (targets, scheme) per config group; a target is "Linear" (every projection),
        a module name, or "re:<regex>" matched against Hugging Face module names.
      ignore: module names or "re:<regex>" left wide (usually ``lm_head``).
      kv_cache: the config has an FP8 ``kv_cache_scheme`` (``k_scale`` / ``v_scale`` stored).
    """

    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]
    ignore: tuple[str, ...] = ()
    kv_cache: bool = False

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of Hugging Face module ``module`` (e.g. "model.layers.0.mlp.up_proj"), or
        None when it is ignored or matched by no group."""
        if any(_matches(p, module) for p in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(t, module) for t in targets):
                return scheme
        return None


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module or module.endswith("." + pattern)


@dataclasses.dataclass(frozen=True)
class Quantization:
    """The resolved weight quantization of a load.

    Attributes:
      method: "none", "int8", "fp8", "compressed-tensors" or "gguf".
      on_load: the scheme every projection is quantised to on load ("int8", "fp8"), else None.
      on_load_embeddings: the embedding and LM head are quantised on load too (weight-only,
        one scale per row): int8 yes, fp8 no (wide, as vLLM keeps them).
      compressed_tensors: the checkpoint's config ("compressed-tensors"), else None.
    """

    method: str = "none"
    on_load: WeightScheme | None = None
    on_load_embeddings: bool = False
    compressed_tensors: CompressedTensorsConfig | None = None


NO_QUANTIZATION = Quantization()


def _args_scheme(weights: dict[str, Any], acts: dict[str, Any] | None, fmt: str) -> WeightScheme:
    """One config group's ``weights`` / ``input_activations`` -> WeightScheme.

    Raises:
      ModelLoadError: anything outside ``SUPPORTED_CT_SCHEMES``, naming the scheme.
    """
    wtype, bits = weights.get("type"), weights.get("num_bits")
    strategy = weights.get("strategy")
    desc = f"weights {wtype}{bits} {strategy}"
    if acts:
        desc += (
            f", activations {acts.get('type')}{acts.get('num_bits')} {acts.get('strategy')}"
            f" {'dynamic' if acts.get('dynamic') else 'static'}"
        )
    else:
        desc += ", activations unquantized"
    desc += f", format {fmt}"

    def refuse(why: str) -> ModelLoadError:
        return ModelLoadError(
            f"unsupported compressed-tensors scheme ({desc}): {why}; supported: "
            f"{SUPPORTED_CT_SCHEMES}"
        )

    if bits != 8 or wtype not in ("float", "int"):
        raise refuse(f"{bits}-bit {wtype} weights")
    if not weights.get("symmetric", True) or weights.get("dynamic", False):
        raise refuse("asymmetric or dynamic weights")
    if fmt not in CT_FORMATS:
        raise refuse(f"format {fmt!r}")
    group = 0
    if strategy == "group":
        group = int(weights.get("group_size") or 0)
        if wtype != "int" or acts or group <= 0:
            raise refuse("group scales are supported for INT8 W8A16 only")
    elif strategy not in ("channel", "tensor"):
        raise refuse(f"weight strategy {strategy!r}")
    activations = "none"
    if acts:
        if acts.get("num_bits") != 8 or acts.get("type") != wtype:
            raise refuse("activations of another type or width than the weights")
        if not acts.get("symmetric", True):
            raise refuse("asymmetric activations")
        if acts.get("dynamic") and acts.get("strategy") == "token":
            activations = "dynamic"
        elif not acts.get("dynamic") and acts.get("strategy") == "tensor":
            activations = "static"
        else:
            raise refuse(f"activation strategy {acts.get('strategy')!r}")
        if wtype == "int" and activations == "static":
            raise refuse("static INT8 activations")
    dtype = "float8_e4m3fn" if wtype == "float" else "int8"
    return WeightScheme(dtype, activations, group, packed=fmt == "pack-quantized")


def parse_compressed_tensors(qc: dict[str, Any]) -> CompressedTensorsConfig:
    """config.json's ``quantization_config`` (``quant_method: compressed-tensors``) -> its
    supported config.

    Raises:
      ModelLoadError: a scheme outside ``SUPPORTED_CT_SCHEMES`` (one line naming it), output
        activation quantization, or a KV-cache scheme other than FP8 per tensor.
    """
    fmt = qc.get("format", "float-quantized")
    groups = []
    for name, group in (qc.get("config_groups") or {}).items():
        if group.get("output_activations"):
            raise ModelLoadError(
                f"unsupported compressed-tensors scheme: output activations quantized in "
                f"config group {name}; supported: {SUPPORTED_CT_SCHEMES}"
            )
        weights = group.get("weights")
        if not weights:
            continue
        scheme = _args_scheme(weights, group.get("input_activations"), group.get("format") or fmt)
        groups.append((tuple(group.get("targets") or ("Linear",)), scheme))
    if not groups:
        raise ModelLoadError("compressed-tensors quantization_config has no quantized weights")
    kv = qc.get("kv_cache_scheme")
    if kv and (kv.get("type") != "float" or kv.get("num_bits") != 8):
        raise ModelLoadError(
            f"unsupported compressed-tensors kv_cache_scheme ({kv.get('type')}{kv.get('num_bits')}"
            f" {kv.get('strategy')}): only FP8 per-tensor k/v scales"
        )
    return CompressedTensorsConfig(tuple(groups), tuple(qc.get("ignore") or ()), bool(kv))


def resolve_quantization(
    flag: str,
    hf_config: dict[str, Any],
    is_gguf: bool,
    fp8_matmul: bool = False,
    keep_gguf_blocks: bool = True,
) -> Quantization:
    """The weight quantization to load with (see the module docstring).

    Args:
      flag: ``--quantization``, one of ``QUANTIZATION_CHOICES``.
      hf_config: the checkpoint's config.json dict (``quantization_config``); {} for GGUF.
      is_gguf: the checkpoint is a .gguf file.
      fp8_matmul: the device multiplies fp8 by fp8 natively (``fp8`` then quantises
        activations per token, W8A8; else weight-only, W8A16).
      keep_gguf_blocks: what ``auto`` does with a .gguf file: keep its blocks (accelerators) or
        dequantise them on load (False: CPU).

    Raises:
      ModelLoadError: an unknown flag, an unsupported checkpoint scheme (named), or a flag that
        contradicts the checkpoint (int8/fp8 over an already quantized checkpoint, gguf without
        a .gguf file, compressed-tensors without its config).
    """
    if flag not in QUANTIZATION_CHOICES:
        raise ModelLoadError(
            f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {flag!r}"
        )
    qc = hf_config.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method is not None and method != "compressed-tensors":
        raise ModelLoadError(
            f"unsupported quantization_config quant_method {method!r} in config.json; "
            "supported: compressed-tensors"
        )
    if flag == "auto":
        flag = "compressed-tensors" if qc else "gguf" if is_gguf and keep_gguf_blocks else "none"
    if qc and flag != "compressed-tensors":
        raise ModelLoadError(
            f"quantization {flag!r}: the checkpoint is already quantized (compressed-tensors); "
            "use --quantization auto"
        )
    if flag == "compressed-tensors":
        if not qc:
            raise ModelLoadError(
                "quantization 'compressed-tensors': config.json has no quantization_config"
            )
        return Quantization(flag, compressed_tensors=parse_compressed_tensors(qc))
    if flag == "gguf" and not is_gguf:
        raise ModelLoadError("quantization 'gguf' needs a .gguf file")
    if flag == "int8":
        return Quantization(flag, on_load=INT8_ON_LOAD, on_load_embeddings=True)
    if flag == "fp8":
        return Quantization(flag, on_load=FP8_W8A8_ON_LOAD if fp8_matmul else FP8_ON_LOAD)
    return Quantization(flag)


def kv_cache_dtype_name(kv_cache_dtype: str, model_dtype: str) -> str:
    """The KV cache's element dtype (numpy name) for ``--kv-cache-dtype``.

    Args:
      kv_cache_dtype: one of ``KV_CACHE_DTYPE_CHOICES``.
      model_dtype: the model's dtype name ("float32", "bfloat16"), what "auto" keeps.

    Raises:
      ValueError: an unknown value (naming ``kv_cache_dtype``).
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
            f"got {kv_cache_dtype!r}"
        )
    return KV_CACHE_DTYPES[kv_cache_dtype]


def kv_cache_itemsize(dtype_name: str) -> int:
    """Bytes per element of a KV cache dtype name ("float32" 4, "bfloat16" 2, fp8 1)."""
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype_name, 1)
