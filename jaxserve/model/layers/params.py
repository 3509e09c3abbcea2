"""Creating a model parameter that carries its logical axis names.

Every parameter of every layer is made here, so each one names its axes ("embed", "q_heads",
"mlp", ...) in its ``out_sharding`` metadata; ``jaxserve.model.sharding`` maps those names to
mesh axes. Initialisation follows Hugging Face's: weights ~ N(0, ``INIT_STD``), norms 1,
biases 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

INIT_STD = 0.02  # HF initializer_range


def logical_param(
    rngs: nnx.Rngs | None,
    shape: tuple[int, ...],
    dtype,
    axes: tuple[str, ...],
    init: str = "normal",
) -> nnx.Param:
    """A parameter of ``shape`` and ``dtype`` whose axes are named ``axes`` (one per dim).

    Args:
      rngs: draws the "normal" initialiser (one ``rngs.params()`` key); unused otherwise.
      init: "normal" (N(0, 0.02)), "ones" or "zeros".
    """
    assert len(shape) == len(axes), (shape, axes)
    if init == "normal":
        value = INIT_STD * jax.random.normal(rngs.params(), shape, dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        value = jnp.zeros(shape, dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)
