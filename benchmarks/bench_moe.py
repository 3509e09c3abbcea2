"""Step time of a mixture-of-experts model vs a dense model with the same active parameters, at
1, 64 and 256 running decodes, and the MoE model's per-layer expert load (#30).

Both models are random (``load_format="dummy"``) Llama-shaped decoders, float32, identical but
for the feed-forward: the MoE model has ``E`` experts of width ``f``, top ``k``; the dense peer
one SwiGLU of width ``k * f`` (so the same matmul FLOPs per token; the router's ``e * E`` extra
weights are the only difference in active parameters). Both engines are built once and the
runs are interleaved (round r: for each batch, dense then MoE), so the box's load moves both.

A run: ``B`` requests of ``--input-len`` random tokens are prefilled, then ``--steps`` decode
steps (every request running, one token each) are timed one by one (``LLMEngine.step``, host
work included); the figure is the median. Printed per batch: both medians and MoE / dense.

Expert load: a third engine, the MoE model with ``--expert-load-metrics``' recorder (kept apart
from the timed one: its callbacks cost a device-to-host copy per layer per step) runs the 64-
decode workload; per MoE layer, tokens per expert and max/mean (1 = balanced) are printed.

  nice .venv/bin/python benchmarks/bench_moe.py --rounds 3

``--layer``: one MoE feed-forward alone (``SparseMoeBlock``, random weights) at ``--tokens``
tokens vs a dense SwiGLU of width ``k * f`` (same FLOPs), jitted, median of ``--reps``; prints
ms, TFLOP/s of the active expert matmuls (``2 * T * k * 3 * e * f``) and MoE / dense. At
Mixtral-8x7B's shapes on one GPU (``scripts/gpu_check.sh``):
  python benchmarks/bench_moe.py --layer --hidden-size 4096 --expert-width 14336 \
      --num-experts 8 --top-k 2 --dtype bfloat16 --tokens 1,64,256,2048,8192

The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxserve.model.expert_load import max_over_mean  # noqa: E402


def hf_configs(args) -> tuple[dict, dict]:
    """The MoE config (Mixtral-style) and its dense peer with the same active parameters."""
    base = dict(
        vocab_size=4096,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden_size // 8,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
    )
    moe = dict(
        base,
        architectures=["MixtralForCausalLM"],
        intermediate_size=args.expert_width,
        num_local_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
    )
    dense = dict(
        base, architectures=["LlamaForCausalLM"], intermediate_size=args.top_k * args.expert_width
    )
    return moe, dense


def build(hf: dict, args, root: str, name: str, **extra):
    from jaxserve import LLM

    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    max_b = max(args.batches)
    return LLM(
        path,
        load_format="dummy",
        dtype="float32",
        block_size=16,
        max_num_seqs=max_b,
        # One step prefills every request, so all of them decode together afterwards.
        max_num_batched_tokens=max(max_b * args.input_len, 256),
        max_model_len=args.input_len + args.steps + 64,
        num_gpu_blocks_override=max_b * (-(-(args.input_len + args.steps + 64) // 16)) + 8,
        token_buckets=",".join(
            str(b) for b in sorted({*args.batches, max(max_b * args.input_len, 256)})
        ),
        enable_prefix_caching=False,
        warmup=True,
        compilation_cache_dir="",
        **extra,
    ).llm_engine


def decode_steps(engine, batch: int, args, seed: int) -> list[float]:
    """Prefill ``batch`` requests, then time ``args.steps`` all-decode steps (seconds each)."""
    import numpy as np

    from jaxserve import SamplingParams

    rng = np.random.default_rng(seed)
    # Long enough that the first requests still run when the last one's prefill is done.
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 48, ignore_eos=True)
    ids = [f"{seed}-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = rng.integers(3, 4096, args.input_len).tolist()
        engine.add_request(rid, prompt, params, final_only=True)
    # Prefill until every request has its first token (all running, each decoding one a step).
    sched = engine.scheduler
    while len(sched.waiting) or any(r.num_output_tokens < 1 for r in sched.running):
        engine.step()
    assert len(sched.running) == batch, (len(sched.running), batch)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def layer_bench(args) -> dict:
    """``--layer``: the MoE block alone vs a dense SwiGLU of the same FLOPs (see the docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxserve.model.arch_config import MoEConfig
    from jaxserve.model.layers.mlp import GatedMLP
    from jaxserve.model.layers.moe import SparseMoeBlock

    e, f, n, k = args.hidden_size, args.expert_width, args.num_experts, args.top_k
    dtype = jnp.dtype(args.dtype)
    moe_cfg = MoEConfig(n, k, f, norm_topk_prob=True, sparse_layers=(True,))
    modules = {
        "dense": GatedMLP(e, k * f, bias=False, dtype=dtype, rngs=nnx.Rngs(0)),
        "moe": SparseMoeBlock(e, moe_cfg, dtype=dtype, rngs=nnx.Rngs(0), impl=args.impl),
    }
    steps = {}
    for name, module in modules.items():
        graphdef, state = nnx.split(module)
        steps[name] = (jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x)), state)
    out = {"backend": jax.default_backend(), "tokens": {}}
    for t in args.tokens:
        x = jnp.asarray(np.random.default_rng(t).standard_normal((t, e)), dtype)
        row = {}
        for name, (fn, state) in steps.items():
            fn(state, x).block_until_ready()  # compile
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn(state, x).block_until_ready()
                times.append(time.perf_counter() - t0)
            row[f"{name}_ms"] = statistics.median(times) * 1e3
        flops = 2 * t * k * 3 * e * f
        row["moe_tflops"] = flops / (row["moe_ms"] * 1e-3) / 1e12
        row["ratio"] = row["moe_ms"] / row["dense_ms"]
        out["tokens"][t] = row
        print(
            f"tokens {t:5d}: dense {row['dense_ms']:8.3f} ms  moe {row['moe_ms']:8.3f} ms  "
            f"moe/dense {row['ratio']:.2f}  moe {row['moe_tflops']:.2f} TFLOP/s"
        )
    print(json.dumps(out))
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--batches", default="1,64,256", help="running decodes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per run")
    parser.add_argument("--input-len", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-width", type=int, default=1024)
    parser.add_argument("--layer", action="store_true", help="time one MoE block alone")
    parser.add_argument("--tokens", default="1,64,256,2048", help="--layer: tokens per call")
    parser.add_argument("--dtype", default="float32", help="--layer: parameter dtype")
    parser.add_argument("--impl", default="auto", help="--layer: grouped_matmul implementation")
    parser.add_argument("--reps", type=int, default=10, help="--layer: timed calls per size")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if args.layer:
        return layer_bench(args)
    moe_hf, dense_hf = hf_configs(args)
    results: dict = {"config": {k: v for k, v in vars(args).items()}, "batches": {}}
    with tempfile.TemporaryDirectory() as root:
        engines = {
            "dense": build(dense_hf, args, root, "dense"),
            "moe": build(moe_hf, args, root, "moe"),
        }
        times = {(m, b): [] for b in args.batches for m in engines}
        for r in range(args.rounds):
            for b in args.batches:
                for m, engine in engines.items():
                    times[(m, b)] += decode_steps(engine, b, args, seed=r)
        for b in args.batches:
            dense = statistics.median(times[("dense", b)]) * 1e3
            moe = statistics.median(times[("moe", b)]) * 1e3
            results["batches"][b] = {"dense_ms": dense, "moe_ms": moe, "ratio": moe / dense}
            print(
                f"decodes {b:4d}: dense {dense:8.2f} ms  moe {moe:8.2f} ms  moe/dense {moe / dense:.2f}"
            )
        del engines
        load_engine = build(moe_hf, args, root, "moe-load", expert_load_metrics=True)
        recorder = load_engine.runner.expert_load
        decode_steps(load_engine, 64 if 64 in args.batches else args.batches[0], args, seed=99)
        totals = recorder.totals()
        ratio = max_over_mean(totals)
        results["expert_load"] = {}
        for row, layer in enumerate(recorder.layers):
            print(
                f"layer {layer}: tokens per expert {totals[row].tolist()}  max/mean {ratio[row]:.2f}"
            )
            results["expert_load"][layer] = {
                "tokens": totals[row].tolist(),
                "max_over_mean": ratio[row],
            }
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
