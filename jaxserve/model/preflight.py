"""Checks of a model path before anything heavy (jax import, weight loading, compilation).

The CLI commands run ``check_model_path`` first, so a wrong path, a directory without weights
or without a tokenizer, or an unsupported architecture is reported in one line within a second
instead of after a minute of loading and compiling. Jax-free.
"""

from __future__ import annotations

import glob
import os

from jaxserve.model.arch_config import ModelArchConfig, ModelLoadError, read_hf_config
from jaxserve.model.presets import PRESET_HF_CONFIGS
from jaxserve.model.quant_config import resolve_quantization


def check_model_path(
    path: str, load_format: str = "auto", need_tokenizer: bool = True, quantization: str = "auto"
) -> int:
    """Checks that ``path`` can be loaded with ``load_format`` and ``quantization`` (a
    checkpoint's unsupported quantization scheme is named here, before any weight is read) and
    returns the model's ``max_position_embeddings`` (what the engine config is resolved
    against).

    Args:
      path: a HF / orbax model directory, a ``.gguf`` file, or (dummy) a preset name.
      load_format: the ``--load-format`` flag.
      need_tokenizer: also require tokenizer files (``serve`` and ``generate`` take text).
      quantization: the ``--quantization`` flag.

    Raises:
      ModelLoadError (a ValueError): the message names what is missing and what to do.
    """
    from jaxserve.model.readers.gguf_reader import gguf_hf_config, is_gguf_path, open_gguf

    if load_format == "dummy" and not os.path.isdir(path):
        if path not in PRESET_HF_CONFIGS:
            raise ModelLoadError(
                f"model directory not found: {path} (dummy presets: {', '.join(PRESET_HF_CONFIGS)})"
            )
        resolve_quantization(quantization, {}, False)
        return ModelArchConfig.from_hf_config(PRESET_HF_CONFIGS[path]).max_position_embeddings
    if load_format == "gguf" or is_gguf_path(path):
        resolve_quantization(quantization, {}, True)
        reader = open_gguf(path)  # parsed once per process: the loader reuses it
        cfg = ModelArchConfig.from_hf_config(gguf_hf_config(reader, path))
        if need_tokenizer and "tokenizer.ggml.tokens" not in reader.fields:
            raise ModelLoadError(f"no tokenizer found: {path} has no tokenizer.ggml.tokens")
        return cfg.max_position_embeddings
    if os.path.isfile(path):
        raise ModelLoadError(
            f"model path {path} is a file: pass a model directory (config.json + weights) "
            "or a .gguf file"
        )
    hf = read_hf_config(path)  # names a missing dir / config
    cfg = ModelArchConfig.from_hf_config(hf)
    resolve_quantization(quantization, hf, False)
    has_params = os.path.isdir(os.path.join(path, "params"))
    has_safetensors = bool(glob.glob(os.path.join(path, "*.safetensors")))
    if load_format == "orbax" and not has_params:
        raise ModelLoadError(f"orbax params directory not found: {os.path.join(path, 'params')}")
    if load_format in ("auto", "safetensors") and not (
        has_safetensors or (load_format == "auto" and has_params)
    ):
        raise ModelLoadError(
            f"no *.safetensors weights file in model directory {path} "
            "(--load-format dummy serves random weights of its config)"
        )
    if need_tokenizer and not any(
        os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer.model")
    ):
        raise ModelLoadError(
            f"no tokenizer found: model directory {path} has no tokenizer.json or "
            "tokenizer.model; copy the tokenizer files of the original model into it"
        )
    return cfg.max_position_embeddings
