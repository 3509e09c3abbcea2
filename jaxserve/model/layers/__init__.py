"""Layers shared by every model family: ``Linear`` (the one seam for quantized and LoRA
matmuls), ``RMSNorm``, rotary embeddings, ``GatedMLP``, ``Embedding`` (lookup and LM head)
and ``SelfAttention`` (projections around ``jaxserve.model.attention``). A family module
(``jaxserve.model.models``) composes them; it re-implements none of them."""
