"""Token embedding and LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.layers.params import logical_param
from jaxserve.model.layers.quant import ChannelQuant, QuantMethod


class Embedding(nnx.Module):
    """A ``[vocab, embed]`` matrix read two ways: row lookup (the token embedding) and a
    product with hidden states (the LM head, float32 logits).

    A model with tied embeddings calls ``attend`` on its token embedding; an untied one holds a
    second ``Embedding`` as ``lm_head``. Parameter: ``weight [v, e]``, axes ("vocab", "embed")
    (vocabulary rows split over the tensor-parallel mesh), Hugging Face's layout; random
    initialisation draws one key. Quantized (``set_quantization``): an int8 / fp8 matrix with
    one scale per vocabulary row, or GGUF blocks along ``e`` (``jaxserve.model.layers.quant``);
    rows are widened after the lookup, the whole matrix for ``attend``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(dtype)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.quant: QuantMethod | None = None
        self.quant_params: tuple[str, ...] = ()
        self.weight = logical_param(rngs, (vocab_size, hidden_size), dtype, ("vocab", "embed"))

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """int32 token ids ``[...]`` -> ``[..., e]`` in the model dtype."""
        if self.quant is not None:
            return self.quant.embedding_rows(self._quant_values(), input_ids, self.dtype)
        return jnp.take(self.weight[...], input_ids, axis=0)

    def attend(self, hidden: jax.Array) -> jax.Array:
        """``hidden [..., e]`` -> float32 logits ``[..., v]`` (accumulated in float32)."""
        if self.quant is not None:
            return self.quant.embedding_logits(self._quant_values(), hidden)
        return jnp.einsum(
            "...e,ve->...v", hidden, self.weight[...], preferred_element_type=jnp.float32
        )

    def _quant_values(self) -> dict:
        return {name: getattr(self, name)[...] for name in self.quant_params}

    def quant_specs(self, method: QuantMethod) -> dict[str, tuple]:
        """{name: (shape, dtype, logical axes)} of the parameters under ``method``."""
        vocab, hidden = self.vocab_size, self.hidden_size
        if isinstance(method, ChannelQuant):
            return method.embedding_specs(vocab, hidden)
        return method.param_specs(vocab, hidden, ("vocab", "embed"))

    def set_quantization(self, method: QuantMethod, values: dict | None = None) -> None:
        """As ``Linear.set_quantization``: ``weight`` replaced by ``method``'s parameters."""
        specs = self.quant_specs(method)
        for name, (shape, dtype, axes) in specs.items():
            value = jnp.zeros(shape, dtype) if values is None else values[name]
            setattr(self, name, nnx.Param(value, out_sharding=axes, eager_sharding=False))
        self.quant, self.quant_params = method, tuple(specs)
