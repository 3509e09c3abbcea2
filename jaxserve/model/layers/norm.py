"""Normalisation layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.layers.params import logical_param


class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019): normalise in float32, scale by ``weight [dim]``.

    Two conventions, as Hugging Face stores them:

    * Llama (``unit_offset=False``): cast back to the model dtype, then multiply by ``weight``
      (initialised to 1), HF ``LlamaRMSNorm``'s order.
    * Gemma (``unit_offset=True``): multiply by ``1 + weight`` in float32, then cast back
      (``weight`` initialised to 0; HF ``Gemma2RMSNorm`` / ``Gemma3RMSNorm``). In float32 the
      orders agree; in bfloat16 they round differently, so each follows its reference.

    Args:
      dim: the normalised (last) axis' size.
      eps: added to the mean square.
      dtype: the weight's dtype.
      axis: the weight's logical axis name ("embed", or "head_dim" for per-head q/k norms).
      unit_offset: scale by ``1 + weight`` (Gemma) instead of ``weight``.
    """

    def __init__(self, dim: int, eps: float, dtype, axis: str = "embed", unit_offset: bool = False):
        self.eps = eps
        self.unit_offset = unit_offset
        init = "zeros" if unit_offset else "ones"
        self.weight = logical_param(None, (dim,), dtype, (axis,), init=init)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [..., dim]`` -> ``[..., dim]`` in x's dtype (see the class docstring for where
        the cast happens)."""
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return xf.astype(x.dtype) * self.weight[...]
