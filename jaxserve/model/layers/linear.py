"""``Linear``: the one layer every projection of every model family multiplies through.

Quantized weights (#31) and LoRA adapters (#33) change how a projection multiplies and nothing
else, so both plug in here, not into the families: q/k/v/o and gate/up/down of the Llama
family are ``Linear`` layers, and a new family builds its projections from it too. The LM head
is not a ``Linear`` (it shares its matrix with the embedding lookup when tied; see
``embedding.py``).

The seam's contract, for the two features that use it:

* **Quantized weights** (#31, built: ``jaxserve.model.layers.quant``): ``set_quantization``
  swaps ``weight`` for a narrow representation of the same matrix (int8 or float8_e4m3fn in our
  ``[*in, *out]`` layout with a per-output-channel ``weight_scale``; or GGUF / grouped blocks in
  the checkpoint's ``[O, I]`` orientation with block scales), and ``project`` multiplies
  through it inside the jitted step. ``__call__``'s signature, shapes and dtypes stay as they
  are, so no caller changes. The loader (``jaxserve.model.quant_loading``) picks each layer's
  method and fills its parameters by name from the weight's own source (``<proj>.weight_scale``
  beside ``<proj>.weight``); ``repeat_output`` / ``repeat_input`` repeat the scales with the
  weight.
* **LoRA adapters** (#33, built: ``jaxserve.model.layers.lora``): ``enable_lora`` gives the
  layer a device pool ``lora_a [max_loras, *in_shape, R]`` / ``lora_b [max_loras, R,
  *out_shape]`` (zeros; an adapter of rank r < R fills the first r columns, scaling folded into
  B; axes the base weight's, so adapters shard like their base layer). ``__call__(x, lora)``
  takes the step's ``LoraBatch`` (carried in ``PagedAttentionMetadata.lora``; the attention
  and MLP layers hand it on) and adds ``lora_delta(x, lora_a, lora_b, lora)`` to ``project``'s
  output before the bias. ``lora=None`` (a step without adapter tokens, or no
  ``--enable-lora``) adds no operation. A quantized base weight changes nothing here: the
  delta is added to ``project``'s output, whatever represents the base weight.

* **Packed panels** (#32, CPU only: ``pack_panels``): a float32 weight re-laid as
  ``[ceil(N / 32), K, 32]`` column panels for our C++ matmul (``jaxserve.model.cpu_kernels``),
  which reads it at the memory's pace for the few rows of a decode or verification step where
  XLA's dot slows with every row. ``place_model`` packs them on a one-device CPU mesh, after
  every other transform of the weight (head replication is for meshes; LoRA pools stay as
  they are: the delta adds to ``project``'s output).

Without quantization the layer is one ``einsum`` and an optional bias add. It
compiles to the flops of the per-projection einsums it replaced; o_proj now contracts its
(heads, head_dim) axes in order, which saves two transposes per layer (bytes accessed -2.3%
for the bundled model's paged step at 64 tokens).
"""

from __future__ import annotations

import functools
import math
import string

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model import cpu_kernels
from jaxserve.model.layers.lora import LoraBatch, lora_delta
from jaxserve.model.layers.params import logical_param
from jaxserve.model.layers.quant import BlockQuant, ChannelQuant, QuantMethod


def _shape(dims: int | tuple[int, ...]) -> tuple[int, ...]:
    return (dims,) if isinstance(dims, int) else tuple(dims)


@functools.cache
def _equation(num_in: int, num_out: int) -> str:
    """``"...ab,abc->...c"`` for 2 input and 1 output axes: x's trailing input axes contract
    with the weight's leading ones."""
    letters = string.ascii_lowercase[: num_in + num_out]
    ins, outs = letters[:num_in], letters[num_in:]
    return f"...{ins},{ins}{outs}->...{outs}"


class Linear(nnx.Module):
    """``y = x · W (+ b)`` over several input and output axes.

    ``W`` is stored ``[*in_shape, *out_shape]`` (input axes first; torch stores ``[out, in]``),
    so attention projections keep heads apart: q_proj ``[e, h, d]``, o_proj ``[h, d, e]``.
    Parameters, Hugging Face's names: ``weight`` (axes ``in_axes + out_axes``) and ``bias``
    (``[*out_shape]``, axes ``out_axes``) or None; with a quantized weight
    (``set_quantization``) the method's parameters instead of ``weight`` (``weight``,
    ``weight_scale``, ...; see ``jaxserve.model.layers.quant``). Random initialisation draws
    one key, for ``weight`` (N(0, 0.02)); the bias starts at 0.

    Args:
      in_shape, out_shape: an int or a tuple each.
      in_axes, out_axes: logical axis names, one per dim (see ``jaxserve.model.sharding``).
      bias: add a bias.
      dtype: parameter dtype; the output has x's dtype promoted with it (the model dtype).
      rngs: initialiser keys.
    """

    def __init__(
        self,
        in_shape: int | tuple[int, ...],
        out_shape: int | tuple[int, ...],
        *,
        in_axes: tuple[str, ...],
        out_axes: tuple[str, ...],
        bias: bool = False,
        dtype,
        rngs: nnx.Rngs,
    ):
        in_shape, out_shape = _shape(in_shape), _shape(out_shape)
        self.num_in_axes = len(in_shape)
        self.in_shape, self.out_shape = in_shape, out_shape
        self.in_axes, self.out_axes = tuple(in_axes), tuple(out_axes)
        self.quant: QuantMethod | None = None  # static: how a quantized weight multiplies
        self.quant_params: tuple[str, ...] = ()
        self.packed = False  # static: weight is pack_panels' [P, K, 32] (CPU kernel)
        self.weight = logical_param(rngs, (*in_shape, *out_shape), dtype, (*in_axes, *out_axes))
        self.bias = (
            logical_param(None, out_shape, dtype, tuple(out_axes), "zeros") if bias else None
        )
        self.lora_a: nnx.Param | None = nnx.data(None)  # [max_loras, *in_shape, R] (enable_lora)
        self.lora_b: nnx.Param | None = nnx.data(None)  # [max_loras, R, *out_shape]

    def __call__(self, x: jax.Array, lora: LoraBatch | None = None) -> jax.Array:
        """``x [..., *in_shape]`` -> ``[..., *out_shape]``: ``project(x)``, plus the adapters'
        delta when ``lora`` is given and the layer has a pool, plus the bias."""
        y = self.project(x)
        if lora is not None and self.lora_a is not None:
            y = y + lora_delta(x, self.lora_a[...], self.lora_b[...], lora).astype(y.dtype)
        return y if self.bias is None else y + self.bias[...]

    def enable_lora(self, max_loras: int, max_rank: int, dtype) -> None:
        """Adds the zeroed adapter pool ``lora_a`` / ``lora_b`` of ``max_loras`` slots of rank
        ``max_rank`` in ``dtype``, in place (axes: the base weight's, unsharded slot and rank)."""
        self.lora_a = logical_param(
            None, (max_loras, *self.in_shape, max_rank), dtype, (None, *self.in_axes, None), "zeros"
        )
        self.lora_b = logical_param(
            None,
            (max_loras, max_rank, *self.out_shape),
            dtype,
            (None, None, *self.out_axes),
            "zeros",
        )

    def project(self, x: jax.Array) -> jax.Array:
        """The matmul alone, ``x [..., *in_shape]`` -> ``[..., *out_shape]`` in x's dtype
        (what a quantized weight replaces)."""
        if self.packed:
            lead = x.shape[: x.ndim - self.num_in_axes]
            n = math.prod(self.out_shape)
            y = cpu_kernels.panel_matmul(
                x.reshape(-1, math.prod(self.in_shape)), self.weight[...], n
            )
            # the einsum's dtype: x's promoted with the float32 weight's
            out = jnp.promote_types(x.dtype, self.weight.dtype)
            return y.astype(out).reshape(*lead, *self.out_shape)
        if self.quant is None:
            w = self.weight[...]
            return jnp.einsum(_equation(self.num_in_axes, w.ndim - self.num_in_axes), x, w)
        params = {name: getattr(self, name)[...] for name in self.quant_params}
        if isinstance(self.quant, ChannelQuant):
            return self.quant.project(params, x, self.num_in_axes)
        return self.quant.project(params, x, self.in_shape, self.out_shape)

    def can_pack_panels(self) -> bool:
        """Whether ``pack_panels`` applies: a wide float32 weight, not packed yet."""
        return not self.packed and self.quant is None and self.weight[...].dtype == jnp.float32

    def pack_panels(self) -> None:
        """Re-lays the weight as ``cpu_kernels.pack_panels`` of its ``[K, N]`` matrix, in place
        (host copy, then the device): ``project`` then calls ``cpu_kernels.panel_matmul``.
        Call it last: ``repeat_output`` / ``repeat_input`` and quantization expect the
        ``[*in, *out]`` weight.

        Raises:
          ValueError: ``can_pack_panels()`` is False.
        """
        if not self.can_pack_panels():
            raise ValueError("pack_panels: only a wide float32 weight, packed once, packs")
        w = self.weight[...]
        k = math.prod(self.in_shape)
        packed = cpu_kernels.pack_panels(np.asarray(w).reshape(k, -1))
        self.weight = nnx.Param(
            jax.device_put(packed, w.sharding),
            out_sharding=(None, None, None),
            eager_sharding=False,
        )
        self.packed = True

    def quant_specs(self, method: QuantMethod) -> dict[str, tuple]:
        """{name: (shape, dtype, logical axes)} of this layer's parameters under ``method``."""
        if isinstance(method, ChannelQuant):
            return method.param_specs(self.in_shape, self.out_shape, self.in_axes, self.out_axes)
        rows, cols = math.prod(self.out_shape), math.prod(self.in_shape)
        return method.param_specs(rows, cols, (self.out_axes[0], self.in_axes[0]))

    def set_quantization(self, method: QuantMethod, values: dict | None = None) -> None:
        """Replaces ``weight`` by ``method``'s parameters, in place: ``values`` ({name: array},
        e.g. ``method.quantize(weight)``) or zeros of their specs (under ``nnx.eval_shape``:
        shapes only, for the loader to fill)."""
        specs = self.quant_specs(method)
        for name, (shape, dtype, axes) in specs.items():
            value = jnp.zeros(shape, dtype) if values is None else values[name]
            setattr(self, name, nnx.Param(value, out_sharding=axes, eager_sharding=False))
        self.quant, self.quant_params = method, tuple(specs)

    def output_axes(self, axis: int) -> dict[str, int]:
        """{parameter name: its axis} of output axis ``axis`` in the unquantized weight and the
        bias (what ``repeat_output(axis, ...)`` repeats)."""
        out = {"weight": self.num_in_axes + axis}
        if self.bias is not None:
            out["bias"] = axis
        return out

    def repeat_output(self, axis: int, repeats: int) -> None:
        """Repeats each index of output axis ``axis`` (0 = the first output axis) ``repeats``
        times in the weight and bias, in place: tensor parallelism's KV-head (and query-head)
        replication. Output ``j`` becomes outputs ``j * repeats ... j * repeats + repeats - 1``."""
        if isinstance(self.quant, BlockQuant):  # every array's rows are the flat outputs
            for name in self.quant_params:
                x = getattr(self, name)[...]
                x = x.reshape(*self.out_shape, x.shape[-1])
                getattr(self, name).set_value(
                    jnp.repeat(x, repeats, axis=axis).reshape(-1, x.shape[-1])
                )
        else:
            self.weight.set_value(
                jnp.repeat(self.weight[...], repeats, axis=self.num_in_axes + axis)
            )
            if self.quant is not None:
                self.weight_scale.set_value(jnp.repeat(self.weight_scale[...], repeats, axis))
        if self.bias is not None:
            self.bias.set_value(jnp.repeat(self.bias[...], repeats, axis=axis))
        if self.lora_b is not None:  # [L, R, *out]
            self.lora_b.set_value(jnp.repeat(self.lora_b[...], repeats, axis=2 + axis))
        out = list(self.out_shape)
        out[axis] *= repeats
        self.out_shape = tuple(out)

    def repeat_input(self, axis: int, repeats: int) -> None:
        """Repeats each index of input axis ``axis`` ``repeats`` times in the weight, in place,
        zeroing every copy but the first: for an input whose copies are equal (replicated query
        heads) the output is the same sum.

        Raises:
          ValueError: a block-quantized weight (GGUF; not needed: more devices than query
            heads happens only for tiny models), naming the way out.
        """
        if isinstance(self.quant, BlockQuant):
            raise ValueError(
                "tensor_parallel_size larger than the query heads with GGUF blocks kept "
                "quantized is not supported; use --quantization none"
            )
        w = jnp.repeat(self.weight[...], repeats, axis=axis)
        first = (jnp.arange(w.shape[axis]) % repeats == 0).reshape(
            (-1,) + (1,) * (w.ndim - axis - 1)
        )
        self.weight.set_value(jnp.where(first, w, jnp.zeros((), w.dtype)))
        if self.lora_a is not None:  # [L, *in, R]: the same copies, the same zeros
            a = jnp.repeat(self.lora_a[...], repeats, axis=1 + axis)
            self.lora_a.set_value(jnp.where(first[..., None], a, jnp.zeros((), a.dtype)))
        shape = list(self.in_shape)
        shape[axis] *= repeats
        self.in_shape = tuple(shape)
