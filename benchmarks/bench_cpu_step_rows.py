"""What a weight-bound step costs on XLA:CPU as its token count grows: SmolLM2-135M's
projections (30 layers of q/k/v/o and gate/up/down, float32, random weights; no attention, no
LM head) jitted as one program, at 1, 2, 4, 5, 8 and 16 rows (a batch-1 decode is 1 row; a
speculative verification of K = 4 drafts is 5, padded to the 8-token bucket).

  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_cpu_step_rows.py [--repeats N]

Prints per row count the best and median wall ms of ``--repeats`` calls and the weight bytes
read per second at the best (the weights are 0.42 GB: a step that reads them once, at the
memory's bandwidth, costs the same at 1 row as at 8). ``XLA_FLAGS`` passes through (e.g.
``--xla_cpu_experimental_xnn_fusion_type=dot`` to try XNNPACK's dots).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS, HIDDEN, KV, MLP = 30, 576, 192, 1536  # SmolLM2-135M
SHAPES = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN)]
SHAPES += [(HIDDEN, MLP), (HIDDEN, MLP), (MLP, HIDDEN)]


@jax.jit
def step(x, weights):
    for q_w, k_w, v_w, o_w, gate_w, up_w, down_w in weights:
        q, k, v = x @ q_w, x @ k_w, x @ v_w
        o = q @ o_w
        h = jax.nn.silu(o @ gate_w) * (o @ up_w)
        x = x + h @ down_w + 0.0 * (k.sum() + v.sum())
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    weights = [
        [jnp.asarray(0.02 * rng.standard_normal(s, np.float32)) for s in SHAPES]
        for _ in range(LAYERS)
    ]
    nbytes = sum(w.nbytes for layer in weights for w in layer)
    print(f"weights {nbytes / 1e9:.2f} GB; rows, best ms, median ms, GB/s at best", flush=True)
    for rows in (1, 2, 4, 5, 8, 16):
        x = jnp.asarray(rng.standard_normal((rows, HIDDEN), np.float32))
        step(x, weights).block_until_ready()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            step(x, weights).block_until_ready()
            times.append(time.perf_counter() - t)
        best, median = min(times), float(np.median(times))
        print(
            f"{rows:4d} {1e3 * best:9.2f} {1e3 * median:9.2f} {nbytes / best / 1e9:7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
