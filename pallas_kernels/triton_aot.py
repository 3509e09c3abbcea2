"""Ahead-of-time checks of the Triton kernels on a machine without a GPU.

JAX can lower a jitted function for CUDA while running on CPU when an
abstract GPU device is in scope (``jax.sharding.AbstractDevice``): the Pallas
Triton backend then emits the kernel's Triton IR (TTIR) into the
``__gpu$xla.gpu.triton`` custom call. This module

* ``triton_ir(fn, *shapes)``: lowers ``fn`` for an abstract H200 and returns
  the TTIR text of every Pallas kernel in it (needs only jax; used by the CPU
  test suite to prove that the kernel lowers to Triton);
* ``compile_ttir(path, ...)``: compiles a TTIR file to PTX/cubin for sm_90
  with the ``triton`` Python package when one is importable (a developer tool;
  it needs no GPU either) and reports shared memory and register spills.

Command line (the two steps may run in different Python environments):

    python -m pallas_kernels.triton_aot dump OUT_DIR       # needs jax
    python pallas_kernels/triton_aot.py compile OUT_DIR    # needs triton
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"


def triton_ir(fn, *arg_shapes, device_kind: str = "NVIDIA H200", **kwargs) -> list[dict]:
    """Lowers ``fn(*arg_shapes, **kwargs)`` for CUDA and extracts its Triton kernels.

    Args:
      fn: a jittable function.
      arg_shapes: ``jax.ShapeDtypeStruct`` arguments.
      device_kind: the abstract GPU to target (its compute capability decides
        the Triton lowering).
      kwargs: static keyword arguments passed to ``fn``.

    Returns:
      One dict per Triton custom call: ``name``, ``ttir`` (text), ``num_warps``,
      ``num_stages`` and ``grid`` (x, y, z).
    """
    import jax
    from jax._src.lib.mlir import ir
    from jax.sharding import AbstractDevice, AbstractMesh
    from jaxlib.triton import dialect as tt_dialect

    mesh = AbstractMesh(
        (1,),
        ("x",),
        abstract_device=AbstractDevice(device_kind=device_kind, num_cores=132, platform="gpu"),
    )
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = (
            jax.jit(lambda *a: fn(*a, **kwargs))
            .trace(*arg_shapes)
            .lower(lowering_platforms=("cuda",))
        )
    module = lowered.compiler_ir("stablehlo")
    kernels = []

    def visit(op):
        op = op.operation
        if op.name == "stablehlo.custom_call":
            target = ir.StringAttr(op.attributes["call_target_name"]).value
            if target == TRITON_CALL_TARGET:
                config = ir.DictAttr(op.attributes["mhlo.backend_config"])
                with ir.Context() as ctx:
                    tt_dialect.register_dialect(ctx)
                    ttir = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
                    kernels.append(
                        {
                            "name": ir.StringAttr(config["name"]).value,
                            "ttir": str(ttir),
                            "num_warps": ir.IntegerAttr(config["num_warps"]).value,
                            "num_stages": ir.IntegerAttr(config["num_stages"]).value,
                            "grid": [ir.IntegerAttr(config[f"grid_{a}"]).value for a in "xyz"],
                        }
                    )
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    visit(child)

    visit(module.operation)
    return kernels


def _standard_cases():
    """Kernel shapes the benchmark and model use, for the `dump` command."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    def case(name, T, S, Hq, Hkv, D, N, bs, P, dtype, **kw):
        sds = jax.ShapeDtypeStruct
        kv = sds((N, bs, Hkv, D), dtype)
        shapes = (
            sds((T, Hq, D), dtype),
            kv,
            kv,
            sds((S, P), jnp.int32),
            sds((S,), jnp.int32),
            sds((S + 1,), jnp.int32),
            sds((), jnp.int32),
        )
        return name, ragged_paged_attention, shapes, dict(sm_scale=D**-0.5, **kw)

    bf16, f32 = jnp.bfloat16, jnp.float32
    return [
        case("decode_b64_llama8b", 64, 64, 32, 8, 128, 8192, 16, 128, bf16),
        case("decode_b1_ctx8k", 1, 1, 32, 8, 128, 8192, 16, 512, bf16),
        case("decode_mha_64bit_offsets", 32, 32, 8, 8, 64, 1 << 17, 32, 64, bf16),
        case("prefill_4k_llama8b", 4096, 1, 32, 8, 128, 8192, 16, 256, bf16),
        case(
            "prefill_f32_d256_softcap_window",
            256,
            4,
            8,
            2,
            256,
            512,
            32,
            32,
            f32,
            soft_cap=30.0,
            sliding_window=64,
        ),
        case("mixed_gqa3_d64_bs64", 128, 16, 12, 4, 64, 512, 64, 16, bf16),
    ]


def dump(out_dir: str) -> None:
    """Writes ``<case>.ttir`` and ``<case>.json`` (launch params) for each case."""
    os.makedirs(out_dir, exist_ok=True)
    for name, fn, shapes, kwargs in _standard_cases():
        for i, kernel in enumerate(triton_ir(fn, *shapes, **kwargs)):
            stem = os.path.join(out_dir, f"{name}_{i}")
            with open(stem + ".ttir", "w") as f:
                f.write(kernel["ttir"])
            with open(stem + ".json", "w") as f:
                json.dump({k: v for k, v in kernel.items() if k != "ttir"}, f)
            print(
                f"{stem}.ttir  warps={kernel['num_warps']} stages={kernel['num_stages']} "
                f"grid={kernel['grid']}"
            )


def compile_ttir(path: str, *, num_warps: int, num_stages: int, capability: int = 90) -> dict:
    """Compiles a TTIR file for ``sm_<capability>`` with the ``triton`` package.

    Returns ``shared`` (bytes of shared memory), ``spills`` (bytes spilled, from
    ``ptxas -v``) and ``registers`` per thread. Needs ``triton`` but no GPU.
    ``spills`` and ``registers`` are None when ``ptxas`` printed no such figure
    (for instance when the ``ptxas-blackwell`` binary bundled with triton is
    missing; its failure is not raised).

    Raises:
      ImportError: if the ``triton`` package is not importable.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = triton.compile(
        path,
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    result = {"shared": kernel.metadata.shared, "spills": None, "registers": None}
    ptxas = os.path.join(
        os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell"
    )
    ptx_path = path + ".ptx"
    with open(ptx_path, "w") as f:
        f.write(kernel.asm["ptx"])
    proc = subprocess.run(
        [ptxas, "-v", f"--gpu-name=sm_{capability}a", ptx_path, "-o", os.devnull],
        capture_output=True,
        text=True,
        check=False,
    )
    if m := re.search(r"(\d+) bytes spill stores", proc.stderr):
        result["spills"] = int(m.group(1))
    if m := re.search(r"Used (\d+) registers", proc.stderr):
        result["registers"] = int(m.group(1))
    return result


def compile_dir(out_dir: str) -> None:
    """Compiles every ``<case>.ttir`` written by ``dump`` (with the launch
    parameters from its ``<case>.json``) and prints shared memory (bytes),
    registers per thread and spill stores (bytes) for each.

    Raises:
      FileNotFoundError: if ``out_dir`` or a ``.ttir``'s ``.json`` is missing.
      ImportError: if ``triton`` is not importable.
    """
    for entry in sorted(os.listdir(out_dir)):
        if entry.endswith(".ttir"):
            path = os.path.join(out_dir, entry)
            with open(path[: -len(".ttir")] + ".json") as f:
                params = json.load(f)
            info = compile_ttir(
                path, num_warps=params["num_warps"], num_stages=params["num_stages"]
            )
            print(
                f"{entry}: shared={info['shared']} B registers={info['registers']} "
                f"spill_stores={info['spills']} B"
            )


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("dump", "compile"):
        sys.exit(__doc__)
    (dump if sys.argv[1] == "dump" else compile_dir)(sys.argv[2])
