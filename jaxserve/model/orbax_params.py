"""Model parameters in our orbax layout, ``DIR/params/`` (a StandardCheckpointer directory).

orbax is a heavy import: it is imported on first use, so the loader can name this layout
without paying for it.
"""

from __future__ import annotations

import os

from flax import nnx

from jaxserve.model.config import ModelLoadError

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

    Raises:
      ModelLoadError: ``params/`` is missing or does not match the model (orbax's message kept,
        with ``architecture``).
    """
    import orbax.checkpoint as ocp

    path = os.path.join(os.path.abspath(model_dir), PARAMS_DIR)
    if not os.path.isdir(path):
        raise ModelLoadError(f"orbax params directory not found: {path}")
    graphdef, abs_state = nnx.split(abstract)
    target = nnx.to_pure_dict(abs_state)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(path, target)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ModelLoadError(f"cannot restore {path} for {architecture}: {e}") from e
    nnx.replace_by_pure_dict(abs_state, restored)
    return nnx.merge(graphdef, abs_state)
