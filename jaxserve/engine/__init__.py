"""Engines: ``LLMEngine`` (synchronous step loop) and ``LLM`` (offline batched generation).

Imported lazily so ``import jaxserve.engine`` does not pull in jax.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "LLMEngine": "jaxserve.engine.llm_engine",
    "EngineStats": "jaxserve.stats_schema",
    "LLM": "jaxserve.engine.llm",
    "AsyncLLM": "jaxserve.engine.async_llm",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
