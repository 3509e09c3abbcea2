"""Token embedding and LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.layers.params import logical_param


class Embedding(nnx.Module):
    """A ``[vocab, embed]`` matrix read two ways: row lookup (the token embedding) and a
    product with hidden states (the LM head, float32 logits).

    A model with tied embeddings calls ``attend`` on its token embedding; an untied one holds a
    second ``Embedding`` as ``lm_head``. Parameter: ``weight [v, e]``, axes ("vocab", "embed")
    (vocabulary rows split over the tensor-parallel mesh), Hugging Face's layout; random
    initialisation draws one key.

    Args:
      vocab_size, hidden_size: v and e.
      dtype: the parameter dtype.
      rngs: initialiser keys.
      scale: the lookup's rows are multiplied by this, rounded to the parameter dtype first
        (Gemma's ``sqrt(hidden_size)``, which HF casts to the weight dtype: 55.4256 -> 55.5 in
        bfloat16); None: no scale. ``attend`` never scales.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype,
        rngs: nnx.Rngs,
        scale: float | None = None,
    ):
        self.weight = logical_param(rngs, (vocab_size, hidden_size), dtype, ("vocab", "embed"))
        self.scale = scale

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """int32 token ids ``[...]`` -> ``[..., e]`` in the parameter dtype (times ``scale``)."""
        w = self.weight[...]
        x = jnp.take(w, input_ids, axis=0)
        return x if self.scale is None else x * jnp.asarray(self.scale, w.dtype)

    def attend(self, hidden: jax.Array, *, soft_cap: float | None = None) -> jax.Array:
        """``hidden [..., e]`` -> float32 logits ``[..., v]`` (accumulated in float32), then
        ``soft_cap * tanh(logits / soft_cap)`` when ``soft_cap`` is given (Gemma 2's
        ``final_logit_softcapping``)."""
        logits = jnp.einsum(
            "...e,ve->...v", hidden, self.weight[...], preferred_element_type=jnp.float32
        )
        return logits if soft_cap is None else soft_cap * jnp.tanh(logits / soft_cap)
