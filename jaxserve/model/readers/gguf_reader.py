"""GGUF checkpoints (llama.cpp's one-file format), read with the ``gguf`` package.

A ``.gguf`` file carries the config (metadata keys ``{arch}.block_count``, ...), the weights
(possibly quantised) and the tokenizer (vocabulary, merges, special ids, chat template). We map
the metadata onto a Hugging Face style ``config.json`` dict (``gguf_hf_config``), so
``ModelArchConfig.from_hf_config`` stays the one parser of model shapes; the family module
names each parameter's GGUF tensor and layout (``weight_source(..., "gguf")``, including
llama.cpp's q/k row permutation, undone because our RoPE is HF's rotate-half).

``GGUFFileReader`` reads tensors by GGUF name. Quantised tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q2_K..Q6_K, ...) are dequantised with ``gguf.quants.dequantize`` to float32 on the host; the
loader casts them to the requested dtype. A slice (``read(name, index)``) dequantises the
whole tensor, then slices (GGUF blocks run along rows, so a row slice could be cut from the
quantised bytes first). Importing this module is jax-free (the CLI checks paths with it before
loading anything heavy).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxserve.model.arch_config import ModelLoadError
from jaxserve.model.readers.base import CheckpointReader, TensorSpec
from jaxserve.model.weight_mapping import normalize_index

GGUF_SUFFIX = ".gguf"
# general.architecture -> HF architecture. Mistral GGUFs say "llama".
_ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",  # a multimodal Gemma 3's GGUF holds its language model
}
# Block counts of the 27B Gemmas, whose attention scale llama.cpp takes from hidden / heads
# (query_pre_attn_scalar 144 and 168) where the others use head_dim: GGUF has no key for it.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# GGUF architectures of the Llama layout, whose q bias means Llama's ``attention_bias``.
_LLAMA_ARCHS = ("llama", "mistral")


def is_gguf_path(path: Any) -> bool:
    """True when ``path`` is a string naming a ``.gguf`` file (existing or not)."""
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).lower().endswith(GGUF_SUFFIX)


def gguf_module():
    """The ``gguf`` package; ModelLoadError saying how to install it when it is missing."""
    try:
        import gguf
    except ImportError:
        raise ModelLoadError(
            "loading a .gguf file needs the gguf package: pip install 'jaxserve[gguf]'"
        ) from None
    return gguf


def open_gguf(path: str):
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped), parsed once per process and file
    version: the model loader and the tokenizer share it (parsing a 50k-token vocabulary
    takes the gguf package seconds).

    Raises:
      ModelLoadError: the file is missing, the gguf package is missing, or the file is not GGUF.
    """
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path}")
    st = os.stat(path)
    return _open_gguf(os.path.realpath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int):
    gguf = gguf_module()
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e


def field(reader, key: str, default: Any = None) -> Any:
    """The value of metadata ``key`` (str, number, bool or list), or ``default`` when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_hf_config(reader, path: str = "") -> dict[str, Any]:
    """The GGUF metadata as a Hugging Face ``config.json`` dict.

    ``torch_dtype`` (what ``--dtype auto`` picks) is "bfloat16" for F16/BF16 files and
    "float32" otherwise: quantised weights dequantise to float32 exactly.

    Gemma (``gemma2``, ``gemma3``): the soft caps, sliding window and its pattern, and the
    local RoPE base are read where the file has them, with llama.cpp's defaults otherwise
    (caps 50 / 30, window 4,096, every 2nd / 6th layer global, local base 10,000);
    ``query_pre_attn_scalar``, which GGUF does not carry, follows llama.cpp (hidden / heads for
    the 27B models, head_dim otherwise).

    Raises:
      ModelLoadError: an architecture we do not serve, per-layer head counts, or RoPE scaling
        we do not implement (naming the key).
    """
    arch = field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)}"
        )

    def req(key: str) -> Any:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        if isinstance(value, list):
            raise ModelLoadError(f"{path}: per-layer {arch}.{key} is not supported")
        return value

    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    kv_heads = field(reader, f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ModelLoadError(f"{path}: per-layer {arch}.attention.head_count_kv is not supported")
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(
            f"{path}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 scaling) are not "
            "supported for GGUF; load the Hugging Face safetensors checkpoint instead"
        )
    hf: dict[str, Any] = {
        "architectures": [_ARCHS[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "vocab_size": int(field(reader, f"{arch}.vocab_size", len(tokens)) or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(req("feed_forward_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(req("context_length")),
        "rms_norm_eps": _f32(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch in _LLAMA_ARCHS and "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ModelLoadError(f"{path}: unsupported {arch}.rope.scaling.type {scaling!r}")
        hf["rope_scaling"] = {
            "rope_type": "linear",
            "factor": _f32(req("rope.scaling.factor")),
        }
    window = field(reader, f"{arch}.attention.sliding_window")
    if window:
        hf["sliding_window"] = int(window)
        hf["use_sliding_window"] = True
    if arch in _GEMMA_27B_LAYERS:
        hf.update(_gemma_fields(reader, arch, hf))
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    hf["torch_dtype"] = "bfloat16" if kinds and kinds <= {"F16", "BF16"} else "float32"
    return hf


def _gemma_fields(reader, arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The Gemma fields of the HF config from a ``gemma2`` / ``gemma3`` GGUF's metadata."""
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": hf.get("sliding_window", 4096),
        "query_pre_attn_scalar": hf["hidden_size"] // heads
        if layers == _GEMMA_27B_LAYERS[arch]
        else hf["head_dim"],
    }
    if arch == "gemma2":
        for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
            out[key] = _f32(field(reader, f"{arch}.{key}", default))
        return out
    out["rope_theta"] = _f32(field(reader, f"{arch}.rope.freq_base", 1e6))
    out["rope_local_base_freq"] = _f32(field(reader, f"{arch}.rope.freq_base_swa", 10000.0))
    pattern = field(reader, f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer: True = sliding window
        out["layer_types"] = [
            "sliding_attention" if p else "full_attention" for p in pattern[:layers]
        ]
    else:
        out["sliding_window_pattern"] = int(pattern)
    return out


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(f"{float(x):.7g}")


def dequantize(tensor) -> np.ndarray:
    """A ``gguf.ReaderTensor`` as float32 numpy in torch layout (``[out, in]`` for matrices).

    Raises:
      ModelLoadError: a quantisation type the gguf package cannot dequantise (naming it).
    """
    x = dequantize_data(tensor.data, tensor.tensor_type, tensor.name)
    # GGUF lists dimensions innermost first; the numpy array is outermost first.
    return x.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def dequantize_data(data, tensor_type, name: str) -> np.ndarray:
    """Stored GGUF data (whole or some rows: ``[rows, row_bytes]`` for block types) -> float32
    numpy ``[rows, cols]``.

    Raises:
      ModelLoadError: a quantisation type the gguf package cannot dequantise (naming it).
    """
    gguf = gguf_module()
    try:
        x = gguf.quants.dequantize(data, tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(f"tensor {name}: cannot dequantise {tensor_type.name} ({e})") from e
    return np.asarray(x, dtype=np.float32)


def gguf_generation_config(reader) -> dict[str, Any]:
    """``generation_config.json``'s ids from the GGUF tokenizer metadata (EOS and end-of-turn)."""
    eos = [
        int(v)
        for v in (
            field(reader, "tokenizer.ggml.eos_token_id"),
            field(reader, "tokenizer.ggml.eot_token_id"),
        )
        if v is not None
    ]
    out: dict[str, Any] = {}
    if eos:
        out["eos_token_id"] = list(dict.fromkeys(eos))
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        out["bos_token_id"] = int(bos)
    return out


class GGUFFileReader(CheckpointReader):
    """The tensors of a ``.gguf`` file by GGUF name (naming "gguf"), dequantised to float32
    in torch layout; ``spec`` gives the GGML type as the dtype.

    Attributes:
      gguf: the underlying ``gguf.GGUFReader`` (metadata: ``gguf_hf_config``,
        ``gguf_generation_config``; shared with the tokenizer, see ``open_gguf``).

    Raises:
      ModelLoadError: as ``open_gguf``.
    """

    naming = "gguf"

    def __init__(self, path: str):
        self.where = path
        self.gguf = open_gguf(path)
        self._tensors = {t.name: t for t in self.gguf.tensors}

    def names(self) -> Iterator[str]:
        return iter(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def spec(self, name: str) -> TensorSpec:
        t = self._tensors[name]
        # GGUF lists dimensions innermost first.
        return TensorSpec(tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """Float32 numpy; with ``index`` only the rows it covers are dequantised (a view of the
        memory-mapped file: the other rows are never read)."""
        t = self._tensors[name]
        if index is None:
            return dequantize(t)
        shape = tuple(int(d) for d in reversed(t.shape))
        index = normalize_index(index, shape)
        data = t.data
        if len(shape) < 2 or data.ndim != len(shape) or data.shape[0] != shape[0]:
            return dequantize(t)[index]
        rows = dequantize_data(data[index[0]], t.tensor_type, t.name)
        rows = rows.reshape((index[0].stop - index[0].start, *shape[1:]))
        return rows[(slice(None), *index[1:])]

    def read_blocks(self, name: str) -> np.ndarray:
        """The tensor's quantised bytes, uint8 ``[rows, row_bytes]`` (torch row order)."""
        t = self._tensors[name]
        rows = int(np.prod([int(d) for d in t.shape[1:]]))
        return np.asarray(t.data).view(np.uint8).reshape(rows, -1)

    def close(self) -> None:
        """Nothing to release: the parsed file stays cached for the tokenizer (``open_gguf``)."""
