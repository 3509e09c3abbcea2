"""Feed-forward layers."""

from __future__ import annotations

import functools

import jax
from flax import nnx

from jaxserve.model.layers.linear import Linear
from jaxserve.model.layers.lora import LoraBatch

ACTIVATIONS = {
    "silu": jax.nn.silu,  # SwiGLU (Llama, Mistral, Qwen)
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),  # GeGLU (Gemma)
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
}
"""Gate activations by Hugging Face's ``hidden_act`` / ``hidden_activation`` name:
``gelu_pytorch_tanh`` is torch's ``gelu(approximate="tanh")``, ``gelu`` the exact erf form."""


class GatedMLP(nnx.Module):
    """Gated feed-forward (Shazeer 2020): ``down(act(gate(x)) * up(x))``; SwiGLU with silu,
    GeGLU with a GELU.

    Parameters: ``gate_proj``, ``up_proj`` (``[e, f]``, axes ("embed", "mlp")) and
    ``down_proj`` (``[f, e]``), each a ``Linear`` with an optional bias.

    Args:
      hidden_size, intermediate_size: e and f.
      bias: the three projections have biases (Llama ``mlp_bias``).
      dtype: parameter dtype (``jnp.float32`` or ``jnp.bfloat16``).
      rngs: initialiser keys, drawn for gate, up, down in that order.
      activation: a key of ``ACTIVATIONS`` (KeyError otherwise; ``ModelArchConfig`` has
        checked the config's name).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool,
        dtype,
        rngs: nnx.Rngs,
        activation: str = "silu",
    ):
        e, f = hidden_size, intermediate_size
        self.activation = activation
        kw = dict(bias=bias, dtype=dtype, rngs=rngs)
        self.gate_proj = Linear(e, f, in_axes=("embed",), out_axes=("mlp",), **kw)
        self.up_proj = Linear(e, f, in_axes=("embed",), out_axes=("mlp",), **kw)
        self.down_proj = Linear(f, e, in_axes=("mlp",), out_axes=("embed",), **kw)

    def __call__(self, x: jax.Array, lora: LoraBatch | None = None) -> jax.Array:
        """``x [..., e]`` -> ``[..., e]`` in the model dtype; ``lora``: the step's adapter
        batch (``PagedAttentionMetadata.lora``), None for none."""
        act = ACTIVATIONS[self.activation]
        h = act(self.gate_proj(x, lora)) * self.up_proj(x, lora)
        return self.down_proj(h, lora)
