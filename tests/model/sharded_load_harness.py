"""Loads checkpoints whole (then ``place_model``) and sharded (``load_model(...,
tensor_parallel_size=N)``) on simulated CPU devices and prints one JSON line per (model, format,
TP): whether every parameter is equal and placed alike, and every read of a tensor that a
sharded parameter holds only a slice of that covered the whole tensor. Run in a subprocess (JAX
fixes the device count at first use):

    python sharded_load_harness.py --devices 8 --model DIR@1,2,4 [--model DIR@1,8] [--orbax NAME]

Each ``--model`` is a HF fixture directory and the TP sizes to load it at, optionally with a
``--quantization`` and a ``--kv-cache-dtype`` (``DIR@2@int8@fp8``; such lines' "format" is
``safetensors+int8+fp8``). ``--orbax NAME[@N]``
also converts the model of that directory name to our orbax layout (in a temporary directory;
with ``@N`` read onto N devices, each writing its shards) and loads that at each of its TP
sizes, compared with the safetensors load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--orbax", action="append", default=[])
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

    import jax
    import numpy as np
    from flax import nnx

    from jaxserve.model import loader
    from jaxserve.model.checkpoint import convert
    from jaxserve.model.readers.safetensors_reader import SafetensorsReader
    from jaxserve.model.sharding import make_mesh, place_model

    reads: list[tuple[str, object]] = []
    plain_read = SafetensorsReader.read

    def recording_read(self, name, index=None):
        x = plain_read(self, name, index)
        reads.append((name, tuple(x.shape), tuple(int(d) for d in self.spec(name).shape)))
        return x

    SafetensorsReader.read = recording_read

    def flat(model) -> dict:
        return {
            ".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))
        }

    def sharded_sources(model, cfg, naming) -> set[str]:
        """Names of the stored tensors of every parameter split (not copied) over the mesh."""
        out = set()
        for path, var in nnx.to_flat_state(nnx.state(model)):
            if not var.get_value().sharding.is_fully_replicated:
                try:
                    src = type(model).weight_source(path, cfg, naming)
                except (KeyError, ValueError):  # a quantized layer's own parameter
                    continue
                out.update(src.stacked or src.names)
        return out

    for spec in args.model:
        path, sizes, quantization, kv_cache_dtype = (spec.split("@") + ["auto", "auto"])[:4]
        name = os.path.basename(path.rstrip("/"))
        knobs = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype)
        fmt = "+".join(["safetensors"] + [k for k in (quantization, kv_cache_dtype) if k != "auto"])
        orbax_dir = None
        writers = dict((o.split("@") + ["1"])[:2] for o in args.orbax)
        if name in writers:
            orbax_dir = os.path.join(tempfile.mkdtemp(prefix="sharded-load-"), name)
            convert(path, orbax_dir, dtype="float32", tensor_parallel_size=int(writers[name]))
        for tp in map(int, sizes.split(",")):
            mesh = make_mesh(tp)
            whole, cfg, _ = loader.load_model(path, "float32", "safetensors", **knobs)
            whole, _ = place_model(whole, cfg, mesh)
            want = flat(whole)
            reads.clear()
            model, _, _ = loader.load_model(path, "float32", "safetensors", tensor_parallel_size=tp)
            model, _ = place_model(model, cfg, mesh)  # as the runner does: must move nothing
            got = flat(model)
            split = sharded_sources(model, cfg, "hf")
            whole_reads = sorted(
                {n for n, got_shape, shape in reads if n in split and got_shape == shape}
            )
            biggest = max(
                (math.prod(s) / math.prod(full) for n, s, full in reads if n in split), default=0
            )
            result = {
                "model": name,
                "format": fmt,
                "tp": tp,
                "equal": sorted(k for k in want if not np.array_equal(want[k], got[k])) == [],
                "not_equal": sorted(k for k in want if not np.array_equal(want[k], got[k])),
                "same_placement": all(
                    want[k].sharding.is_equivalent_to(got[k].sharding, want[k].ndim) for k in want
                ),
                "params": len(want),
                "split_tensors": len(split),
                "whole_reads_of_split_tensors": whole_reads,
                "largest_read_fraction_of_split_tensor": biggest,
            }
            print(json.dumps(result), flush=True)
            if orbax_dir is not None:
                restored, _, _ = loader.load_model(
                    orbax_dir, "float32", "orbax", tensor_parallel_size=tp
                )
                restored, _ = place_model(restored, cfg, mesh)
                back = flat(restored)
                bad = sorted(k for k in want if not np.array_equal(want[k], back[k]))
                print(
                    json.dumps(
                        {
                            "model": name,
                            "format": "orbax",
                            "tp": tp,
                            "equal": not bad,
                            "not_equal": bad,
                            "same_placement": all(
                                want[k].sharding.is_equivalent_to(back[k].sharding, want[k].ndim)
                                for k in want
                            ),
                        }
                    ),
                    flush=True,
                )
        if orbax_dir is not None:
            shutil.rmtree(os.path.dirname(orbax_dir), ignore_errors=True)
    del jax


if __name__ == "__main__":
    sys.exit(main())
