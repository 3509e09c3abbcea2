"""Feed-forward layers."""

from __future__ import annotations

import jax
from flax import nnx

from jaxserve.model.layers.linear import Linear


class GatedMLP(nnx.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``.

    Parameters: ``gate_proj``, ``up_proj`` (``[e, f]``, axes ("embed", "mlp")) and
    ``down_proj`` (``[f, e]``), each a ``Linear`` with an optional bias.

    Args:
      hidden_size, intermediate_size: e and f.
      bias: the three projections have biases (Llama ``mlp_bias``).
      dtype: parameter dtype (``jnp.float32`` or ``jnp.bfloat16``).
      rngs: initialiser keys, drawn for gate, up, down in that order.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, bias: bool, dtype, rngs: nnx.Rngs
    ):
        e, f = hidden_size, intermediate_size
        kw = dict(bias=bias, dtype=dtype, rngs=rngs)
        self.gate_proj = Linear(e, f, in_axes=("embed",), out_axes=("mlp",), **kw)
        self.up_proj = Linear(e, f, in_axes=("embed",), out_axes=("mlp",), **kw)
        self.down_proj = Linear(f, e, in_axes=("mlp",), out_axes=("embed",), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [..., e]`` -> ``[..., e]`` in the model dtype."""
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
