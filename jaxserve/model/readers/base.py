"""What every checkpoint reader offers: a checkpoint's tensors by name, with their stored
shape and dtype known before any tensor is read.

The loader (``jaxserve.model.loader.load_weights``) asks the model's family where each
parameter is stored (``weight_source``: the tensor's name in the reader's ``naming`` and its
layout), checks the stored shape with ``spec`` and reads it with ``read``. ``read``'s ``index``
(a tuple of slices over the stored shape) is where a sharded loader reads only the part of a
tensor its devices hold; how much each reader reads for a slice is said in its docstring.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A stored tensor's shape and element type, read from the checkpoint's header.

    Attributes:
      shape: the stored shape (torch layout for Hugging Face and GGUF checkpoints: a Linear
        weight is ``[out, in]``).
      dtype: numpy's name for safetensors and orbax ("float32", "bfloat16"); the GGML type
        for GGUF ("F32", "F16", "Q4_1", "Q6_K", ...).
    """

    shape: tuple[int, ...]
    dtype: str


class CheckpointReader(abc.ABC):
    """A checkpoint's tensors by name. Use as a context manager (``close`` on exit).

    Attributes:
      naming: one of ``jaxserve.model.weight_mapping.NAMINGS``: the names ``weight_source``
        gives for this checkpoint.
      where: the checkpoint in words, for messages ("the safetensors files of DIR").
      error_prefix: prepended to the loader's per-tensor errors ("" where ``where`` already
        names the files).
    """

    naming: str
    where: str
    error_prefix: str = ""

    @abc.abstractmethod
    def names(self) -> Iterator[str]:
        """Every tensor name in the checkpoint."""

    @abc.abstractmethod
    def __contains__(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor of this name."""

    @abc.abstractmethod
    def spec(self, name: str) -> TensorSpec:
        """The stored shape and dtype of ``name``, without reading it (KeyError if absent)."""

    @abc.abstractmethod
    def read(self, name: str, index: tuple[slice, ...] | None = None) -> Any:
        """Tensor ``name`` (numpy, or a jax array for orbax), whole or ``x[index]``.

        Args:
          name: a tensor name (KeyError if absent).
          index: slices over the stored shape, or None for the whole tensor.
        """

    def read_blocks(self, name: str) -> Any:
        """A quantised tensor's stored bytes, uint8 ``[rows, row_bytes]`` (GGUF blocks, kept
        quantized: ``jaxserve.model.readers.gguf_blocks``).

        Raises:
          ValueError: this checkpoint format stores no blocks.
        """
        raise ValueError(f"{self.where} stores no quantised blocks (tensor {name})")

    @abc.abstractmethod
    def close(self) -> None:
        """Releases open files and cached arrays (the model keeps what it read)."""

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
