"""``jaxserve plan``: will this model fit on these devices at this context length and batch?

From the model's config alone (no weight is read: a model directory's config.json and
safetensors headers, a .gguf file's header, or a preset name such as ``llama-3.1-70b``), per
device, with the functions the engine sizes itself with:

- weight bytes: the model the runner holds on the mesh (``placed_abstract_model``: quantized
  layers, FP8 KV scales, replicated heads), each parameter's per-device shard by the logical
  axis rules (``jaxserve.model.sharding``);
- activation peak: ``compilation.peak_activation_bytes``, the formula the engine applies to the
  ``memory_analysis()`` of its compiled step, here with the terms estimated from shapes (the
  engine measures them at start-up, so its figure can differ);
- KV bytes per token, KV blocks: ``kv_cache_alloc.size_kv_cache``, the runner's own sizing,
  given the device's memory (``DEVICES``) with the weights in use;
- concurrent sequences at ``max_model_len``: the blocks over ``blocks_per_sequence`` (the
  scheduler's admission count, KV-cache groups included).

Then a verdict, and when it does not fit, what would: FP8 KV, more devices, a shorter context.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
from typing import Any

DEFAULT_GPU_MEM_FRACTION = 0.75
"""The share of a GPU's memory JAX's allocator takes by default (``XLA_PYTHON_CLIENT_MEM_FRACTION``):
the ``bytes_limit`` the engine sees."""


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator model.

    Attributes:
      name: in words.
      platform: JAX's platform name ("gpu", "tpu", "cpu"): picks the attention backend (and so
        the KV head dim) as the engine would.
      memory_bytes: the device's memory; None for CPU (no memory stats: the engine's CPU default).
      fp8_matmul: multiplies fp8 by fp8 natively (``--quantization fp8`` is then W8A8).
    """

    name: str
    platform: str
    memory_bytes: int | None
    fp8_matmul: bool = False

    def bytes_limit(self) -> int | None:
        """What ``device.memory_stats()["bytes_limit"]`` reports: a GPU's memory times
        ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (default 0.75, JAX's allocator), a TPU's memory."""
        if self.memory_bytes is None:
            return None
        if self.platform == "gpu":
            fraction = float(
                os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_GPU_MEM_FRACTION)
            )
            return int(self.memory_bytes * fraction)
        return self.memory_bytes


# (model, dtype, quantization, KV scales, head replicas) -> the placed abstract model
_ABSTRACT: dict[tuple, Any] = {}
MiB, GiB = 2**20, 2**30
DEVICES: dict[str, DeviceSpec] = {
    "h200": DeviceSpec("NVIDIA H200 (141 GB)", "gpu", 143771 * MiB, fp8_matmul=True),
    "h100": DeviceSpec("NVIDIA H100 80GB", "gpu", 81559 * MiB, fp8_matmul=True),
    "a100": DeviceSpec("NVIDIA A100 80GB", "gpu", 81920 * MiB),
    "l4": DeviceSpec("NVIDIA L4", "gpu", 23034 * MiB, fp8_matmul=True),
    "v4": DeviceSpec("TPU v4", "tpu", 32 * GiB),
    "v5e": DeviceSpec("TPU v5e", "tpu", 16 * GiB),
    "v5p": DeviceSpec("TPU v5p", "tpu", 95 * GiB),
    "v6e": DeviceSpec("TPU v6e", "tpu", 32 * GiB),
    "cpu": DeviceSpec("CPU", "cpu", None),
}
"""``--device`` choices: memory per chip as the vendor and ``nvidia-smi`` report it."""


@dataclasses.dataclass
class Plan:
    """One deployment's sizing, per device (bytes unless named otherwise).

    Attributes:
      model, device, tensor_parallel_size, max_model_len, max_num_seqs, kv_cache_dtype: what
        was sized (``kv_cache_dtype`` resolved: "bfloat16", "float8_e4m3fn", ...).
      bytes_limit: the device memory the engine sees (None: CPU).
      gpu_memory_utilization: the share of it the engine may use.
      weight_bytes: one device's weights.
      activation_bytes: the step's activation peak (estimated; the engine measures it).
      kv_bytes_per_token: one device's KV bytes per token slot (all layers, K and V).
      kv_blocks: blocks in the pool, the null block included (0: not even 2 fit).
      block_size: tokens per block.
      blocks_per_sequence: one ``max_model_len`` sequence's blocks, all KV-cache groups.
      max_concurrent_sequences: sequences of ``max_model_len`` tokens the pool holds at once.
      kv_source: "memory" or "cpu-default" (``KVCacheSpec.source``).
      fits: at least one ``max_model_len`` sequence fits beside the weights and activations.
      verdict: the answer in words; suggestions: what would make it fit (or fit more).
    """

    model: str
    device: str
    tensor_parallel_size: int
    max_model_len: int
    max_num_seqs: int
    kv_cache_dtype: str
    bytes_limit: int | None
    gpu_memory_utilization: float
    weight_bytes: int
    activation_bytes: int
    kv_bytes_per_token: int
    kv_blocks: int
    block_size: int
    blocks_per_sequence: int
    max_concurrent_sequences: int
    kv_source: str
    fits: bool
    verdict: str = ""
    suggestions: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The plan as a JSON-ready dict (``--json``)."""
        return dataclasses.asdict(self)


def model_config(model: str) -> tuple[dict, bool, str | None]:
    """``(HF config dict, is_gguf, directory with safetensors headers or None)`` of ``model``: a
    preset name (``jaxserve.model.presets``), a model directory or a .gguf file. No weight is read.

    Raises:
      ModelLoadError: none of those (naming the presets).
    """
    from jaxserve.model.arch_config import ModelLoadError, read_hf_config
    from jaxserve.model.presets import PRESET_HF_CONFIGS
    from jaxserve.model.readers.gguf_reader import gguf_hf_config, is_gguf_path, open_gguf

    if model in PRESET_HF_CONFIGS and not os.path.exists(model):
        return dict(PRESET_HF_CONFIGS[model]), False, None
    if is_gguf_path(model):
        return gguf_hf_config(open_gguf(model), model), True, None
    if not os.path.isdir(model):
        raise ModelLoadError(
            f"model directory not found: {model} (plan reads a model directory, a .gguf file, "
            f"or a preset: {', '.join(PRESET_HF_CONFIGS)})"
        )
    hf = read_hf_config(model)
    has_st = any(n.endswith(".safetensors") for n in os.listdir(model))
    return hf, False, model if has_st else None


def shard_bytes(model, tensor_parallel_size: int, enable_expert_parallel: bool = False) -> int:
    """One device's bytes of ``model``'s parameters (abstract or real) on a mesh of
    ``tensor_parallel_size`` devices, each split by the logical axis rules."""
    import numpy as np
    from flax import nnx

    from jaxserve.model.sharding import MODEL_AXIS, axis_rules, logical_to_pspec

    rules = axis_rules(enable_expert_parallel)
    total = 0
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        spec = logical_to_pspec(var.get_metadata().get("out_sharding"), rules)
        shape = list(var.shape)
        for axis, mesh_axis in enumerate(spec):
            if mesh_axis == MODEL_AXIS:
                shape[axis] = -(-shape[axis] // tensor_parallel_size)
        total += math.prod(shape) * np.dtype(var.dtype).itemsize
    return total


def estimate_activation_bytes(config, arch, dtype, tensor_parallel_size: int, backend: str) -> int:
    """The step's activation peak (``compilation.peak_activation_bytes``) with its terms
    estimated from shapes, per device, for the largest token bucket ``T`` (``S`` sequences):

    - outputs: the logits ``[S, V]`` float32 and the hidden states ``[T, E]``;
    - forward temporaries: a layer's widest live set, the residual and its norm ``[T, E]`` twice
      plus the larger of attention (q, k, v, output: ``T x (2 Hq + 2 Hkv) D / N``) and the gated
      MLP (``T x 3 I / N``), and the LM head's vocabulary shard ``[S, V / N]`` float32;
    - sampler: top-p with logprobs sorts the logits: three ``[S, V]`` float32 arrays;
    - prompt logprobs: ``[chunk, V]`` float32 logits, twice (log-softmax).
    """
    import numpy as np

    from jaxserve.worker.batch_builder import backend_token_buckets, seq_bucket
    from jaxserve.worker.compilation import PROMPT_LOGPROBS_CHUNK, peak_activation_bytes

    sched = config.scheduler
    buckets = backend_token_buckets(
        backend, config.runner.token_buckets, sched.max_num_batched_tokens
    )
    t = buckets[-1]
    s = seq_bucket(t, sched.max_num_seqs)
    n = tensor_parallel_size
    item = np.dtype(dtype).itemsize
    e, v, d = arch.hidden_size, arch.vocab_size, arch.head_dim
    width = arch.intermediate_size
    if arch.moe is not None:
        width = max(width, arch.moe.intermediate_size * arch.moe.top_k)
    attn = t * (2 * arch.num_heads + 2 * arch.num_kv_heads) * d // n
    mlp = t * 3 * width // n
    forward = item * (2 * t * e + max(attn, mlp)) + 4 * s * v // n
    outputs = 4 * s * v + item * t * e
    sampler = 3 * 4 * s * v
    chunk = min(PROMPT_LOGPROBS_CHUNK, t & -t)
    return peak_activation_bytes(outputs, forward, sampler, 2 * 4 * chunk * v)


def plan(
    model: str,
    *,
    tensor_parallel_size: int = 1,
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    kv_cache_dtype: str = "auto",
    device: str = "h200",
    dtype: str = "auto",
    quantization: str = "auto",
    gpu_memory_utilization: float = 0.9,
    block_size: int = 16,
    max_num_batched_tokens: int = 8192,
    enable_expert_parallel: bool = False,
    suggest: bool = True,
) -> Plan:
    """Sizes ``model`` on ``tensor_parallel_size`` devices of kind ``device`` (see the module
    docstring); the flags mean what they mean to ``serve``.

    Raises:
      ValueError (ModelLoadError included): an unknown device or model, a model that does not
        split over ``tensor_parallel_size`` (naming both numbers), a bad flag (named).
    """
    import jax.numpy as jnp

    from jaxserve.config import EngineArgs
    from jaxserve.core.kv_cache_groups import blocks_per_sequence, make_kv_cache_layout
    from jaxserve.model import quant_loading
    from jaxserve.model.arch_config import ModelArchConfig
    from jaxserve.model.attention import cache_head_dim
    from jaxserve.model.attention_backends import resolve_attention_backend
    from jaxserve.model.loader import abstract_model, resolve_dtype
    from jaxserve.model.quant_config import kv_cache_dtype_name, resolve_quantization
    from jaxserve.model.readers.safetensors_reader import SafetensorsReader
    from jaxserve.model.sharded_loader import placed_abstract_model
    from jaxserve.model.sharding import check_tensor_parallel
    from jaxserve.worker.kv_cache_alloc import size_kv_cache

    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    dev = DEVICES[device]
    hf, is_gguf, st_dir = model_config(model)
    cfg = ModelArchConfig.from_hf_config(hf)
    args = EngineArgs(
        model=model,
        dtype=dtype,
        load_format="dummy" if st_dir is None and not is_gguf else "auto",
        tensor_parallel_size=tensor_parallel_size,
        enable_expert_parallel=enable_expert_parallel,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_dtype=kv_cache_dtype,
        quantization=quantization,
    )
    config = args.create_engine_config(cfg.max_position_embeddings)
    q_rep, kv_rep = check_tensor_parallel(cfg, tensor_parallel_size, enable_expert_parallel)
    arch = dataclasses.replace(
        cfg, num_heads=cfg.num_heads * q_rep, num_kv_heads=cfg.num_kv_heads * kv_rep
    )
    jdtype = resolve_dtype(dtype, cfg)
    kv_name = kv_cache_dtype_name(config.cache.cache_dtype, jnp.dtype(jdtype).name)
    kv_scales = (
        kv_cache_dtype_name(config.cache.cache_dtype, "float32") != "float32"
    )  # as load_model
    quant = resolve_quantization(quantization, hf, is_gguf, dev.fp8_matmul)
    key = (model, str(jdtype), quant, kv_scales, q_rep, kv_rep)
    if key not in _ABSTRACT:  # built once per model and head replication (tracing takes seconds)
        methods = {}
        if quant.on_load is not None or quant.method in ("compressed-tensors", "gguf"):
            reader = SafetensorsReader(st_dir) if st_dir is not None else None  # headers only
            try:
                methods = quant_loading.plan(abstract_model(cfg, jdtype), cfg, reader, quant)
            finally:
                if reader is not None:
                    reader.close()
        _ABSTRACT[key] = placed_abstract_model(cfg, jdtype, methods, kv_scales, q_rep, kv_rep)
    weights = shard_bytes(_ABSTRACT[key], tensor_parallel_size, enable_expert_parallel)
    backend = resolve_attention_backend(config.runner.attention_backend, dev.platform)
    activations = (
        0
        if dev.memory_bytes is None
        else estimate_activation_bytes(config, arch, jdtype, tensor_parallel_size, backend)
    )
    layout = make_kv_cache_layout(
        arch.layer_sliding_windows,
        hybrid=not config.cache.disable_hybrid_kv_cache_manager,
        max_model_len=config.scheduler.max_model_len,
    )
    limit = dev.bytes_limit()
    memories = [None] if limit is None else [(limit, weights)]
    kv_head_dim = cache_head_dim(backend, arch.head_dim)
    quiet = logging.getLogger("jaxserve.worker.kv_cache_alloc")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the engine's start-up log line, once per plan
    try:
        spec = size_kv_cache(
            config,
            arch,
            layout,
            kv_head_dim,
            jnp.dtype(kv_name),
            device_memories=memories,
            peak_activation_bytes=activations,
            num_shards=tensor_parallel_size,
        )
        blocks, per_token, source = spec.num_blocks, spec.bytes_per_token_per_device, spec.source
    except ValueError:  # fewer than 2 blocks
        blocks, source = 0, "memory"
        per_token = (
            2 * layout.num_tensors * arch.num_kv_heads * kv_head_dim * jnp.dtype(kv_name).itemsize
        ) // tensor_parallel_size
    finally:
        quiet.setLevel(level)
    sched = config.scheduler
    lookahead = 0 if config.speculative is None else config.speculative.num_lookahead_tokens
    per_seq = blocks_per_sequence(
        layout.sliding_windows,
        sched.max_model_len,
        config.cache.block_size,
        sched.max_num_batched_tokens + lookahead,
    )
    concurrent = max(blocks - 1, 0) // per_seq
    result = Plan(
        model=model,
        device=device,
        tensor_parallel_size=tensor_parallel_size,
        max_model_len=sched.max_model_len,
        max_num_seqs=sched.max_num_seqs,
        kv_cache_dtype=kv_name,
        bytes_limit=limit,
        gpu_memory_utilization=config.cache.gpu_memory_utilization,
        weight_bytes=weights,
        activation_bytes=activations,
        kv_bytes_per_token=per_token,
        kv_blocks=blocks,
        block_size=config.cache.block_size,
        blocks_per_sequence=per_seq,
        max_concurrent_sequences=concurrent,
        kv_source=source,
        fits=concurrent >= 1,
    )
    result.verdict = _verdict(result)
    if suggest and concurrent < sched.max_num_seqs:
        again = dict(
            max_num_seqs=max_num_seqs,
            dtype=dtype,
            quantization=quantization,
            gpu_memory_utilization=gpu_memory_utilization,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_expert_parallel=enable_expert_parallel,
            device=device,
            suggest=False,
        )
        result.suggestions = _suggestions(
            model, result, again, tensor_parallel_size, kv_cache_dtype, cfg
        )
    return result


def _verdict(p: Plan) -> str:
    if not p.fits:
        return (
            f"does not fit: not one {p.max_model_len}-token sequence fits beside the weights and "
            "activations"
        )
    if p.max_concurrent_sequences < p.max_num_seqs:
        return (
            f"fits: {p.max_concurrent_sequences} concurrent sequences of {p.max_model_len} "
            f"tokens (fewer than max_num_seqs {p.max_num_seqs}; shorter ones share the pool)"
        )
    return (
        f"fits: all {p.max_num_seqs} sequences (max_num_seqs) at {p.max_model_len} tokens "
        f"({p.max_concurrent_sequences} would fit)"
    )


def _suggestions(model, p: Plan, again: dict, tp: int, kv_cache_dtype: str, cfg) -> list[str]:
    """What would fit more: FP8 KV, the smallest larger TP that holds ``max_num_seqs`` (or one
    sequence), the longest context that fits one sequence (``plan`` again for each)."""
    from jaxserve.model.sharding import check_tensor_parallel

    out = []
    want = p.max_num_seqs if p.fits else 1
    if not p.kv_cache_dtype.startswith("float8"):
        q = plan(
            model,
            tensor_parallel_size=tp,
            max_model_len=p.max_model_len,
            kv_cache_dtype="fp8",
            **again,
        )
        if q.max_concurrent_sequences > p.max_concurrent_sequences:
            out.append(f"--kv-cache-dtype fp8: {q.max_concurrent_sequences} concurrent sequences")
    for n in (2, 4, 8, 16, 32, 64):
        if n <= tp:
            continue
        try:
            check_tensor_parallel(cfg, n, again["enable_expert_parallel"])
        except ValueError:
            continue
        q = plan(
            model,
            tensor_parallel_size=n,
            max_model_len=p.max_model_len,
            kv_cache_dtype=kv_cache_dtype,
            **again,
        )
        if q.max_concurrent_sequences >= want:
            out.append(
                f"--tensor-parallel-size {n}: {q.max_concurrent_sequences} concurrent sequences"
            )
            break
    if not p.fits:
        lo, hi = 0, p.max_model_len  # the longest context with one sequence: bisect
        while hi - lo > p.block_size:
            mid = (lo + hi) // 2 // p.block_size * p.block_size or p.block_size
            q = plan(
                model,
                tensor_parallel_size=tp,
                max_model_len=mid,
                kv_cache_dtype=kv_cache_dtype,
                **again,
            )
            lo, hi = (mid, hi) if q.fits else (lo, mid)
        if lo:
            out.append(f"--max-model-len {lo}: one sequence fits")
    if not out and not p.fits:
        out.append("nothing here makes it fit: a device with more memory, or quantized weights")
    return out


def format_plan(p: Plan) -> str:
    """The plan as a few lines of text."""

    def gib(x: int | None) -> str:
        return "n/a" if x is None else f"{x / GiB:.2f} GiB"

    budget = (
        "the CPU default (no memory stats): max_num_seqs full-length sequences, capped at 1 GiB"
        if p.bytes_limit is None
        else f"{p.gpu_memory_utilization:.2f} x {gib(p.bytes_limit)}"
    )
    lines = [
        f"{p.model} on {p.tensor_parallel_size} x {DEVICES[p.device].name}, max_model_len "
        f"{p.max_model_len}, max_num_seqs {p.max_num_seqs}, KV cache {p.kv_cache_dtype}",
        f"  per device: memory budget {budget}",
        f"    weights            {gib(p.weight_bytes)}",
        f"    activation peak    {gib(p.activation_bytes)} (estimated; the engine measures it)",
        f"    KV bytes per token {p.kv_bytes_per_token}",
        f"    KV blocks          {p.kv_blocks} x {p.block_size} tokens "
        f"({p.blocks_per_sequence} per {p.max_model_len}-token sequence)",
        f"    concurrent sequences at {p.max_model_len}: {p.max_concurrent_sequences}",
        f"  verdict: {p.verdict}",
    ]
    lines += [f"  would help: {s}" for s in p.suggestions]
    return "\n".join(lines)


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """``jaxserve plan MODEL [--tensor-parallel-size N] [--max-model-len L] ...``; sets
    ``func`` to ``run_plan``."""
    from jaxserve.config import EngineArgs

    defaults = EngineArgs()
    p = subparsers.add_parser(
        "plan",
        help="will a model fit: weights, activations, KV blocks and concurrent sequences per "
        "device, from its config alone",
        description="Sizes MODEL (a model directory, a .gguf file or a preset name) on "
        "--tensor-parallel-size devices of kind --device from its config alone (no weights "
        "read), with the functions the engine sizes itself with, and says whether it fits.",
    )
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e4m3, ...")
    p.add_argument("--device", default="h200", choices=list(DEVICES))
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--quantization", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    """Runs ``plan`` from parsed CLI args and prints it; exit code 0 when it fits, 1 when not."""
    result = plan(
        args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_expert_parallel=args.enable_expert_parallel,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    return 0 if result.fits else 1


DOCS_TABLE_ROWS: tuple[tuple[str, str, int, int], ...] = (
    ("llama-3.1-8b", "h200", 1, 8192),
    ("llama-3.1-8b", "h200", 1, 131072),
    ("llama-3.1-70b", "h200", 1, 8192),
    ("llama-3.1-70b", "h200", 2, 8192),
    ("llama-3.1-70b", "h200", 4, 8192),
    ("llama-3.1-70b", "h200", 8, 8192),
    ("llama-3.1-70b", "h200", 8, 131072),
    ("llama-3.1-8b", "v5e", 1, 8192),
    ("llama-3.1-8b", "v5e", 4, 8192),
    ("llama-3.1-8b", "v5e", 8, 8192),
    ("llama-3.1-70b", "v5e", 8, 8192),
    ("llama-3.1-8b", "v6e", 1, 8192),
    ("llama-3.1-8b", "v6e", 4, 8192),
    ("llama-3.1-70b", "v6e", 8, 8192),
    ("llama-3.1-70b", "v6e", 8, 32768),
)
"""(preset, device, TP, max_model_len) of docs/PARALLELISM.md's table (``docs_table``)."""


def docs_table(rows=DOCS_TABLE_ROWS) -> str:
    """docs/PARALLELISM.md's sizing table: ``plan`` of each row at the defaults (bfloat16
    weights and KV, max_num_seqs 256, max_num_batched_tokens 8192, utilization 0.9), as
    markdown. ``python -m jaxserve.plan`` prints it."""
    lines = [
        "| model | device | TP | max_model_len | weights / device | activations | KV / token "
        "/ device | KV blocks | sequences at max_model_len | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, device, tp, length in rows:
        p = plan(model, device=device, tensor_parallel_size=tp, max_model_len=length, suggest=False)
        lines.append(
            f"| {model} | {device} | {tp} | {length} | {p.weight_bytes / GiB:.2f} GiB | "
            f"{p.activation_bytes / GiB:.2f} GiB | {p.kv_bytes_per_token // 1024} KiB | "
            f"{p.kv_blocks} | {p.max_concurrent_sequences} | "
            f"{'fits' if p.fits else 'does not fit'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(docs_table())
