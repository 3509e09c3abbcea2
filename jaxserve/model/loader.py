"""Building a model with weights: Hugging Face safetensors, GGUF, our orbax layout, or random
(dummy).

``load_model`` is the single entry point the engine uses. The config's architecture picks the
family class (``jaxserve.model.registry``); a checkpoint reader (``jaxserve.model.readers``)
gives the checkpoint's tensors by name; for each parameter the family says which tensor holds
it and in what layout (``weight_source``, ``jaxserve.model.weight_mapping``), and
``load_weights`` reads, reshapes and casts it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxserve.model import quant_loading
from jaxserve.model.arch_config import ModelArchConfig, ModelLoadError, read_hf_config
from jaxserve.model.layers.quant import fp8_matmul_supported
from jaxserve.model.presets import PRESET_HF_CONFIGS
from jaxserve.model.quant_config import (
    NO_QUANTIZATION,
    Quantization,
    kv_cache_dtype_name,
    resolve_quantization,
)
from jaxserve.model.readers.base import CheckpointReader
from jaxserve.model.readers.gguf_reader import (
    GGUFFileReader,
    gguf_generation_config,
    gguf_hf_config,
    is_gguf_path,
)
from jaxserve.model.readers.orbax_reader import PARAMS_DIR, OrbaxReader
from jaxserve.model.readers.safetensors_reader import SafetensorsReader
from jaxserve.model.registry import resolve_model_class
from jaxserve.model.sharded_loader import load_sharded
from jaxserve.model.sharding import check_tensor_parallel, make_mesh

LOAD_FORMATS = ("auto", "safetensors", "orbax", "gguf", "dummy")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype: str, cfg: ModelArchConfig):
    """The model's parameter (and KV cache) dtype from the ``--dtype`` flag.

    Args:
      dtype: "auto" -> the checkpoint's ``torch_dtype`` (float16 -> bfloat16, missing or
        unknown -> float32); "float32" / "bfloat16" as named.
      cfg: the parsed HF config (for ``torch_dtype``).

    Returns:
      ``jnp.float32`` or ``jnp.bfloat16``.

    Raises:
      ValueError: for any other ``dtype`` (naming the field).
    """
    if dtype == "auto":
        return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.bfloat16}.get(
            cfg.torch_dtype or "", jnp.float32
        )
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {dtype!r}")
    return DTYPES[dtype]


def abstract_model(cfg: ModelArchConfig, dtype) -> nnx.Module:
    """The model of ``cfg``'s architecture with ``jax.ShapeDtypeStruct`` parameters: shapes
    only, nothing allocated."""
    model_cls = resolve_model_class(cfg.architecture)
    return nnx.eval_shape(lambda: model_cls(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def dummy_model(cfg: ModelArchConfig, dtype, seed: int = 0) -> nnx.Module:
    """Random weights of ``cfg`` drawn on device with ``jax.random`` directly in ``dtype``.

    Eager on purpose: layers share shapes, so only a handful of small random-normal programs are
    compiled, where jitting the whole initialiser compiles one program per parameter.
    """
    return resolve_model_class(cfg.architecture)(cfg, dtype=dtype, rngs=nnx.Rngs(seed))


def load_weights(
    cfg: ModelArchConfig,
    dtype,
    reader: CheckpointReader,
    quantization: Quantization = NO_QUANTIZATION,
    kv_scales: bool = False,
    mesh: Mesh | None = None,
    enable_expert_parallel: bool = False,
) -> nnx.Module:
    """The model of ``cfg``'s architecture with every parameter read from ``reader``.

    For each parameter the family names its tensor and layout (``weight_source(path, cfg,
    reader.naming)``); the tensor's stored shape is checked before it is read, then it is
    reshaped to ours and cast to ``dtype``. Tensors no parameter names (rotary ``inv_freq``,
    ...) are not read. Layers that ``quantization`` quantizes (``jaxserve.model.quant_loading``)
    are read whole, their narrow parameters kept as they are; ``kv_scales`` adds each attention
    layer's FP8 KV-cache scales (the checkpoint's, else 1.0).

    With a ``mesh`` the model is loaded onto it, sharded (``load_sharded``): each process reads
    only the slices of each tensor its devices hold; otherwise every tensor is read whole onto
    the default device.

    Raises:
      ModelLoadError: a tensor is missing, or its stored shape is not the parameter's (naming
        the tensor, the expected and the found shapes).
      ValueError: with a mesh, a model that cannot be split over it (``check_tensor_parallel``).
    """
    model = abstract_model(cfg, dtype)
    methods = quant_loading.plan(model, cfg, reader, quantization)
    if mesh is not None:
        q_replicas, kv_replicas = check_tensor_parallel(cfg, mesh.size, enable_expert_parallel)
        # Quantized layers are read whole (their method decides their parameters' shapes); with
        # replicated heads on top, the whole model is loaded first and placed by place_model.
        if not (methods and (q_replicas > 1 or kv_replicas > 1)):
            return load_sharded(
                cfg, dtype, reader, methods, kv_scales, mesh, enable_expert_parallel
            )
    if methods or kv_scales:
        model = quant_loading.abstract_model(cfg, dtype, methods, kv_scales)
    quant = quant_loading.LayerReads(model, cfg, reader, methods, kv_scales)
    graphdef, abs_state = nnx.split(model)
    flat = []
    for path, var in nnx.to_flat_state(abs_state):
        value = quant.pop(tuple(path))
        if value is not None:
            flat.append((path, var.replace(jnp.asarray(value, var.dtype))))
            continue
        source = model.weight_source(path, cfg, reader.naming)
        if source.stacked:  # one tensor per expert, stacked on our leading axis
            parts = [_read(reader, (n,), source.layout, var.shape[1:]) for n in source.stacked]
            x = jnp.stack(parts)
        else:
            x = _read(reader, source.names, source.layout, var.shape)
        flat.append((path, var.replace(x.astype(dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _read(reader: CheckpointReader, names: tuple[str, ...], layout, shape: tuple[int, ...]):
    """The first of ``names`` that ``reader`` has, shape-checked, read and turned by ``layout``
    into ``shape`` (a jax array in the stored dtype)."""
    name = next((n for n in names if n in reader), None)
    if name is None:
        raise ModelLoadError(f"{reader.error_prefix}tensor {names[0]} not found in {reader.where}")
    want, got = layout.stored_shape(shape), reader.spec(name).shape
    if got != want:
        raise ModelLoadError(
            f"{reader.error_prefix}shape mismatch for tensor {name}: expected {list(want)}, "
            f"got {list(got)} in {reader.where}"
        )
    return layout.to_ours(jnp.asarray(reader.read(name)), shape)


def quantize_dummy(model: nnx.Module, quantization: Quantization, kv_scales: bool) -> nnx.Module:
    """Random weights quantized as ``quantization`` says (on-load schemes only: a dummy has no
    checkpoint scheme), plus FP8 KV-cache scales of 1.0 with ``kv_scales``; in place."""
    methods = quant_loading.plan(model, model.config, None, quantization)
    layers = quant_loading.quantizable_layers(model)
    for path, method in methods.items():
        quant_loading.quantize_layer(layers[path], method)
    if kv_scales:
        quant_loading.add_kv_scales(model)
    return model


def load_safetensors(model_dir: str, cfg: ModelArchConfig, dtype) -> nnx.Module:
    """Builds the model from HF ``*.safetensors`` (sharded with an index or not).

    Raises:
      ModelLoadError: no weights file, a missing tensor (named), or a shape mismatch (naming the
        tensor, the expected and the found shapes). Extra tensors (e.g. rotary inv_freq) are ignored.
    """
    with SafetensorsReader(model_dir) as reader:
        return load_weights(cfg, dtype, reader)


def read_generation_config(model_dir: str) -> dict[str, Any]:
    """``generation_config.json`` as a dict, or {} when absent."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def eos_token_ids(generation_config: dict[str, Any], cfg: ModelArchConfig) -> tuple[int, ...]:
    """EOS ids: generation_config.json's ``eos_token_id`` (int or list) when set, else config.json's."""
    eos = generation_config.get("eos_token_id")
    if eos is None:
        return cfg.eos_token_ids
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def detect_load_format(model_dir: str) -> str:
    """ "orbax" when ``model_dir/params/`` exists, else "safetensors"."""
    return "orbax" if os.path.isdir(os.path.join(model_dir, PARAMS_DIR)) else "safetensors"


def _placement(cfg: ModelArchConfig, tensor_parallel_size: int | None, expert_parallel: bool):
    """``load_weights``' mesh keywords for ``tensor_parallel_size`` ({} without one); checks
    first that the model splits over it."""
    if tensor_parallel_size is None:
        return {}
    check_tensor_parallel(cfg, tensor_parallel_size, expert_parallel)
    return dict(mesh=make_mesh(tensor_parallel_size), enable_expert_parallel=expert_parallel)


def load_model(
    model_path: str | dict,
    dtype: str = "auto",
    load_format: str = "auto",
    seed: int = 0,
    quantization: str = "auto",
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int | None = None,
    enable_expert_parallel: bool = False,
) -> tuple[nnx.Module, ModelArchConfig, dict[str, Any]]:
    """Loads a model for serving.

    Args:
      model_path: a HF model directory, our orbax layout (``config.json`` + ``params/``), a
        ``.gguf`` file (``jaxserve.model.readers.gguf_reader``), or for
        ``load_format="dummy"`` also a HF config dict or a preset name from
        ``PRESET_HF_CONFIGS`` (e.g. "llama-3.1-8b").
      dtype: "auto" (config's torch_dtype), "float32" or "bfloat16".
      load_format: "auto" (gguf for a ``.gguf`` file, orbax if ``params/`` exists, else
        safetensors), "safetensors", "orbax", "gguf" or "dummy" (random weights, no weight files).
      seed: initialiser seed for "dummy".
      quantization: ``--quantization`` (``jaxserve.model.quant_config``): "auto", "none",
        "int8", "fp8", "compressed-tensors" or "gguf".
      kv_cache_dtype: ``--kv-cache-dtype``; an FP8 cache gives every attention layer its
        ``k_scale`` / ``v_scale`` (the checkpoint's, else 1.0).
      tensor_parallel_size: load straight onto the mesh of this many devices
        (``make_mesh``), each process reading only the slices its devices hold
        (``jaxserve.model.sharded_loader``); None: read whole onto the default device (the
        runner places it). Random weights (dummy) are always drawn whole.
      enable_expert_parallel: with ``tensor_parallel_size``, place experts whole per device.

    Returns:
      ``(model, ModelArchConfig, generation_config dict)``; the dict is ``{}`` when the directory
      has no generation_config.json (see ``eos_token_ids``).

    Raises:
      ModelLoadError (a ValueError): missing directory / config / weights (path named),
        unsupported architecture or quantization scheme (named, before any weight is read),
        missing tensor or shape mismatch (tensor named).
      ValueError: unknown dtype, load_format or kv_cache_dtype.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    kv_scales = kv_cache_dtype_name(kv_cache_dtype, "float32") != "float32"
    if load_format == "dummy" and not (isinstance(model_path, str) and os.path.isdir(model_path)):
        if isinstance(model_path, dict):
            hf = model_path
        elif model_path in PRESET_HF_CONFIGS:
            hf = PRESET_HF_CONFIGS[model_path]
        else:
            raise ModelLoadError(
                f"model directory not found: {model_path} (dummy presets: {', '.join(PRESET_HF_CONFIGS)})"
            )
        cfg = ModelArchConfig.from_hf_config(hf)
        quant = resolve_quantization(quantization, {}, False, fp8_matmul_supported())
        model = dummy_model(cfg, resolve_dtype(dtype, cfg), seed)
        return quantize_dummy(model, quant, kv_scales), cfg, {}
    if load_format == "gguf" or (load_format == "auto" and is_gguf_path(model_path)):
        path = os.fspath(model_path)
        quant = resolve_quantization(
            quantization, {}, True, fp8_matmul_supported(), jax.default_backend() != "cpu"
        )
        with GGUFFileReader(path) as reader:
            cfg = ModelArchConfig.from_hf_config(gguf_hf_config(reader.gguf, path))
            placement = _placement(cfg, tensor_parallel_size, enable_expert_parallel)
            model = load_weights(
                cfg, resolve_dtype(dtype, cfg), reader, quant, kv_scales, **placement
            )
            return model, cfg, gguf_generation_config(reader.gguf)
    model_dir = os.fspath(model_path)
    hf = read_hf_config(model_dir)
    quant = resolve_quantization(quantization, hf, False, fp8_matmul_supported())
    cfg = ModelArchConfig.from_hf_config(hf)
    jdtype = resolve_dtype(dtype, cfg)
    if load_format == "auto":
        load_format = detect_load_format(model_dir)
    placement = _placement(cfg, tensor_parallel_size, enable_expert_parallel)
    if load_format == "dummy":
        model = quantize_dummy(dummy_model(cfg, jdtype, seed), quant, kv_scales)
    elif load_format == "orbax":  # restored straight into jdtype (orbax casts on read)
        with OrbaxReader(model_dir, jdtype) as reader:
            model = load_weights(cfg, jdtype, reader, quant, kv_scales, **placement)
    else:
        with SafetensorsReader(model_dir) as reader:
            model = load_weights(cfg, jdtype, reader, quant, kv_scales, **placement)
    return model, cfg, read_generation_config(model_dir)
