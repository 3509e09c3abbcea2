"""Model parameters in our orbax layout, ``DIR/params/`` (a StandardCheckpointer directory).

orbax is a heavy import: it is imported on first use, so the loader can name this layout
without paying for it.
"""

from __future__ import annotations

import os

from flax import nnx

from jaxserve.model.config import ModelLoadError
from jaxserve.model.weight_mapping import flat_name

PARAMS_DIR = "params"  # our orbax layout: OUT_DIR/config.json + OUT_DIR/params/


def save_params(model: nnx.Module, out_dir: str) -> None:
    """Writes ``model``'s parameters to ``out_dir/params/`` (orbax); the directory must not exist."""
    import orbax.checkpoint as ocp

    path = os.path.join(os.path.abspath(out_dir), PARAMS_DIR)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, nnx.to_pure_dict(nnx.state(model)))
        ckptr.wait_until_finished()


def restore_params(model_dir: str, abstract: nnx.Module, architecture: str) -> nnx.Module:
    """Restores ``model_dir/params/`` into ``abstract`` (a shapes-only model of the target dtype;
    orbax casts on read) and returns the real model.

    Parameters are found by name (``abstract.weight_source(path, config, "jaxserve")``), so a
    layout written before the model's layers were renamed restores too.

    Raises:
      ModelLoadError: ``params/`` is missing or does not match the model (a tensor missing or
        of another shape, named, with ``architecture``).
    """
    import jax
    import orbax.checkpoint as ocp

    path = os.path.join(os.path.abspath(model_dir), PARAMS_DIR)
    if not os.path.isdir(path):
        raise ModelLoadError(f"orbax params directory not found: {path}")
    graphdef, abs_state = nnx.split(abstract)
    dtype = jax.tree.leaves(abs_state)[0].dtype
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.metadata(path).item_metadata.tree
        stored = {flat_name(k.key for k in p): m for p, m in jax.tree.leaves_with_path(tree)}
        flat = []
        for p, var in nnx.to_flat_state(abs_state):
            source = abstract.weight_source(p, abstract.config, "jaxserve")
            name = next((n for n in source.names if n in stored), None)
            if name is None:
                raise ModelLoadError(
                    f"cannot restore {path} for {architecture}: tensor {source.name} not found"
                )
            if tuple(stored[name].shape) != tuple(var.shape):
                raise ModelLoadError(
                    f"cannot restore {path} for {architecture}: shape mismatch for tensor "
                    f"{name}: expected {list(var.shape)}, got {list(stored[name].shape)}"
                )
            flat.append((p, name))
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, dtype), tree)
        restored = ckptr.restore(path, target)
    by_name = {flat_name(k.key for k in p): x for p, x in jax.tree.leaves_with_path(restored)}
    state = nnx.from_flat_state(
        [
            (p, var.replace(by_name[name]))
            for (p, name), (_, var) in zip(flat, nnx.to_flat_state(abs_state))
        ]
    )
    return nnx.merge(graphdef, state)
