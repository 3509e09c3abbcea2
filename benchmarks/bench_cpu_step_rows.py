"""What a weight-bound step costs on CPU as its token count grows: SmolLM2-135M's projections
(30 layers of q/k/v/o and gate/up/down, float32, random weights; no attention, no LM head;
``--shape`` for another model's)
jitted as one program, at 1, 2, 4, 5, 8, 16, 64 and 256 rows (a batch-1 decode is 1 row; a
speculative verification of K = 4 drafts is 5, padded to the 8-token bucket; prefill chunks
are hundreds), multiplied two ways, interleaved per repeat: XLA's dot over ``[K, N]`` weights,
and our panel matmul (``jaxserve.model.cpu_kernels.panel_matmul``) over the same weights packed
in panels (what ``jaxserve`` serves with on a one-device CPU).

  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_cpu_step_rows.py [--repeats N] [--rows 1,5]

Prints per row count and way the best and median wall ms of ``--repeats`` calls, the weight
bytes read per second at the best (the weights are 0.42 GB: a step that reads them once, at the
memory's bandwidth, costs the same at 1 row as at 8; SmolLM2's) and the ratio XLA / panels of the bests.
``XLA_FLAGS`` passes through (e.g. ``--xla_cpu_experimental_xnn_fusion_type=dot`` to try
XNNPACK's dots).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxserve.model import cpu_kernels  # noqa: E402

SMOLLM2 = "30:576:192:1536"  # layers, hidden, K/V width (KV heads x head_dim), MLP width


def layer_shapes(hidden: int, kv: int, mlp: int) -> list[tuple[int, int]]:
    """``[K, N]`` of q, k, v, o, gate, up and down."""
    return [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden)] + [
        (hidden, mlp),
        (hidden, mlp),
        (mlp, hidden),
    ]


def make_step(dot):
    @jax.jit
    def step(x, weights):
        for q_w, k_w, v_w, o_w, gate_w, up_w, down_w in weights:
            q, k, v = dot(x, q_w), dot(x, k_w), dot(x, v_w)
            o = dot(q, o_w)
            h = jax.nn.silu(dot(o, gate_w)) * dot(o, up_w)
            x = x + dot(h, down_w) + 0.0 * (k.sum() + v.sum())
        return x

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rows", default="1,2,4,5,8,16,64,256")
    parser.add_argument(
        "--shape",
        default=SMOLLM2,
        help="LAYERS:HIDDEN:KV:MLP (default SmolLM2-135M's; the peer's tiny llama: 6:256:128:704)",
    )
    args = parser.parse_args()
    layers, hidden, kv, mlp = (int(v) for v in args.shape.split(":"))
    shapes = layer_shapes(hidden, kv, mlp)
    if not cpu_kernels.available():
        raise SystemExit(f"the CPU kernels are unavailable: {cpu_kernels._load()}")
    rng = np.random.default_rng(0)
    wide = [[0.02 * rng.standard_normal(s, np.float32) for s in shapes] for _ in range(layers)]
    ways = {
        "xla": (make_step(jnp.dot), [[jnp.asarray(w) for w in layer] for layer in wide]),
        "panels": (
            make_step(lambda x, w: cpu_kernels.panel_matmul(x, w, w.shape[0] * cpu_kernels.PANEL)),
            [[jnp.asarray(cpu_kernels.pack_panels(w)) for w in layer] for layer in wide],
        ),
    }
    nbytes = sum(w.nbytes for layer in wide for w in layer)
    print(f"weights {nbytes / 1e9:.2f} GB; rows, way, best ms, median ms, GB/s at best", flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, hidden), np.float32))
        times = {name: [] for name in ways}
        for step, weights in ways.values():
            step(x, weights).block_until_ready()
        for _ in range(args.repeats):
            for name, (step, weights) in ways.items():
                t = time.perf_counter()
                step(x, weights).block_until_ready()
                times[name].append(time.perf_counter() - t)
        for name, ts in times.items():
            best, median = min(ts), float(np.median(ts))
            print(
                f"{rows:4d} {name:7s} {1e3 * best:9.2f} {1e3 * median:9.2f} "
                f"{nbytes / best / 1e9:7.1f}",
                flush=True,
            )
        print(f"{rows:4d} xla / panels {min(times['xla']) / min(times['panels']):.2f}x", flush=True)


if __name__ == "__main__":
    main()
