"""jaxserve: an LLM inference server on JAX/XLA.

    from jaxserve import LLM, SamplingParams

The names below are imported on first use, so ``import jaxserve`` stays cheap (no jax).
"""

from __future__ import annotations

import importlib

_LAZY = {
    "LLM": "jaxserve.engine.llm",
    "LLMEngine": "jaxserve.engine.llm_engine",
    "EngineArgs": "jaxserve.config",
    "SamplingParams": "jaxserve.sampling_params",
    "RequestOutput": "jaxserve.request_output",
    "CompletionOutput": "jaxserve.request_output",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
