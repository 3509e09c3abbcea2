"""Loading a checkpoint onto a tensor-parallel mesh: peak host memory and load speed (#36).

Writes a synthetic Llama-shaped bfloat16 checkpoint (about 1.5 GB, sharded safetensors with an
index) into /tmp once, converts it to our orbax layout, then loads it in fresh processes on 8
simulated CPU devices at TP 1, 4 and 8, four ways, interleaved:

    main-whole       the loader before #36 (``--baseline-src``: a copy of that commit's
                     ``jaxserve/``, e.g. ``git archive c1679ea jaxserve | tar -x -C DIR``)
    whole            read every tensor whole, then ``place_model`` onto the mesh
    sharded          ``load_model(..., tensor_parallel_size=N)``: each device's slice only
    orbax-whole      our orbax layout restored whole, then placed
    orbax-sharded    our orbax layout restored by orbax with each array's target sharding

Each run prints the peak RSS above the process's baseline (``VmHWM`` minus the RSS before the
load: on CPU the devices' arrays live in host memory, so 1.0x the model's bytes is the floor;
the #36 target is at most 1.15x), the peak of anonymous memory (RSS less the page cache mapped
from the checkpoint files) sampled every 2 ms, and GB/s (the model's bytes over the load's wall
time, placement and ``block_until_ready`` included). The files are deleted at the end.

    nice -n 19 .venv/bin/python benchmarks/bench_load.py [--layers 10] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("whole", "sharded", "orbax-whole", "orbax-sharded")


def hf_config(layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def write_checkpoint(out: str, layers: int) -> int:
    """The synthetic checkpoint, one safetensors file per two layers; returns its bytes."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    cfg = hf_config(layers)
    e, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = e // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    os.makedirs(out)
    weight_map, total = {}, 0
    groups = [["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]]
    groups += [[i, i + 1] for i in range(0, layers, 2)]
    for k, group in enumerate(groups):
        tensors = {}
        for item in group:
            if isinstance(item, str):
                tensors[item] = w(v, e) if item != "model.norm.weight" else w(e)
                continue
            if item >= layers:
                continue
            p = f"model.layers.{item}."
            tensors.update(
                {
                    p + "self_attn.q_proj.weight": w(e, e),
                    p + "self_attn.k_proj.weight": w(kv, e),
                    p + "self_attn.v_proj.weight": w(kv, e),
                    p + "self_attn.o_proj.weight": w(e, e),
                    p + "mlp.gate_proj.weight": w(f, e),
                    p + "mlp.up_proj.weight": w(f, e),
                    p + "mlp.down_proj.weight": w(e, f),
                    p + "input_layernorm.weight": w(e),
                    p + "post_attention_layernorm.weight": w(e),
                }
            )
        name = f"model-{k:05d}.safetensors"
        save_file(tensors, os.path.join(out, name))
        weight_map.update({t: name for t in tensors})
        total += sum(x.nbytes for x in tensors.values())
        del tensors
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return total


def _rss() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def child(mode: str, path: str, tp: int) -> None:
    """One load in this process; prints one JSON line."""
    import threading

    import jax
    from flax import nnx

    from jaxserve.model.loader import load_model
    from jaxserve.model.sharding import make_mesh, place_model

    jax.devices()
    base = _rss()
    peak_anon = [base["RssAnon"]]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _rss()["RssAnon"])
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    fmt = "orbax" if mode.startswith("orbax") else "safetensors"
    if mode.endswith("sharded"):  # main-whole: the same call, an older package
        model, cfg, _ = load_model(path, "bfloat16", fmt, tensor_parallel_size=tp)
    else:
        model, cfg, _ = load_model(path, "bfloat16", fmt)
    model, _ = place_model(model, cfg, make_mesh(tp))
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    end = _rss()
    print(
        json.dumps(
            {
                "mode": mode,
                "tp": tp,
                "seconds": seconds,
                "peak_rss_above_base": end["VmHWM"] - base["VmRSS"],
                "peak_anon_above_base": peak_anon[0] - base["RssAnon"],
                "end_rss_above_base": end["VmRSS"] - base["VmRSS"],
                "package": os.path.dirname(sys.modules["jaxserve"].__file__),
            }
        ),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--tp", default="1,4,8")
    ap.add_argument("--keep", action="store_true", help="keep the files in /tmp")
    ap.add_argument(
        "--baseline-src",
        default="",
        help="a directory holding an older jaxserve/ package: adds its whole load (main-whole)",
    )
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to run")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "PATH", "TP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    root = tempfile.mkdtemp(prefix="bench-load-", dir="/tmp")
    st_dir, orbax_dir = os.path.join(root, "hf"), os.path.join(root, "orbax")
    try:
        t0 = time.perf_counter()
        nbytes = write_checkpoint(st_dir, args.layers)
        print(f"wrote {nbytes / 1e9:.2f} GB of safetensors in {time.perf_counter() - t0:.0f} s")
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
        env.update(
            JAX_PLATFORMS="cpu",
            XLA_FLAGS="--xla_force_host_platform_device_count=8",
            PYTHONPATH=REPO,
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxserve.cli",
                "convert",
                st_dir,
                orbax_dir,
                "--dtype",
                "bfloat16",
            ],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        print(f"load average {os.getloadavg()[0]:.1f}; model {nbytes / 1e9:.3f} GB")
        print(
            "| mode | TP | peak RSS above base | x model | peak anon above base | x model | GB/s |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        modes = [m for m in args.modes.split(",") if m]
        if args.baseline_src and "main-whole" not in modes:
            modes.insert(0, "main-whole")
        for tp in map(int, args.tp.split(",")):
            for mode in modes:
                path = orbax_dir if mode.startswith("orbax") else st_dir
                child_env = dict(env)
                if mode == "main-whole":  # the older package first on the path
                    child_env["PYTHONPATH"] = os.pathsep.join([args.baseline_src, REPO])
                out = subprocess.run(
                    [sys.executable, __file__, "--child", mode, path, str(tp)],
                    capture_output=True,
                    text=True,
                    env=child_env,
                )
                if out.returncode:
                    print(f"| {mode} | {tp} | failed: {out.stderr.strip().splitlines()[-1]} |")
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                if mode == "main-whole":
                    assert r["package"].startswith(args.baseline_src), r["package"]
                print(
                    f"| {mode} | {tp} | {r['peak_rss_above_base'] / 1e9:.2f} GB | "
                    f"{r['peak_rss_above_base'] / nbytes:.2f} | "
                    f"{r['peak_anon_above_base'] / 1e9:.2f} GB | "
                    f"{r['peak_anon_above_base'] / nbytes:.2f} | "
                    f"{nbytes / 1e9 / r['seconds']:.2f} |",
                    flush=True,
                )
        print(f"load average {os.getloadavg()[0]:.1f}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
