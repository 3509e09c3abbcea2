"""Hugging Face safetensors checkpoints: ``*.safetensors`` in a model directory, one file or
several listed by ``model.safetensors.index.json``.

Reading a slice (``read(name, index)``) touches only that slice's pages of the memory-mapped
file, mapped for that read alone; the header gives every shape and dtype without reading a
tensor.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np

from jaxserve.model.arch_config import ModelLoadError
from jaxserve.model.readers.base import CheckpointReader, TensorSpec

# safetensors' dtype names -> numpy's.
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}

# Element types numpy has not: their ``ml_dtypes`` types (what jax uses).
_NON_NUMPY = {
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
_NUMPY_DTYPES = {k: v for k, v in _DTYPES.items() if k not in _NON_NUMPY}


def safetensors_index(model_dir: str) -> dict[str, str]:
    """HF tensor name -> path of the safetensors file holding it (via the index when present).

    Raises:
      ModelLoadError: no ``*.safetensors`` file, or a file the index lists is missing.
    """
    from safetensors import safe_open

    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        out = {}
        for name, fname in weight_map.items():
            path = os.path.join(model_dir, fname)
            if not os.path.isfile(path):
                raise ModelLoadError(f"safetensors shard {path} listed in {index_path} not found")
            out[name] = path
        return out
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights file in model directory {model_dir}")
    out = {}
    for path in files:
        with safe_open(path, framework="numpy") as f:
            out.update({name: path for name in f.keys()})
    return out


class SafetensorsReader(CheckpointReader):
    """The tensors of a HF model directory's safetensors files, by HF name (naming "hf").

    Each read maps its tensor's bytes and unmaps them once copied; headers are read once.

    Raises:
      ModelLoadError: as ``safetensors_index``.
    """

    naming = "hf"

    def __init__(self, model_dir: str):
        self.where = f"the safetensors files of {model_dir}"
        self._index = safetensors_index(model_dir)
        self._headers: dict[str, tuple[int, dict]] = {}  # path -> (data start, header)

    def names(self) -> Iterator[str]:
        return iter(self._index)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def spec(self, name: str) -> TensorSpec:
        info = self._header(name)
        return TensorSpec(
            tuple(int(d) for d in info["shape"]), _DTYPES.get(info["dtype"], info["dtype"])
        )

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor (numpy), or only ``x[index]``: the file is memory-mapped for this read
        alone and only the pages holding the slice are touched, then unmapped, so neither the
        rest of the tensor nor the mapped pages stay in this process's memory."""
        view = self._view(name)
        try:
            return np.array(view if index is None else view[index])
        finally:
            del view

    def _header(self, name: str) -> dict:
        """The safetensors header entry of ``name`` (dtype, shape, data_offsets)."""
        path = self._index[name]
        if path not in self._headers:
            with open(path, "rb") as fh:
                size = struct.unpack("<Q", fh.read(8))[0]
                self._headers[path] = (8 + size, json.loads(fh.read(size)))
        return self._headers[path][1][name]

    def _view(self, name: str) -> np.ndarray:
        """A read-only memory map of tensor ``name``'s bytes, viewed as its dtype and shape
        (``ml_dtypes`` types for bfloat16 and FP8, as jax uses)."""
        info = self._header(name)
        base = self._headers[self._index[name]][0]
        start, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        dtype = _NON_NUMPY.get(info["dtype"]) or np.dtype(_NUMPY_DTYPES[info["dtype"]])
        if end == start:
            return np.zeros(shape, dtype)
        raw = np.memmap(self._index[name], np.uint8, "r", offset=base + start, shape=(end - start,))
        return raw.view(dtype).reshape(shape)

    def close(self) -> None:
        self._headers.clear()
