"""Micro-benchmark of the LoRA delta backends at 256 decode tokens (#33): step time of one
projection's delta over 1, 8 and 32 adapters in use, interleaved, as ratios to 1 adapter.

    nice -n 19 JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_lora_delta.py

Backends: ``sgmv`` (tokens sorted by adapter in tiles of 16, one gathered adapter per tile:
a batched GEMM over a static tile count, punica's SGMV), ``gather`` (per-token gathered low-rank product, punica's BGMV), ``ragged``
(``jax.lax.ragged_dot`` over adapter-sorted tokens), ``onehot`` (the einsum over every slot
that public JAX servers use; its cost grows with the slots, shown for reference).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.layers.lora import LoraBatch, lora_delta


def onehot_delta(x, a, b, slots):
    oh = jax.nn.one_hot(slots, a.shape[0], dtype=x.dtype)  # [T, L]
    h = jnp.einsum("ti,lir,tl->tr", x, a, oh)
    return jnp.einsum("tr,lro,tl->to", h, b, oh)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--max-loras", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--shapes", default="64x64,4096x4096", help="in x out of the projection")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    t, L, r = args.tokens, args.max_loras, args.rank
    print(f"load average {os.getloadavg()}, {jax.devices()[0].platform}, T={t} L={L} R={r}")
    for shape in args.shapes.split(","):
        n_in, n_out = map(int, shape.split("x"))
        x = jnp.asarray(rng.standard_normal((t, n_in)), jnp.float32)
        a = jnp.asarray(rng.standard_normal((L, n_in, r)) * 0.01, jnp.float32)
        b = jnp.asarray(rng.standard_normal((L, r, n_out)) * 0.01, jnp.float32)
        fns = {
            "sgmv": jax.jit(lambda x, a, b, bt: lora_delta(x, a, b, bt)),
            "gather": jax.jit(lambda x, a, b, bt: lora_delta(x, a, b, bt)),
            "ragged": jax.jit(lambda x, a, b, bt: lora_delta(x, a, b, bt)),
            "onehot": jax.jit(lambda x, a, b, bt: onehot_delta(x, a, b, bt.token_slots)),
        }
        cases = {}
        for used in (1, 8, 32):
            slots = np.arange(t) % used
            for name in fns:
                cases[name, used] = LoraBatch.from_slots(
                    slots, L, "gather" if name == "onehot" else name
                )
        times = {k: [] for k in cases}
        for k, bt in cases.items():  # compile
            fns[k[0]](x, a, b, bt).block_until_ready()
        for _ in range(args.rounds):
            for k, bt in cases.items():
                t0 = time.perf_counter()
                for _ in range(5):
                    out = fns[k[0]](x, a, b, bt)
                out.block_until_ready()
                times[k].append((time.perf_counter() - t0) / 5)
        print(f"projection {n_in}x{n_out}: median ms (ratio to 1 adapter)")
        for name in fns:
            base = np.median(times[name, 1])
            row = "  ".join(
                f"{u:>2}: {np.median(times[name, u]) * 1e3:8.3f} ({np.median(times[name, u]) / base:.2f}x)"
                for u in (1, 8, 32)
            )
            print(f"  {name:7s} {row}")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
