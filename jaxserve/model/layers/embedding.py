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
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.weight = logical_param(rngs, (vocab_size, hidden_size), dtype, ("vocab", "embed"))

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """int32 token ids ``[...]`` -> ``[..., e]`` in the parameter dtype."""
        return jnp.take(self.weight[...], input_ids, axis=0)

    def attend(self, hidden: jax.Array) -> jax.Array:
        """``hidden [..., e]`` -> float32 logits ``[..., v]`` (accumulated in float32)."""
        return jnp.einsum(
            "...e,ve->...v", hidden, self.weight[...], preferred_element_type=jnp.float32
        )
