"""Our orbax layout, ``DIR/params/`` (an orbax StandardCheckpointer directory of the model's
parameters; ``jaxserve convert`` writes it, ``jaxserve.model.checkpoint``).

Tensors are named by our parameter paths, dotted (naming "jaxserve"): the layout needs no
reshape. The checkpoint's metadata gives every shape and dtype; the first ``read`` restores the
whole checkpoint at once in the reader's dtype (orbax casts on read, so a float32 checkpoint
loads as bfloat16 without a float32 copy of the model), and a slice is cut from the restored
array. The sharded loader (``jaxserve.model.sharded_loader``) calls ``restore_placed`` instead:
orbax restores each array with its target sharding, reading only each device's chunks, so the
checkpoint restores into a mesh of any size.

orbax is a heavy import: it is imported on first use.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import jax

from jaxserve.model.arch_config import ModelLoadError
from jaxserve.model.readers.base import CheckpointReader, TensorSpec
from jaxserve.model.weight_mapping import flat_name

PARAMS_DIR = "params"  # our orbax layout: OUT_DIR/config.json + OUT_DIR/params/


def _by_name(tree) -> dict:
    """A nested dict (orbax's tree) -> {dotted path: leaf}."""
    return {flat_name(k.key for k in path): x for path, x in jax.tree.leaves_with_path(tree)}


class OrbaxReader(CheckpointReader):
    """The parameters in ``model_dir/params/`` by dotted path (naming "jaxserve").

    Args:
      model_dir: a directory of our layout.
      dtype: restore every array in this dtype (None: as stored).

    Raises:
      ModelLoadError: ``params/`` is missing or its metadata cannot be read.
    """

    naming = "jaxserve"

    def __init__(self, model_dir: str, dtype=None):
        import orbax.checkpoint as ocp

        self.path = os.path.join(os.path.abspath(model_dir), PARAMS_DIR)
        if not os.path.isdir(self.path):
            raise ModelLoadError(f"orbax params directory not found: {self.path}")
        self.where = self.path
        self.error_prefix = "cannot restore: "
        self._dtype = dtype
        self._arrays: dict | None = None
        try:
            with ocp.StandardCheckpointer() as ckptr:
                self._tree = ckptr.metadata(self.path).item_metadata.tree
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise ModelLoadError(f"cannot read the orbax metadata of {self.path}: {e}") from e
        self._specs = {
            name: TensorSpec(tuple(m.shape), str(m.dtype))
            for name, m in _by_name(self._tree).items()
        }

    def names(self) -> Iterator[str]:
        return iter(self._specs)

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def spec(self, name: str) -> TensorSpec:
        return self._specs[name]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> jax.Array:
        if self._arrays is None:
            self._arrays = self._restore()
        x = self._arrays[name]
        return x if index is None else x[index]

    def _restore(self, sharding=None) -> dict:
        """{name: array} restored in the reader's dtype; ``sharding(name)`` places each (None:
        orbax's default, the default device)."""
        import orbax.checkpoint as ocp

        def leaf(path, m):
            where = None if sharding is None else sharding(flat_name(k.key for k in path))
            return jax.ShapeDtypeStruct(m.shape, self._dtype or m.dtype, sharding=where)

        target = jax.tree.map_with_path(leaf, self._tree)
        try:
            with ocp.StandardCheckpointer() as ckptr:
                return _by_name(ckptr.restore(self.path, target))
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise ModelLoadError(f"cannot restore {self.path}: {e}") from e

    def restore_placed(self, shardings: dict, default) -> dict:
        """Restores every array onto devices, each of ``shardings`` ({name: sharding}) with
        its sharding (orbax reads only each device's chunk of it), the others with
        ``default``; ``read`` then slices the restored arrays. Returns {name: jax.Array}.

        Raises:
          ModelLoadError: the checkpoint cannot be restored.
        """
        self._arrays = self._restore(lambda name: shardings.get(name, default))
        return dict(self._arrays)

    def close(self) -> None:
        self._arrays = None
