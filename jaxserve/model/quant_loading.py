"""Loading quantized weights: which layers get which ``jaxserve.model.layers.quant`` method,
and reading each one's parameters by name.

Families stay unaware of quantization. For every ``Linear`` and ``Embedding`` of a model the
family already names its weight's tensor (``weight_source(<path>.weight)``); the method's other
tensors sit beside it under compressed-tensors' names (``<module>.weight_scale``,
``.input_scale``, ``.weight_packed``), and GGUF blocks are the weight tensor's own bytes.
``plan`` picks each layer's method (``quant_config.Quantization``: on-load int8 for every
projection and embedding, on-load fp8 for every projection (embedding and LM head wide), the
checkpoint's compressed-tensors groups, or each GGUF tensor's type); ``abstract_model`` builds the model with those layers' parameters swapped (shapes only);
``read_layer`` reads one layer's parameters. ``jaxserve.model.loader.load_weights`` drives them.

FP8 KV cache scales (``add_kv_scales``): each attention layer gets float32 ``k_scale`` /
``v_scale`` scalars, read from compressed-tensors' ``<attn>.k_scale`` / ``<attn>.v_scale`` (or
the older ``k_proj.output_scale`` / ``v_proj.output_scale``), 1.0 when the checkpoint has none.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.arch_config import ModelArchConfig, ModelLoadError
from jaxserve.model.layers.embedding import Embedding
from jaxserve.model.layers.linear import Linear
from jaxserve.model.layers.quant import BlockQuant, ChannelQuant, QuantMethod
from jaxserve.model.quant_config import GGUF_BLOCK_TYPES, GGUF_WIDE_TYPES, Quantization
from jaxserve.model.readers.base import CheckpointReader
from jaxserve.model.readers.gguf_blocks import decode_blocks
from jaxserve.model.registry import resolve_model_class
from jaxserve.model.weight_mapping import unpermute_qk

logger = logging.getLogger(__name__)

KV_SCALE_NAMES = ("k_scale", "v_scale")


def quantizable_layers(model: nnx.Module) -> dict[tuple, nnx.Module]:
    """{module path: layer} of every ``Linear`` and ``Embedding`` of ``model``."""
    return {
        tuple(path): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, (Linear, Embedding))
    }


def _wide_shape(layer) -> tuple[int, int]:
    """The layer's matrix in torch layout: ``[O, I]`` (Linear) or ``[v, e]`` (Embedding)."""
    if isinstance(layer, Linear):
        return math.prod(layer.out_shape), math.prod(layer.in_shape)
    return layer.vocab_size, layer.hidden_size


def _ours_shape(layer) -> tuple[int, ...]:
    """The layer's wide weight in our layout: ``[*in, *out]`` (Linear) or ``[v, e]``."""
    if isinstance(layer, Linear):
        return (*layer.in_shape, *layer.out_shape)
    return layer.vocab_size, layer.hidden_size


def plan(
    model: nnx.Module, cfg: ModelArchConfig, reader: CheckpointReader | None, quant: Quantization
) -> dict[tuple, QuantMethod]:
    """{module path: method} for the layers ``quant`` quantizes (the others stay wide).

    Args:
      model: the (abstract) model, wide.
      cfg: its architecture (for ``weight_source``).
      reader: the checkpoint (its tensors' names and stored types), or None for random weights.
      quant: the resolved quantization.

    Raises:
      ModelLoadError: a compressed-tensors layer whose stored weight is not the scheme's type.
    """
    layers = quantizable_layers(model)
    if quant.on_load is not None:
        emb = ChannelQuant(type(quant.on_load)(quant.on_load.weight_dtype))  # weight-only
        return {
            path: ChannelQuant(quant.on_load) if isinstance(layer, Linear) else emb
            for path, layer in layers.items()
            if isinstance(layer, Linear) or quant.on_load_embeddings
        }
    methods: dict[tuple, QuantMethod] = {}
    if reader is None or quant.method not in ("compressed-tensors", "gguf"):
        return methods
    kept: dict[str, int] = {}
    for path, layer in layers.items():
        source = model.weight_source((*path, "weight"), cfg, reader.naming)
        name = next((n for n in source.names if n in reader), source.name)
        if quant.method == "gguf":
            kind = reader.spec(name).dtype if name in reader else "F32"
            if kind in GGUF_BLOCK_TYPES:
                methods[path] = BlockQuant(kind.lower())
            elif kind not in GGUF_WIDE_TYPES:
                kept[kind] = kept.get(kind, 0) + 1
            continue
        if not isinstance(layer, Linear):
            continue
        module = name[: -len(".weight")]
        scheme = quant.compressed_tensors.scheme_for(module)
        if scheme is None:
            continue
        if scheme.group_size:
            scale = reader.spec(module + ".weight_scale").dtype
            methods[path] = BlockQuant("int8_group", scheme.group_size, scale)
        else:
            stored = reader.spec(name).dtype if name in reader else None
            if stored != scheme.weight_dtype:
                raise ModelLoadError(
                    f"tensor {name} is {stored}, but the compressed-tensors scheme "
                    f"{scheme.name} stores {scheme.weight_dtype}"
                )
            methods[path] = ChannelQuant(scheme)
    if kept:
        logger.info(
            "GGUF tensors dequantised on load (types not kept as blocks): %s",
            ", ".join(f"{k} x{n}" for k, n in sorted(kept.items())),
        )
    return methods


def attention_layers(model: nnx.Module) -> dict[tuple, nnx.Module]:
    """{module path: layer} of every module with ``k_proj`` and ``v_proj`` (self-attention)."""
    return {
        tuple(path): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Module) and hasattr(node, "k_proj") and hasattr(node, "v_proj")
    }


def add_kv_scales(model: nnx.Module) -> None:
    """Gives every attention layer float32 ``k_scale`` / ``v_scale`` scalars (1.0), in place:
    the per-tensor scales of an FP8 KV cache (``jaxserve.model.attention.paged_attention``)."""
    for layer in attention_layers(model).values():
        for name in KV_SCALE_NAMES:
            setattr(layer, name, nnx.Param(jnp.ones((), jnp.float32)))


def apply(model: nnx.Module, methods: dict[tuple, QuantMethod], kv_scales: bool) -> nnx.Module:
    """Swaps the planned layers' parameters for zero-filled quantized ones (and adds KV
    scales), in place; under ``nnx.eval_shape`` only their shapes exist."""
    layers = quantizable_layers(model)
    for path, method in methods.items():
        layers[path].set_quantization(method)
    if kv_scales:
        add_kv_scales(model)
    return model


def abstract_model(
    cfg: ModelArchConfig, dtype, methods: dict[tuple, QuantMethod], kv_scales: bool = False
) -> nnx.Module:
    """The model with ``methods`` applied, ``jax.ShapeDtypeStruct`` parameters only."""
    model_cls = resolve_model_class(cfg.architecture)
    return nnx.eval_shape(
        lambda: apply(model_cls(cfg, dtype=dtype, rngs=nnx.Rngs(0)), methods, kv_scales)
    )


@functools.partial(jax.jit, static_argnums=(0, 2))
def _quantize_linear(method: ChannelQuant, w: jax.Array, num_in: int) -> dict:
    return method.quantize(w, num_in)


@functools.partial(jax.jit, static_argnums=(0,))
def _quantize_embedding(method: ChannelQuant, w: jax.Array) -> dict:
    return method.quantize_embedding(w)


def quantize_layer(layer, method: ChannelQuant) -> None:
    """Quantizes a (real, wide) layer in place: random weights with ``--quantization``."""
    w = layer.weight[...]
    if isinstance(layer, Linear):
        values = _quantize_linear(method, w, layer.num_in_axes)
    else:
        values = _quantize_embedding(method, w)
    layer.set_quantization(method, values)


def _read_f32(reader: CheckpointReader, name: str) -> np.ndarray:
    return np.asarray(jnp.asarray(reader.read(name)).astype(jnp.float32))


def unpack_int32(packed: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """compressed-tensors' ``pack-quantized`` 8-bit values (four per int32 word, first value in
    the lowest byte, stored + 128) -> int8 ``shape``."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    b = (words[..., None] >> np.arange(0, 32, 8, dtype=np.uint32)) & 0xFF
    q = (b.astype(np.int16) - 128).astype(np.int8).reshape(words.shape[0], -1)
    return q[: shape[0], : shape[1]]


def read_layer(
    model: nnx.Module,
    path: tuple,
    layer,
    method: QuantMethod,
    cfg: ModelArchConfig,
    reader: CheckpointReader | None,
) -> dict[str, np.ndarray | jax.Array]:
    """One quantized layer's parameters, read (and, for on-load schemes, quantized).

    Returns:
      {param name: array} matching ``layer.quant_specs(method)``.

    Raises:
      ModelLoadError: a missing tensor or a stored shape that is not the layer's (named).
    """
    source = model.weight_source((*path, "weight"), cfg, reader.naming)
    name = next((n for n in source.names if n in reader), None)
    module = source.name[: -len(".weight")]
    packed = module + ".weight_packed"
    if name is None and packed in reader:
        name = packed
    if name is None:
        raise ModelLoadError(
            f"{reader.error_prefix}tensor {source.name} not found in {reader.where}"
        )
    rows, cols = _wide_shape(layer)
    ours = _ours_shape(layer)
    is_linear = isinstance(layer, Linear)
    if name != packed:
        got = reader.spec(name).shape
        want = source.layout.stored_shape(ours)
        if got != want:
            raise ModelLoadError(
                f"{reader.error_prefix}shape mismatch for tensor {name}: expected {list(want)}, "
                f"got {list(got)} in {reader.where}"
            )
    if isinstance(method, BlockQuant):
        if method.fmt == "int8_group":
            if name == packed:
                shape = tuple(int(d) for d in np.asarray(reader.read(module + ".weight_shape")))
                q = unpack_int32(np.asarray(reader.read(packed)), shape)
            else:
                q = np.asarray(reader.read(name))
            arrays = {
                "weight": q,
                "weight_scale": np.asarray(reader.read(module + ".weight_scale")),
            }
        else:
            arrays = decode_blocks(np.asarray(reader.read_blocks(name)), method.fmt.upper())
        if source.layout.permuted_heads:
            arrays = {k: unpermute_qk(v, source.layout.permuted_heads) for k, v in arrays.items()}
        return arrays
    if reader.spec(name).dtype == method.scheme.weight_dtype:
        # pre-quantized (compressed-tensors): weight as stored, scales beside it
        w = source.layout.to_ours(jnp.asarray(reader.read(name)), ours)
        scale = _read_f32(reader, module + ".weight_scale").reshape(-1)
        if scale.size == 1:
            scale = np.broadcast_to(scale, (rows,))
        values = {"weight": w, "weight_scale": jnp.asarray(scale.reshape(layer.out_shape))}
        if method.scheme.activations == "static":
            values["input_scale"] = jnp.asarray(_read_f32(reader, module + ".input_scale").max())
        return values
    # wide tensor quantized on load
    w = jnp.asarray(reader.read(name)).astype(jnp.float32)
    w = source.layout.to_ours(w, ours)
    if is_linear:
        return _quantize_linear(method, w, layer.num_in_axes)
    return _quantize_embedding(method, w)


class LayerReads:
    """The parameters of quantized layers and FP8 KV scales, each layer's read once (whole) on
    first use and handed out by parameter path; the loaders ask it first for every parameter.

    Args:
      model: the abstract model (``abstract_model`` with ``methods`` applied).
      cfg, reader: as ``read_layer``.
      methods: the quantization plan (``plan``).
      kv_scales: the attention layers carry FP8 KV scales.
    """

    def __init__(self, model, cfg: ModelArchConfig, reader, methods: dict, kv_scales: bool):
        self.model, self.cfg, self.reader, self.methods = model, cfg, reader, methods
        self.layers = quantizable_layers(model)
        self.attention = attention_layers(model) if kv_scales else {}
        self.read: dict[tuple, dict] = {}  # layer or attention path -> its parameters

    def pop(self, path: tuple):
        """Parameter ``path``'s value (numpy or jax) when a quantized layer or a KV scale holds
        it, else None (the family's ``weight_source`` says where it is)."""
        owner, leaf = tuple(path[:-1]), path[-1]
        if not (owner in self.methods or (owner in self.attention and leaf in KV_SCALE_NAMES)):
            return None
        if owner not in self.read:
            self.read[owner] = (
                read_layer(
                    self.model,
                    owner,
                    self.layers[owner],
                    self.methods[owner],
                    self.cfg,
                    self.reader,
                )
                if owner in self.methods
                else read_kv_scales(self.model, owner, self.cfg, self.reader)
            )
        return self.read[owner].pop(leaf, None)


def read_kv_scales(
    model: nnx.Module, path: tuple, cfg: ModelArchConfig, reader: CheckpointReader | None
) -> dict[str, jax.Array]:
    """An attention layer's ``k_scale`` / ``v_scale`` (float32 scalars) from a Hugging Face
    checkpoint (compressed-tensors' names), or 1.0 each when absent."""
    out = {}
    for name in KV_SCALE_NAMES:
        value = 1.0
        if reader is not None and reader.naming == "hf":
            proj = "k_proj" if name == "k_scale" else "v_proj"
            weight = model.weight_source((*path, proj, "weight"), cfg, "hf").name
            attn = weight[: -len(f".{proj}.weight")]
            for candidate in (f"{attn}.{name}", f"{attn}.{proj}.output_scale"):
                if candidate in reader:
                    value = float(_read_f32(reader, candidate).max())
                    break
        out[name] = jnp.asarray(value, jnp.float32)
    return out


def estimate_weight_bytes(
    cfg: ModelArchConfig,
    dtype,
    quantization: Quantization,
    reader: CheckpointReader | None = None,
) -> int:
    """Device bytes the weights of ``cfg`` will take under ``quantization``, from the config
    alone (shapes only, nothing allocated; a GGUF file's per-tensor types need its ``reader``).
    What a planner sizes memory with before loading anything."""
    wide = abstract_model(cfg, dtype, {})
    return weight_bytes(abstract_model(cfg, dtype, plan(wide, cfg, reader, quantization)))


def weight_bytes(model: nnx.Module) -> int:
    """Device bytes of ``model``'s parameters (abstract or real), every shard counted once."""
    return sum(
        math.prod(x.shape) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(nnx.state(model, nnx.Param))
    )
