"""The Llama-family model: HF config parsing, the Flax NNX model, attention dispatch, loading.

Importing this package is cheap and jax-free (the engine config calls ``default_model_path``);
the heavy names below are imported on first use.
"""

from __future__ import annotations

import importlib
import os

from jaxserve.model.config import SUPPORTED_ARCHITECTURES, ModelArchConfig, ModelLoadError
from jaxserve.model.presets import PRESET_HF_CONFIGS

_LAZY = {
    "LlamaForCausalLM": "jaxserve.model.llama",
    "PagedAttentionMetadata": "jaxserve.model.attention",
    "load_model": "jaxserve.model.loader",
    "eos_token_ids": "jaxserve.model.loader",
    "convert": "jaxserve.model.checkpoint",
    "save_params": "jaxserve.model.checkpoint",
}

__all__ = [
    "PRESET_HF_CONFIGS",
    "SUPPORTED_ARCHITECTURES",
    "ModelArchConfig",
    "ModelLoadError",
    "default_model_path",
    *_LAZY,
]


def default_model_path() -> str:
    """The bundled checkpoint, ``<repo>/checkpoints/tiny-llama`` (it may not exist yet)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(repo, "checkpoints", "tiny-llama")


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
