"""CPU attention: the path the "xla" backend runs (``jaxserve.model.chunked_attention``)
at realistic step shapes, against the whole-row oracle (``ragged_paged_attention_reference``)
where the oracle fits, one jitted call per case, at the shapes of the tiny peer checkpoint (Hq 4,
Hkv 2, D 32, block 32) or others (``--heads 9:3:64`` SmolLM2's, ``--heads 32:8:128`` Llama-3-8B's).

  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_cpu_attention.py [--oracle] [--heads HQ:HKV:D]
      [CASE ...]

Cases (T = token bucket, S = sequence bucket, P = block-table width): decodes of one sequence at
2k / 6k / 12k tokens of context (P = 512, ``max_model_len`` 16,384); 16 decodes at ~600; 100
decodes at 129-191 (P = 32); a fresh 512-token prefill, 4 fresh 128-token prefills; a 512-token
prefill chunk ending at 2k / 6k / 12k; 15 decodes beside a 497-token prefill (T = 512). Prints
per case the wall ms, the process CPU ms per call (minimum over ``--repeats``; CPU time is
the steadier one on a shared box, and with ``XLA_FLAGS="--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1"`` it is the work itself) and GFLOP/s (the causal pairs' 4 D
flops per query head, over the wall time). ``--oracle`` also runs the oracle on
the cases where it fits (P = 32/128) and prints the largest difference.
On the CPU backend the whole step (decode, short and prefill rows) runs in our C++ kernel (``jaxserve.model.cpu_kernels``)
where it builds; ``JAXSERVE_CPU_KERNEL=0`` times the jnp passes instead (run both, interleaved).
The script only calls ``chunked_paged_attention(..., sm_scale=...)``, so pointing
``PYTHONPATH`` at an older tree times that tree's path on the same cases.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# appended, not prepended: a PYTHONPATH pointing at another tree wins
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxserve.model.chunked_attention import chunked_paged_attention  # noqa: E402
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference  # noqa: E402

BS, HQ, HKV, D, NUM_BLOCKS = 32, 4, 2, 32, 4096
_RNG = np.random.default_rng(1)
CASES = {  # name: (T, S, P, query lens, context lens)
    "decode 1 @128": (16, 16, 128, [1], [128]),
    "decode 1 @2k": (16, 16, 512, [1], [2000]),
    "decode 1 @6k": (16, 16, 512, [1], [6000]),
    "decode 1 @12k": (16, 16, 512, [1], [12000]),
    "decode 16 @520-670": (16, 16, 128, [1] * 16, list(range(520, 680, 10))),
    "decode 100 @129-191": (128, 128, 32, [1] * 100, list(_RNG.integers(129, 192, 100))),
    "decode 16 @3000-3200": (16, 16, 128, [1] * 16, list(range(3000, 3200, 12))[:16]),
    "prefill 512 fresh": (512, 128, 32, [512], [512]),
    "prefill 4 x 128 fresh": (512, 128, 32, [128] * 4, [128] * 4),
    "prefill 512 @2k": (512, 16, 512, [512], [2000]),
    "prefill 512 @6k": (512, 16, 512, [512], [6000]),
    "prefill 512 @12k": (512, 16, 512, [512], [12000]),
    "15 decodes @530-670 + prefill 497": (
        512,
        128,
        128,
        [1] * 15 + [497],
        list(range(530, 680, 10)) + [497],
    ),
}


def make_case(rng, num_tokens, num_slots, pages, query_lens, ctx_lens):
    """Metadata of a ragged step (distinct random blocks per sequence) and random queries."""
    n = len(query_lens)
    ctx = np.zeros(num_slots, np.int32)
    ctx[:n] = ctx_lens
    qsl = np.full(num_slots + 1, sum(query_lens), np.int32)
    qsl[: n + 1] = np.concatenate([[0], np.cumsum(query_lens)])
    bt = np.zeros((num_slots, pages), np.int32)
    free = rng.permutation(np.arange(1, NUM_BLOCKS))
    used = 0
    for i, c in enumerate(ctx_lens):
        nb = -(-c // BS)
        bt[i, :nb] = free[used : used + nb]
        used += nb
    q = rng.standard_normal((num_tokens, HQ, D), np.float32)
    return jnp.asarray(q), jnp.asarray(bt), jnp.asarray(ctx), jnp.asarray(qsl), jnp.int32(n)


def time_call(f, args, repeats: int) -> tuple[float, float]:
    """(min wall ms, min process CPU ms) per call."""
    f(*args).block_until_ready()
    wall, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        f(*args).block_until_ready()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - t)
    return 1e3 * min(wall), 1e3 * min(cpu)


def main() -> None:
    global HQ, HKV, D
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("cases", nargs="*", help=f"case names (default: all): {list(CASES)}")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--oracle", action="store_true", help="also run the oracle (P <= 128)")
    parser.add_argument("--heads", default=f"{HQ}:{HKV}:{D}", help="query heads:KV heads:head size")
    args = parser.parse_args()
    HQ, HKV, D = (int(x) for x in args.heads.split(":"))
    rng = np.random.default_rng(0)
    cache = (NUM_BLOCKS, BS, HKV, D)
    kc = jnp.asarray(rng.standard_normal(cache, np.float32))
    vc = jnp.asarray(rng.standard_normal(cache, np.float32))
    chunked = jax.jit(lambda *a: chunked_paged_attention(*a, sm_scale=D**-0.5))
    oracle = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=D**-0.5))
    print(f"{'case':36s} {'wall ms':>9s} {'CPU ms':>9s} {'GFLOP/s':>8s}", flush=True)
    for name in args.cases or CASES:
        q, bt, ctx, qsl, n = make_case(rng, *CASES[name])
        call = (q, kc, vc, bt, ctx, qsl, n)
        wall, cpu = time_call(chunked, call, args.repeats)
        _, _, _, q_lens, ctx_lens = CASES[name]
        pairs = sum(q_len * (c - q_len + (q_len + 1) / 2) for q_len, c in zip(q_lens, ctx_lens))
        line = f"{name:36s} {wall:9.2f} {cpu:9.2f} {4 * D * HQ * pairs / wall / 1e6:8.1f}"
        if args.oracle and bt.shape[1] <= 128:
            o_wall, o_cpu = time_call(oracle, call, max(1, args.repeats // 3))
            real = int(qsl[int(n)])
            diff = float(jnp.abs(oracle(*call)[:real] - chunked(*call)[:real]).max())
            line += f"   oracle {o_wall:9.2f} {o_cpu:9.2f}   max |diff| {diff:.1e}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
