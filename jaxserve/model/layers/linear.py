"""``Linear``: the one layer every projection of every model family multiplies through.

Quantized weights (#31) and LoRA adapters (#33) change how a projection multiplies and nothing
else, so both plug in here, not into the families: q/k/v/o and gate/up/down of the Llama
family are ``Linear`` layers, and a new family builds its projections from it too. The LM head
is not a ``Linear`` (it shares its matrix with the embedding lookup when tied; see
``embedding.py``).

The seam's contract, for the two features that will use it (neither is built yet):

* **Quantized weights** (#31: ``--quantization``, compressed-tensors, GGUF kept quantized): the
  layer will keep ``weight`` narrow (int8, float8_e4m3fn, or packed GGUF blocks, same logical
  axes) beside a ``weight_scale`` parameter (per output channel: ``[*out_shape]`` with
  ``out_axes``; per block for GGUF) and dequantize inside ``project``, in the jitted step (a
  mixed-precision ``dot_general`` then the scale, or widen then dot). ``__call__``'s signature,
  shapes and dtypes stay as they are, so no caller changes. The loader fills both parameters by
  name (the family's ``weight_source`` names ``<proj>.weight_scale``), and ``repeat_output`` /
  ``repeat_input`` repeat the scales with the weight.
* **LoRA adapters** (#33): ``__call__(x, lora=None)`` will take the step's adapter batch, which
  the family passes to each projection from the step's metadata (carried beside
  ``PagedAttentionMetadata``): each token's adapter slot (int32 ``[T]``, -1 for the base model),
  the permutation that sorts tokens by slot and the group sizes (``[max_loras]``). The layer
  then holds ``lora_a [max_loras, *in_shape, r]`` and ``lora_b [max_loras, r, *out_shape]``
  (zero-padded to ``max_lora_rank``) and adds ``scale * ragged_dot(ragged_dot(x_sorted,
  lora_a), lora_b)``, unsorted, to ``y`` before the bias. ``lora=None`` (a base-only step, or
  no ``--enable-lora``) adds no operation.

Today the plain path below is the whole layer: one ``einsum`` and an optional bias add. It
compiles to the flops of the per-projection einsums it replaced; o_proj now contracts its
(heads, head_dim) axes in order, which saves two transposes per layer (bytes accessed -2.3%
for the bundled model's paged step at 64 tokens).
"""

from __future__ import annotations

import functools
import string

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.layers.params import logical_param


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
    (``[*out_shape]``, axes ``out_axes``) or None. Random initialisation draws one key, for
    ``weight`` (N(0, 0.02)); the bias starts at 0.

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
        self.weight = logical_param(rngs, (*in_shape, *out_shape), dtype, (*in_axes, *out_axes))
        self.bias = (
            logical_param(None, out_shape, dtype, tuple(out_axes), "zeros") if bias else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [..., *in_shape]`` -> ``[..., *out_shape]``: ``project(x)`` plus the bias."""
        y = self.project(x)
        return y if self.bias is None else y + self.bias[...]

    def project(self, x: jax.Array) -> jax.Array:
        """The matmul alone, ``x [..., *in_shape]`` -> ``[..., *out_shape]`` (what a quantized
        weight replaces)."""
        w = self.weight[...]
        return jnp.einsum(_equation(self.num_in_axes, w.ndim - self.num_in_axes), x, w)

    def repeat_output(self, axis: int, repeats: int) -> None:
        """Repeats each index of output axis ``axis`` (0 = the first output axis) ``repeats``
        times in the weight and bias, in place: tensor parallelism's KV-head (and query-head)
        replication. Output ``j`` becomes outputs ``j * repeats ... j * repeats + repeats - 1``."""
        self.weight.set_value(jnp.repeat(self.weight[...], repeats, axis=self.num_in_axes + axis))
        if self.bias is not None:
            self.bias.set_value(jnp.repeat(self.bias[...], repeats, axis=axis))

    def repeat_input(self, axis: int, repeats: int) -> None:
        """Repeats each index of input axis ``axis`` ``repeats`` times in the weight, in place,
        zeroing every copy but the first: for an input whose copies are equal (replicated query
        heads) the output is the same sum."""
        w = jnp.repeat(self.weight[...], repeats, axis=axis)
        first = (jnp.arange(w.shape[axis]) % repeats == 0).astype(w.dtype)
        self.weight.set_value(w * first.reshape((-1,) + (1,) * (w.ndim - axis - 1)))
