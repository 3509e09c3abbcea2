"""The model registry: Hugging Face ``architectures`` names -> the family class that runs them.

Each entry names a module and a class as strings; the module is imported only when a checkpoint
asks for one of its architectures (vLLM's ``model_executor/models/registry.py``), so this module,
and the config parsing and path checks that consult it, stay jax-free. Adding a family is one
module under ``jaxserve/model/models/`` and one line in ``_MODELS`` (docs/ADDING_A_MODEL.md); a
plugin adds one at run time with ``register_model``.

A family class is a Flax NNX module with (``jaxserve.model.models.llama.LlamaForCausalLM`` and
``jaxserve.model.models.gemma.GemmaForCausalLM``; the forward passes come from their base,
``jaxserve.model.layers.causal_lm.CausalLM``):

    Cls(config: ModelArchConfig, *, dtype, rngs: nnx.Rngs)     random weights of the config
    model(input_ids [T], positions [T], kv_caches, metadata) -> (hidden [T, e], kv_caches)
    model.compute_logits(hidden [..., e]) -> float32 [..., v]
    model.forward_dense(input_ids [B, L]) -> float32 [B, L, v]   (the dense oracle, parity)
    Cls.weight_source(path, config, naming) -> TensorSource     (checkpoint name and layout of
                                                                 each parameter)
    model.config, model.dtype
"""

from __future__ import annotations

import importlib

_LLAMA = "jaxserve.model.models.llama"
_GEMMA = "jaxserve.model.models.gemma"
_MOE = "jaxserve.model.models.mixtral"
_MODELS: dict[str, tuple[str, str]] = {
    # HF architecture: (module, class)
    "LlamaForCausalLM": (_LLAMA, "LlamaForCausalLM"),
    "MistralForCausalLM": (_LLAMA, "LlamaForCausalLM"),
    "Qwen2ForCausalLM": (_LLAMA, "LlamaForCausalLM"),
    "Qwen3ForCausalLM": (_LLAMA, "LlamaForCausalLM"),
    "Gemma2ForCausalLM": (_GEMMA, "GemmaForCausalLM"),
    "Gemma3ForCausalLM": (_GEMMA, "GemmaForCausalLM"),
    "Gemma3ForConditionalGeneration": (_GEMMA, "GemmaForCausalLM"),  # its language model
    "MixtralForCausalLM": (_MOE, "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": (_MOE, "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": (_MOE, "Qwen3MoeForCausalLM"),
    # base models without an LM head (embedding checkpoints; --runner pooling): their
    # *ForCausalLM's switches (``arch_config.causal_lm_name``)
    "LlamaModel": (_LLAMA, "LlamaForCausalLM"),
    "MistralModel": (_LLAMA, "LlamaForCausalLM"),
    "Qwen2Model": (_LLAMA, "LlamaForCausalLM"),
    "Qwen3Model": (_LLAMA, "LlamaForCausalLM"),
}

# Added by register_model: a class, or "package.module:Class" imported on first use.
_PLUGINS: dict[str, type | str] = {}


def register_model(architecture: str, model_cls: type | str) -> None:
    """Serves ``architecture`` (a HF ``architectures[0]`` name) with ``model_cls``, replacing a
    built-in entry of that name (tpu-inference's ``register_model``).

    The checkpoint's config.json must still parse as a ``ModelArchConfig`` (the Llama family's
    fields and switches); its weights are named by ``model_cls.weight_source``.

    Args:
      architecture: e.g. "MyLlamaForCausalLM".
      model_cls: the class, or ``"package.module:Class"`` (imported when first loaded).

    Raises:
      ValueError: an empty name, or a string that is not ``module:Class``.
    """
    if not architecture:
        raise ValueError("architecture must be a non-empty string")
    if isinstance(model_cls, str) and model_cls.count(":") != 1:
        raise ValueError(f"model_cls must be a class or 'package.module:Class', got {model_cls!r}")
    _PLUGINS[architecture] = model_cls


def supported_architectures() -> tuple[str, ...]:
    """Every architecture name a checkpoint may declare: the built-in ones in their order, then
    the registered ones."""
    return tuple(dict.fromkeys([*_MODELS, *_PLUGINS]))


def resolve_model_class(architecture: str) -> type:
    """The class serving ``architecture``, importing its module on first use.

    Raises:
      KeyError: ``architecture`` is not supported (``ModelArchConfig.from_hf_config`` has
        already refused such a config with a ModelLoadError listing the supported ones).
    """
    if architecture in _PLUGINS:
        entry = _PLUGINS[architecture]
        if not isinstance(entry, str):
            return entry
        module, name = entry.split(":")
    else:
        module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
