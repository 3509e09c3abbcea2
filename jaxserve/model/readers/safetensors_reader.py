"""Hugging Face safetensors checkpoints: ``*.safetensors`` in a model directory, one file or
several listed by ``model.safetensors.index.json``.

Reading a slice (``read(name, index)``) reads only that slice's bytes (safetensors'
``get_slice``); the header gives every shape and dtype without reading a tensor.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import struct
from collections.abc import Iterator
from typing import Any

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

# Element types numpy's safetensors bindings refuse; read as raw bytes (``_read_bytes``).
_NON_NUMPY = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


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

    Files are opened (memory-mapped) on first use and closed by ``close``.

    Raises:
      ModelLoadError: as ``safetensors_index``.
    """

    naming = "hf"

    def __init__(self, model_dir: str):
        self.where = f"the safetensors files of {model_dir}"
        self._index = safetensors_index(model_dir)
        self._files: dict[str, Any] = {}
        self._headers: dict[str, tuple[int, dict]] = {}  # path -> (data start, header)
        self._stack = contextlib.ExitStack()

    def _file(self, name: str):
        path = self._index[name]
        if path not in self._files:
            from safetensors import safe_open

            self._files[path] = self._stack.enter_context(safe_open(path, framework="numpy"))
        return self._files[path]

    def names(self) -> Iterator[str]:
        return iter(self._index)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def spec(self, name: str) -> TensorSpec:
        view = self._file(name).get_slice(name)
        dtype = view.get_dtype()
        return TensorSpec(tuple(int(d) for d in view.get_shape()), _DTYPES.get(dtype, dtype))

    def read(self, name: str, index: tuple[slice, ...] | None = None):
        f = self._file(name)
        if f.get_slice(name).get_dtype() in _NON_NUMPY:
            x = self._read_bytes(name)
            return x if index is None else x[index]
        return f.get_tensor(name) if index is None else f.get_slice(name)[index]

    def _read_bytes(self, name: str) -> np.ndarray:
        """A tensor numpy's safetensors bindings cannot build (FP8), read from its file by the
        header's byte offsets and viewed as the ``ml_dtypes`` type jax uses."""
        path = self._index[name]
        if path not in self._headers:
            with open(path, "rb") as fh:
                size = struct.unpack("<Q", fh.read(8))[0]
                self._headers[path] = (8 + size, json.loads(fh.read(size)))
        base, header = self._headers[path]
        info = header[name]
        start, end = info["data_offsets"]
        raw = np.memmap(path, np.uint8, "r", offset=base + start, shape=(end - start,))
        return np.asarray(raw).view(_NON_NUMPY[info["dtype"]]).reshape(info["shape"])

    def close(self) -> None:
        self._stack.close()
        self._files.clear()
