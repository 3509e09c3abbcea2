"""CPU attention: the whole-row oracle (``ragged_paged_attention_reference``) vs the key-chunked
path the "reference" backend runs (``jaxserve.model.chunked_attention``), one jitted call each,
at the shapes of the tiny peer checkpoint (Hq 4, Hkv 2, D 32, block 32, max_model_len 1,024).

  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_cpu_attention.py

Cases: decode of 100 sequences at 129-191 tokens of context (T = S = 128), and a prefill of 4 x
128 fresh tokens (T = 512, S = 128). Prints the median ms per call and the largest difference.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxserve.model.chunked_attention import chunked_paged_attention  # noqa: E402
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference  # noqa: E402

P, BS, HQ, HKV, D, NUM_BLOCKS = 32, 32, 4, 2, 32, 4096


def case(rng, num_tokens, num_slots, query_lens, ctx_lens):
    n = len(query_lens)
    ctx = np.zeros(num_slots, np.int32)
    ctx[:n] = ctx_lens
    qsl = np.full(num_slots + 1, sum(query_lens), np.int32)
    qsl[: n + 1] = np.concatenate([[0], np.cumsum(query_lens)])
    bt = np.zeros((num_slots, P), np.int32)
    for i, c in enumerate(ctx_lens):
        bt[i, : -(-c // BS)] = rng.integers(1, NUM_BLOCKS, -(-c // BS))
    q = rng.standard_normal((num_tokens, HQ, D), np.float32)
    return jnp.asarray(q), jnp.asarray(bt), jnp.asarray(ctx), jnp.asarray(qsl), jnp.int32(n)


def main() -> None:
    rng = np.random.default_rng(0)
    cache = (NUM_BLOCKS, BS, HKV, D)
    kc = jnp.asarray(rng.standard_normal(cache, np.float32))
    vc = jnp.asarray(rng.standard_normal(cache, np.float32))
    cases = {
        "decode 100 x ctx 129-191 (T=128)": case(
            rng, 128, 128, [1] * 100, rng.integers(129, 192, 100)
        ),
        "prefill 4 x 128 (T=512)": case(rng, 512, 128, [128] * 4, [128] * 4),
    }
    for name, (q, bt, ctx, qsl, n) in cases.items():
        outs = {}
        for label, fn in (
            ("oracle", ragged_paged_attention_reference),
            ("chunked", chunked_paged_attention),
        ):
            f = jax.jit(lambda *a, fn=fn: fn(*a, sm_scale=D**-0.5))
            args = (q, kc, vc, bt, ctx, qsl, n)
            outs[label] = f(*args).block_until_ready()
            times = []
            for _ in range(7):
                t = time.perf_counter()
                f(*args).block_until_ready()
                times.append(time.perf_counter() - t)
            print(f"{name}: {label} {1e3 * np.median(times):.1f} ms/call", flush=True)
        real = int(qsl[int(n)])
        diff = float(jnp.abs(outs["oracle"][:real] - outs["chunked"][:real]).max())
        print(f"{name}: max |oracle - chunked| = {diff:.2e}")


if __name__ == "__main__":
    main()
