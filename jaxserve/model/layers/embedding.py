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

    Args:
      vocab_size, hidden_size: v and e.
      dtype: the parameter (model) dtype.
      rngs: initialiser keys.
      scale: the lookup's rows are multiplied by this, rounded to the model dtype first
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
        self.dtype = jnp.dtype(dtype)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.quant: QuantMethod | None = None
        self.quant_params: tuple[str, ...] = ()
        self.weight = logical_param(rngs, (vocab_size, hidden_size), dtype, ("vocab", "embed"))
        self.scale = scale

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """int32 token ids ``[...]`` -> ``[..., e]`` in the model dtype (times ``scale``)."""
        if self.quant is not None:
            x = self.quant.embedding_rows(self._quant_values(), input_ids, self.dtype)
        else:
            x = jnp.take(self.weight[...], input_ids, axis=0)
        return x if self.scale is None else x * jnp.asarray(self.scale, self.dtype)

    def attend(self, hidden: jax.Array, *, soft_cap: float | None = None) -> jax.Array:
        """``hidden [..., e]`` -> float32 logits ``[..., v]`` (accumulated in float32), then
        ``soft_cap * tanh(logits / soft_cap)`` when ``soft_cap`` is given (Gemma 2's
        ``final_logit_softcapping``)."""
        if self.quant is not None:
            logits = self.quant.embedding_logits(self._quant_values(), hidden)
        else:
            logits = jnp.einsum(
                "...e,ve->...v", hidden, self.weight[...], preferred_element_type=jnp.float32
            )
        return logits if soft_cap is None else soft_cap * jnp.tanh(logits / soft_cap)

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
