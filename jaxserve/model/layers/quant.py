"""Quantized weights at the ``Linear`` / ``Embedding`` seam: how each kind is stored on the
device and how it multiplies, inside the jitted step.

Two families of storage, each a static (hashable) method object a layer keeps as an attribute
beside its parameters:

* ``ChannelQuant``: int8 or float8_e4m3fn ``weight`` in our layout ``[*in, *out]`` (the same
  shape and logical axes as a wide weight, so tensor-parallel sharding and head replication are
  unchanged) and a float32 ``weight_scale [*out]`` per output channel. ``--quantization int8``
  / ``fp8`` and compressed-tensors' per-channel and per-tensor schemes. The matmul is a
  mixed-precision ``dot_general`` with float32 accumulation, then the scale:
  weight-only: ``(x · W) * s_w``; with activation quantization (W8A8) ``x`` is quantised too,
  per token (dynamic) or with the checkpoint's ``input_scale`` (static), and both operands are
  narrow: ``(q(x) · W) * s_x * s_w`` (int8 x int8 -> int32, fp8 x fp8 -> float32: what the
  H100/H200's FP8 tensor cores run). ``--quantization fp8`` picks its activation scheme by
  device as vLLM does (``fp8_matmul_supported``): W8A8 dynamic where fp8 matmuls exist, else
  weight-only (W8A16); its embedding and LM head stay wide (``jaxserve.model.quant_config``).
* ``BlockQuant``: GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) and compressed-tensors' grouped
  INT8 W8A16, in the checkpoint's ``[O, I]`` orientation (blocks run along the input), as
  int8 / packed 4-bit bytes plus their block scales (``jaxserve.model.readers.gguf_blocks``
  decodes GGUF's block bytes into these arrays on load). The step widens the whole matrix block
  by block (``dequantize``: the same float32 arithmetic as gguf-py's dequantisation, so the
  logits equal the dequantise-on-load path's up to summation order) and multiplies it.

Why our own and not qwix (Google's JAX quantization library): qwix quantizes a model by
intercepting its ``dot_general`` / ``einsum`` calls under a provider and keeps weights as its own
``QArray`` pytrees. It calibrates and quantizes itself but reads no checkpoint format: none of
compressed-tensors' names and packings, and no GGUF block (Q4_K's 6-bit sub-block scales and
mins, Q6_K's split low/high bits have no qwix representation), which are most of this issue.
With one ``Linear`` seam the interception buys nothing, and the arithmetic we need (a
mixed-precision ``dot_general``, per-channel scales, per-token activation scales) is a few lines
here, while qwix would add a dependency pinned to its own flax. We follow its design where it
fits (per-channel scales on the contracting dims' complement, absmax calibration, quantised
operands fed straight to ``dot_general``).

LoRA (#33) composes: a quantized weight is only another representation of the base weight
(``project``); an adapter's delta is added to ``project``'s output by the layer.
"""

from __future__ import annotations

import dataclasses
import math
import string
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:  # quant_config imports arch_config, which reaches the families by name
    from jaxserve.model.quant_config import WeightScheme

FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
INT8_MAX = 127.0


def fp8_matmul_supported(device=None) -> bool:
    """Whether ``device`` (default: the first JAX device) multiplies fp8 by fp8 natively, the
    test vLLM makes to choose FP8 W8A8 over weight-only FP8 (``has_device_capability(89)``): a
    CUDA GPU of compute capability 8.9 or more (Ada, Hopper: H100/H200, Blackwell). CPU, TPU and
    older GPUs get False: there ``--quantization fp8`` is FP8 W8A16, the weight widened in the
    matmul (quantising activations to fp8 there buys no speed and costs accuracy)."""
    device = jax.devices()[0] if device is None else device
    if device.platform not in ("gpu", "cuda"):
        return False
    cap = getattr(device, "compute_capability", None)
    try:
        major, minor = (int(v) for v in str(cap).split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (8, 9)


def _qmax(dtype) -> float:
    return INT8_MAX if jnp.dtype(dtype) == jnp.int8 else float(jnp.finfo(dtype).max)


def divide_once(a: jax.Array, b) -> jax.Array:
    """``a / b`` rounded once, as torch (and numpy) divide. XLA rewrites a division by a
    broadcast divisor (a per-token scale, a constant) into a product with the divisor's
    reciprocal, two roundings; with compressed-tensors' symmetric int8 range (+-127.5) every
    token's largest |x| lands exactly on a rounding tie, so that 1-ulp difference turned some
    tokens' -128 into -127 and left the INT8 W8A8 fixture 0.072 logits from compressed-tensors'
    reference (1.2e-6 with one rounding). Adding ``0 * a`` makes the divisor full-shape, which
    XLA does not rewrite; it fuses into the same elementwise loop. (Exact on CPU and GPU; a TPU
    divides approximately anyway.)"""
    return a / (b + 0.0 * a)


def quantize_to(x: jax.Array, scale: jax.Array, dtype, exact: bool = False) -> jax.Array:
    """``x / scale`` in ``dtype`` (int8: rounded to nearest; fp8: saturated to its largest
    finite value, as float8_e4m3fn has no infinity and an overflowing cast gives NaN);
    ``exact``: the division rounded once (``divide_once``; activations, to match
    compressed-tensors' quantization at rounding ties)."""
    x = x.astype(jnp.float32)
    y = divide_once(x, scale) if exact else x / scale
    if jnp.dtype(dtype) == jnp.int8:
        return jnp.clip(jnp.round(y), -128, 127).astype(dtype)
    qmax = _qmax(dtype)
    return jnp.clip(y, -qmax, qmax).astype(dtype)


def _einsum(num_in: int, num_out: int) -> str:
    letters = string.ascii_lowercase[: num_in + num_out]
    ins, outs = letters[:num_in], letters[num_in:]
    return f"...{ins},{ins}{outs}->...{outs}"


@dataclasses.dataclass(frozen=True)
class ChannelQuant:
    """Narrow ``weight [*in, *out]`` with ``weight_scale [*out]`` (float32), plus
    ``input_scale []`` for static activation scales (see the module docstring).

    Attributes:
      scheme: weight dtype and activation quantization.
    """

    scheme: WeightScheme

    def param_specs(self, in_shape, out_shape, in_axes, out_axes) -> dict[str, tuple]:
        """{name: (shape, dtype, logical axes)} of the layer's parameters."""
        specs = {
            "weight": (
                (*in_shape, *out_shape),
                jnp.dtype(self.scheme.weight_dtype),
                in_axes + out_axes,
            ),
            "weight_scale": (tuple(out_shape), jnp.float32, tuple(out_axes)),
        }
        if self.scheme.activations == "static":
            specs["input_scale"] = ((), jnp.float32, ())
        return specs

    def project(self, params: dict, x: jax.Array, num_in: int) -> jax.Array:
        """``x [..., *in]`` -> ``[..., *out]`` in x's dtype; accumulated in float32 (int32 for
        int8 x int8)."""
        w, w_scale = params["weight"], params["weight_scale"]
        eq = _einsum(num_in, w.ndim - num_in)
        acts = self.scheme.activations
        if acts == "none":
            y = jnp.einsum(eq, x, w.astype(x.dtype), preferred_element_type=jnp.float32)
            return (y * w_scale).astype(x.dtype)
        in_axes = tuple(range(x.ndim - num_in, x.ndim))
        if acts == "dynamic":  # one scale per token: max |x| over its inputs
            amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=in_axes, keepdims=True)
            # compressed-tensors' symmetric range: half the int8 span (127.5), fp8's max
            half = 127.5 if w.dtype == jnp.int8 else _qmax(w.dtype)
            x_scale = divide_once(jnp.maximum(amax, 1e-12), half)
        else:
            x_scale = params["input_scale"].astype(jnp.float32)
        xq = quantize_to(x, x_scale, w.dtype, exact=True)
        acc = jnp.int32 if w.dtype == jnp.int8 else jnp.float32
        y = jnp.einsum(eq, xq, w, preferred_element_type=acc).astype(jnp.float32)
        if acts == "dynamic":
            x_scale = x_scale.reshape(x_scale.shape[: x.ndim - num_in] + (1,) * (w.ndim - num_in))
        return (y * x_scale * w_scale).astype(x.dtype)

    def quantize(self, w: jax.Array, num_in: int) -> dict[str, jax.Array]:
        """A wide weight ``[*in, *out]`` -> {weight, weight_scale}: absmax per output channel.
        Both divisions are rounded once (``divide_once``), as numpy and torch divide: XLA's
        product with a reciprocal gave 1-ulp different scales in 55% of SmolLM2's channels and
        changed 20,861 of its 106M fp8 codes, and cost fp8 0.14 points of perplexity (+1.05%
        against +0.91%, benchmarks/RESULTS.md). The fp8 cast rounds to nearest even."""
        amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=tuple(range(num_in)))
        scale = divide_once(jnp.maximum(amax, 1e-12), _qmax(self.scheme.weight_dtype))
        return {
            "weight": quantize_to(w, scale, self.scheme.weight_dtype, exact=True),
            "weight_scale": scale,
        }

    # The embedding's [v, e] matrix: one scale per vocabulary row (its "output channel").
    def embedding_specs(self, vocab: int, hidden: int) -> dict[str, tuple]:
        return {
            "weight": ((vocab, hidden), jnp.dtype(self.scheme.weight_dtype), ("vocab", "embed")),
            "weight_scale": ((vocab,), jnp.float32, ("vocab",)),
        }

    def quantize_embedding(self, w: jax.Array) -> dict[str, jax.Array]:
        """``[v, e]`` -> {weight, weight_scale [v]}."""
        q = self.quantize(w.T, 1)
        return {"weight": q["weight"].T, "weight_scale": q["weight_scale"]}

    def embedding_rows(self, params: dict, ids: jax.Array, dtype) -> jax.Array:
        rows = jnp.take(params["weight"], ids, axis=0).astype(jnp.float32)
        return (rows * jnp.take(params["weight_scale"], ids)[..., None]).astype(dtype)

    def embedding_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        w = params["weight"].astype(hidden.dtype)
        y = jnp.einsum("...e,ve->...v", hidden, w, preferred_element_type=jnp.float32)
        return y * params["weight_scale"]


# Block formats: per format, (block size, {param: (bytes or elements per block, dtype)}).
# ``weight`` counts bytes of packed 4-bit values or int8 elements per block; scales one entry
# per block (per sub-block of 32 or 16 for the K-quants, per super-block of 256 for ``super_*``).
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "int8_group")


@dataclasses.dataclass(frozen=True)
class BlockQuant:
    """Block-scaled weights in ``[O, I]`` orientation (see the module docstring).

    Attributes:
      fmt: one of ``BLOCK_FORMATS``.
      group_size: inputs per scale for "int8_group" (32 for q8_0, fixed by the format).
      scale_dtype: dtype of "int8_group"'s scales (the checkpoint's).

    Parameters (``O`` rows, ``I`` inputs):
      q8_0, int8_group: weight int8 [O, I], weight_scale [O, I / g]
      q4_0: weight uint8 [O, I / 2] (per 32-block: byte j holds elements j and j + 16, low
        nibble first), weight_scale float16 [O, I / 32]; value (q - 8) * d
      q4_1: as q4_0 plus weight_min float16 [O, I / 32]; value q * d + m
      q4_k: weight uint8 [O, I / 2] (per 64 elements: byte j holds j and j + 32),
        weight_scale / weight_min uint8 [O, I / 32] (6-bit sub-block scale and min),
        weight_super_scale / weight_super_min float16 [O, I / 256]; value d*sc*q - dmin*m
      q6_k: weight int8 [O, I] (q - 32), weight_scale int8 [O, I / 16],
        weight_super_scale float16 [O, I / 256]; value d * sc * q
    """

    fmt: str
    group_size: int = 32
    scale_dtype: str = "float16"

    def __post_init__(self):
        if self.fmt not in BLOCK_FORMATS:
            raise ValueError(f"fmt must be one of {BLOCK_FORMATS}, got {self.fmt!r}")

    @property
    def block(self) -> int:
        """Inputs per stored block (the row length must be a multiple)."""
        return {"q4_k": 256, "q6_k": 256, "int8_group": self.group_size}.get(self.fmt, 32)

    def param_specs(self, rows: int, cols: int, axes: tuple) -> dict[str, tuple]:
        """{name: (shape, dtype, logical axes)} for a ``[rows, cols]`` matrix with blocks along
        ``cols``; ``axes``: the two logical names."""
        f, i8, u8, f16 = self.fmt, jnp.int8, jnp.uint8, jnp.float16
        n32 = cols // 32
        spec = {
            "q8_0": {"weight": (cols, i8), "weight_scale": (n32, f16)},
            "int8_group": {
                "weight": (cols, i8),
                "weight_scale": (cols // self.group_size, jnp.dtype(self.scale_dtype)),
            },
            "q4_0": {"weight": (cols // 2, u8), "weight_scale": (n32, f16)},
            "q4_1": {
                "weight": (cols // 2, u8),
                "weight_scale": (n32, f16),
                "weight_min": (n32, f16),
            },
            "q4_k": {
                "weight": (cols // 2, u8),
                "weight_scale": (n32, u8),
                "weight_min": (n32, u8),
                "weight_super_scale": (cols // 256, f16),
                "weight_super_min": (cols // 256, f16),
            },
            "q6_k": {
                "weight": (cols, i8),
                "weight_scale": (cols // 16, i8),
                "weight_super_scale": (cols // 256, f16),
            },
        }[f]
        return {name: ((rows, n), dtype, tuple(axes)) for name, (n, dtype) in spec.items()}

    def dequantize(self, p: dict) -> jax.Array:
        """The parameters -> float32 ``[..., O, I]`` (leading axes: rows picked by a gather)."""
        f32 = jnp.float32
        w = p["weight"]
        lead = w.shape[:-1]
        if self.fmt in ("q8_0", "int8_group"):
            g = self.block
            q = w.reshape(*lead, -1, g).astype(f32)
            return (q * p["weight_scale"].astype(f32)[..., None]).reshape(*lead, -1)
        if self.fmt in ("q4_0", "q4_1"):
            b = w.reshape(*lead, -1, 16)
            q = jnp.concatenate([b & 0x0F, b >> 4], axis=-1).astype(f32)  # [.., nb, 32]
            d = p["weight_scale"].astype(f32)[..., None]
            if self.fmt == "q4_0":
                return (d * (q - 8.0)).reshape(*lead, -1)
            return (d * q + p["weight_min"].astype(f32)[..., None]).reshape(*lead, -1)
        if self.fmt == "q4_k":
            b = w.reshape(*lead, -1, 4, 1, 32)  # super-blocks, 4 chunks of 64 = 32 bytes
            q = jnp.concatenate([b & 0x0F, b >> 4], axis=-2).reshape(*lead, -1, 8, 32).astype(f32)
            sc = p["weight_scale"].reshape(*lead, -1, 8).astype(f32)
            mn = p["weight_min"].reshape(*lead, -1, 8).astype(f32)
            d = p["weight_super_scale"].astype(f32)[..., None] * sc
            dm = p["weight_super_min"].astype(f32)[..., None] * mn
            return (d[..., None] * q - dm[..., None]).reshape(*lead, -1)
        # q6_k
        q = w.reshape(*lead, -1, 16, 16).astype(f32)
        sc = p["weight_scale"].reshape(*lead, -1, 16).astype(f32)
        d = p["weight_super_scale"].astype(f32)[..., None] * sc
        return (d[..., None] * q).reshape(*lead, -1)

    def project(self, params: dict, x: jax.Array, in_shape, out_shape) -> jax.Array:
        """``x [..., *in]`` -> ``[..., *out]`` in x's dtype: the matrix widened to x's dtype in
        the step, then one dot with float32 accumulation."""
        w = self.dequantize(params).astype(x.dtype)  # [O, I]
        lead = x.shape[: x.ndim - len(in_shape)]
        xf = x.reshape(*lead, math.prod(in_shape))
        y = jnp.einsum("...i,oi->...o", xf, w, preferred_element_type=jnp.float32)
        return y.astype(x.dtype).reshape(*lead, *out_shape)

    def embedding_rows(self, params: dict, ids: jax.Array, dtype) -> jax.Array:
        rows = {k: jnp.take(v, ids, axis=0) for k, v in params.items()}
        return self.dequantize(rows).astype(dtype)

    def embedding_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        w = self.dequantize(params).astype(hidden.dtype)
        return jnp.einsum("...e,ve->...v", hidden, w, preferred_element_type=jnp.float32)


QuantMethod = ChannelQuant | BlockQuant


def nbytes_of(specs: dict[str, tuple]) -> int:
    """Bytes of the parameters ``param_specs`` describes."""
    return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype, _ in specs.values())
