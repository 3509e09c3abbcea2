"""Normalisation layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.layers.params import logical_param


class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019): normalise in float32, cast back, scale by ``weight [dim]``.

    Args:
      dim: the normalised (last) axis' size.
      eps: added to the mean square.
      dtype: the weight's dtype.
      axis: the weight's logical axis name ("embed", or "head_dim" for per-head q/k norms).
    """

    def __init__(self, dim: int, eps: float, dtype, axis: str = "embed"):
        self.eps = eps
        self.weight = logical_param(None, (dim,), dtype, (axis,), init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [..., dim]`` -> ``[..., dim]`` in the model dtype; normalised in float32 and cast
        back before the scale by ``weight``, HF ``LlamaRMSNorm``'s order."""
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return xf.astype(x.dtype) * self.weight[...]
