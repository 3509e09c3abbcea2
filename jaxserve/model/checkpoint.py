"""Our checkpoint layout and ``jaxserve convert`` (reading it back:
``jaxserve.model.readers.orbax_reader``).

    OUT_DIR/config.json               the HF config, ``torch_dtype`` set to the saved dtype
    OUT_DIR/params/                   orbax StandardCheckpointer directory of the parameters
    OUT_DIR/generation_config.json    copied, with the tokenizer files (tokenizer.json, ...)

Loading it back (``load_model(OUT_DIR)``) skips the torch-layout transposes and restores each
array straight into the target dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import jax
from flax import nnx

from jaxserve.model.arch_config import ModelArchConfig, ModelLoadError, read_hf_config
from jaxserve.model.loader import load_model
from jaxserve.model.readers.gguf_reader import gguf_hf_config, is_gguf_path, open_gguf
from jaxserve.model.readers.orbax_reader import PARAMS_DIR
from jaxserve.model.sharding import check_tensor_parallel

# Files of a HF directory that are not copied next to our params (weights and their index).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
_SKIP_FILES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def convert(
    hf_dir: str, out_dir: str, dtype: str = "auto", tensor_parallel_size: int | None = None
) -> None:
    """HF directory (safetensors) or ``.gguf`` file -> our orbax layout in ``out_dir`` (created;
    must not exist). From a GGUF, the tokenizer is written as tokenizer.json +
    tokenizer_config.json (chat template included) and the EOS ids as generation_config.json.

    The checkpoint is sharded (orbax writes each array in chunks) and restores into a mesh of
    any tensor-parallel size (``load_model(out_dir, tensor_parallel_size=N)``). With
    ``tensor_parallel_size`` the model is read straight onto that many devices (a model larger
    than one device's memory) and each device writes its own shards; the parameters saved are
    the model's own (unreplicated), so the size must split the heads without copying them.

    Raises:
      ModelLoadError: as ``load_model``; also when ``out_dir`` already exists.
      ValueError: a ``tensor_parallel_size`` larger than the KV heads (naming both).
    """
    if os.path.exists(out_dir):
        raise ModelLoadError(f"output directory already exists: {out_dir}")
    gguf = is_gguf_path(hf_dir)
    if tensor_parallel_size is not None:  # before any weight is read
        hf = gguf_hf_config(open_gguf(hf_dir), hf_dir) if gguf else read_hf_config(hf_dir)
        arch = ModelArchConfig.from_hf_config(hf)
        if check_tensor_parallel(arch, tensor_parallel_size) != (1, 1):
            raise ValueError(
                f"tensor_parallel_size ({tensor_parallel_size}) is larger than the model's "
                f"num_key_value_heads ({arch.num_kv_heads}): convert would save copied heads; "
                f"use at most {arch.num_kv_heads}"
            )
    model, cfg, generation_config = load_model(
        hf_dir,
        dtype=dtype,
        load_format="gguf" if gguf else "safetensors",
        tensor_parallel_size=tensor_parallel_size,
    )
    if gguf:
        from jaxserve.tokenizer.gguf_tokenizer import build_gguf_tokenizer

        reader = open_gguf(hf_dir)
        hf_config = gguf_hf_config(reader, hf_dir)
        tok, tok_config = build_gguf_tokenizer(reader, hf_dir)
    else:
        hf_config = read_hf_config(hf_dir)
    os.makedirs(out_dir)
    saved_dtype = jax.tree.leaves(nnx.state(model))[0].dtype.name
    hf_config["torch_dtype"] = saved_dtype
    if "dtype" in hf_config:
        hf_config["dtype"] = saved_dtype
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    if gguf:
        tok.save(os.path.join(out_dir, "tokenizer.json"))
        for name, content in (
            ("tokenizer_config.json", tok_config),
            ("generation_config.json", generation_config),
        ):
            with open(os.path.join(out_dir, name), "w") as f:
                json.dump(content, f, indent=2)
    else:
        for name in sorted(os.listdir(hf_dir)):
            src = os.path.join(hf_dir, name)
            if (
                os.path.isfile(src)
                and name not in _SKIP_FILES
                and not name.endswith(_WEIGHT_SUFFIXES)
            ):
                shutil.copy2(src, os.path.join(out_dir, name))
    save_params(model, out_dir)


def save_params(model: nnx.Module, out_dir: str) -> None:
    """Writes ``model``'s parameters to ``out_dir/params/`` (orbax); the directory must not exist.

    Names are our parameter paths (``OrbaxReader`` reads them back by name).
    """
    import orbax.checkpoint as ocp

    path = os.path.join(os.path.abspath(out_dir), PARAMS_DIR)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, nnx.to_pure_dict(nnx.state(model)))
        ckptr.wait_until_finished()


def add_convert_parser(subparsers) -> argparse.ArgumentParser:
    """``jaxserve convert HF_DIR OUT_DIR [--dtype]``; sets ``func`` to ``run_convert``."""
    p = subparsers.add_parser(
        "convert",
        help="convert a Hugging Face model directory or a .gguf file to our orbax layout",
        description="Reads HF_DIR (config.json + *.safetensors, or a .gguf file) and writes "
        "OUT_DIR/config.json, OUT_DIR/params/ (orbax) and the tokenizer / generation_config files.",
    )
    p.add_argument(
        "hf_dir",
        metavar="MODEL",
        help="Hugging Face model directory, .gguf file, or 'smollm2' (the demo-model extra)",
    )
    p.add_argument("out_dir", help="output directory (must not exist)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="dtype of the saved parameters (default: the config's torch_dtype)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="read the model straight onto this many devices, each writing its own shards "
        "(default: one device); the checkpoint restores at any size either way",
    )
    p.set_defaults(func=run_convert)
    return p


def run_convert(args: argparse.Namespace) -> int:
    """Runs ``convert`` from parsed CLI args; returns the exit code. ``MODEL`` is resolved as
    ``serve`` resolves it (``smollm2``: the demo model's GGUF file)."""
    from jaxserve.model.resolve import resolve_model_path

    convert(
        resolve_model_path(args.hf_dir),
        args.out_dir,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    print(f"wrote {args.out_dir}")
    return 0
