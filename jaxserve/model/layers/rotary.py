"""Rotary position embeddings (Su et al. 2021, "RoFormer"), in Hugging Face's rotate-half layout.

HF Llama checkpoints store q/k projection rows permuted so that the two halves of each head's
vector form the rotation pairs (``rotate_half``), not interleaved neighbours; we follow that.
RoPE types (``RopeConfig.rope_type``): "default", "linear" (positions divided by ``factor``),
"llama3" (Llama 3.1's frequency-dependent scaling).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from jaxserve.model.arch_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Per-pair inverse frequencies, float32 ``[head_dim // 2]``.

    Follows transformers' ``modeling_rope_utils``: "default", "linear" (divide by ``factor``) and
    "llama3" (``_compute_llama3_parameters``: long wavelengths divided by ``factor``, short ones
    kept, a smooth interpolation in between).
    """
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv_freq = inv_freq.astype(np.float32)
    if rope.rope_type == "linear":
        return (inv_freq / rope.factor).astype(np.float32)
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
    """Rotates ``x`` by its positions.

    Args:
      x: ``[..., T, H, D]`` queries or keys, any float dtype.
      positions: int32 ``[..., T]`` token positions (broadcast over heads).
      inv_freq: float32 ``[D // 2]`` from ``inverse_frequencies``.

    Returns:
      ``x``'s shape and dtype; angles, cos and sin are computed in float32, as HF does before
      casting cos/sin to the activation dtype.
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., T, 1, D]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


@dataclasses.dataclass(frozen=True)
class RotaryEmbedding:
    """The rotary embedding of one attention layer: its RoPE parameters and head dim.

    Hashable and array-free, so a layer keeps it as a static attribute (part of the model's
    graph definition, not of its state); the frequencies are numpy constants computed when the
    step is traced. A family whose layers use different RoPE bases (Gemma 3: local and global)
    gives each layer its own.
    """

    rope: RopeConfig
    head_dim: int

    def __call__(self, x: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
        """``apply_rope(x, positions, inverse_frequencies(rope, head_dim))``: x ``[..., T, H, D]``,
        positions int32 ``[..., T]`` -> x's shape and dtype."""
        return apply_rope(x, positions, inverse_frequencies(self.rope, self.head_dim))
