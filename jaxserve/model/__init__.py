"""Models: HF config parsing, the registry of families, shared layers, attention dispatch, loading.

Importing this package is cheap and jax-free (the engine config calls ``default_model_path``);
the heavy names below are imported on first use.
"""

from __future__ import annotations

import importlib

from jaxserve.model.arch_config import ModelArchConfig, ModelLoadError
from jaxserve.model.presets import PRESET_HF_CONFIGS
from jaxserve.model.registry import register_model, supported_architectures
from jaxserve.model.resolve import (
    DEMO_MODEL_NAME,
    default_model_path,
    demo_model_path,
    resolve_model_path,
)

_LAZY = {
    "LlamaForCausalLM": "jaxserve.model.models.llama",
    "PagedAttentionMetadata": "jaxserve.model.attention",
    "load_model": "jaxserve.model.loader",
    "eos_token_ids": "jaxserve.model.loader",
    "convert": "jaxserve.model.checkpoint",
    "save_params": "jaxserve.model.checkpoint",
}

__all__ = [
    "PRESET_HF_CONFIGS",
    "register_model",
    "supported_architectures",
    "ModelArchConfig",
    "ModelLoadError",
    "DEMO_MODEL_NAME",
    "default_model_path",
    "demo_model_path",
    "resolve_model_path",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
