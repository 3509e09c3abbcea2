"""Multi-LoRA step cost (#33): the paged forward at 256 decodes (one token each, 64 cached
tokens per sequence) with the requests spread over 1, 8 and 32 adapters resident in a pool of
32 slots, the base-model step of a LoRA-enabled model (no adapter token: no LoraBatch) against
the same model without pools, and an adapter's load time from disk and from the host tier.
Timed interleaved, as medians and ratios within one run, with the load average printed.

    nice -n 19 env JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_lora.py [--shape mid]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jaxserve.lora.manager import LoRAManager
from jaxserve.model.arch_config import ModelArchConfig
from jaxserve.model.attention import PagedAttentionMetadata
from jaxserve.model.registry import resolve_model_class
from jaxserve.worker.lora_slots import LoRASlots, enable_model_lora

SHAPES = {  # HF config fields of a Llama: the bundled tiny model's, and a mid-size one
    "tiny": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "mid": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
    ),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(4,))
def step(graphdef, params, ids, positions, kv, md):
    model = nnx.merge(graphdef, params)
    hidden, kv = model(ids, positions, kv, md)
    return model.compute_logits(hidden[-1:]), kv


def build(cfg, lora: bool, max_loras: int, rank: int):
    model = resolve_model_class(cfg.architecture)(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    targets = enable_model_lora(model, max_loras, rank) if lora else None
    graphdef, state = nnx.split(model)
    params, treedef = jax.tree.flatten(state)
    slots = LoRASlots(model, targets, state, lambda: params, max_loras, "sgmv") if lora else None
    return model, graphdef, treedef, params, targets, slots


def write_adapter(path: str, cfg: ModelArchConfig, targets: dict, rank: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    tensors = {}
    for module, (n_in, n_out) in targets.items():
        pre = f"base_model.model.model.{module}"
        tensors[f"{pre}.lora_A.weight"] = rng.standard_normal((rank, n_in), np.float32) * 0.01
        tensors[f"{pre}.lora_B.weight"] = rng.standard_normal((n_out, rank), np.float32) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write(
            f'{{"peft_type": "LORA", "r": {rank}, "lora_alpha": {2 * rank}, '
            f'"target_modules": {list(TARGETS)!r}}}'.replace("'", '"')
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--shape", choices=SHAPES, default="tiny")
    p.add_argument("--decodes", type=int, default=256)
    p.add_argument("--max-loras", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--backend", default="sgmv", choices=("sgmv", "gather", "ragged"))
    args = p.parse_args()
    hf = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=4096,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        **SHAPES[args.shape],
    )
    cfg = ModelArchConfig.from_hf_config(hf)
    s = t = args.decodes
    block = 16
    per_seq = math.ceil((args.context + 1) / block)
    num_blocks = 1 + s * per_seq
    tables = (1 + np.arange(s * per_seq, dtype=np.int32)).reshape(s, per_seq)
    md = PagedAttentionMetadata(
        slot_mapping=jnp.asarray(
            (tables[:, args.context // block] * block + args.context % block)[None]
        ),
        block_tables=jnp.asarray(tables[None]),
        context_lens=jnp.full((s,), args.context + 1, jnp.int32),
        query_start_loc=jnp.arange(s + 1, dtype=jnp.int32),
        num_seqs=jnp.asarray(s, jnp.int32),
    )
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 4000, t), jnp.int32)
    positions = jnp.full((t,), args.context, jnp.int32)
    kv_shape = (num_blocks, block, cfg.num_kv_heads, cfg.head_dim)

    def fresh_kv():
        return [(jnp.zeros(kv_shape), jnp.zeros(kv_shape)) for _ in range(cfg.num_layers)]

    _, gd_base, td_base, p_base, _, _ = build(cfg, False, 0, 0)
    model, gd, td, params, targets, slots = build(cfg, True, args.max_loras, args.rank)
    slots.backend = args.backend
    tmp = tempfile.mkdtemp(prefix="bench_lora_")
    manager = LoRAManager(args.max_loras, args.max_loras, args.rank, targets, slots.write_slot)
    t0 = time.perf_counter()
    for i in range(args.max_loras):
        write_adapter(os.path.join(tmp, f"a{i}"), cfg, targets, args.rank, i)
    write_s = time.perf_counter() - t0
    for i in range(args.max_loras):
        manager.register(f"a{i}", os.path.join(tmp, f"a{i}"))
    disk_s = manager.stats.disk_seconds / manager.stats.disk_loads
    manager.activate({f"a{i}" for i in range(args.max_loras)})
    warm = []  # the first write above compiled the slot update: time warm writes
    for _ in range(5):
        t1 = time.perf_counter()
        slots.write_slot(0, manager.host["a0"])
        jax.block_until_ready(params)
        warm.append(time.perf_counter() - t1)
    slot_s = float(np.median(warm))
    adapter_mb = manager.host["a0"].nbytes / 2**20

    cases = {
        "base, no --enable-lora": (gd_base, td_base, p_base, None),
        "base, --enable-lora": (gd, td, params, None),
    }
    for used in [u for u in (1, 8, 32) if u <= args.max_loras]:
        seq_slots = np.arange(s) % used
        cases[f"{used} adapters"] = (
            gd,
            td,
            params,
            slots.step_batch(seq_slots, np.ones(s, int), t),
        )
    kvs = {name: fresh_kv() for name in cases}

    def run(name):
        g, tdef, prm, lora = cases[name]
        m = dataclasses_replace(md, lora)
        out, kvs[name] = step(g, jax.tree.unflatten(tdef, prm), ids, positions, kvs[name], m)
        return out

    for name in cases:  # compile
        run(name).block_until_ready()
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name in cases:
            t1 = time.perf_counter()
            run(name).block_until_ready()
            times[name].append(time.perf_counter() - t1)
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(
        f"{args.shape} Llama ({cfg.num_layers} layers, hidden {cfg.hidden_size}), "
        f"{args.decodes} decodes at context {args.context}, {args.max_loras} slots of rank "
        f"{args.rank}, backend {args.backend}, {jax.devices()[0].platform}; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    for name, v in med.items():
        print(
            f"  {name:24s} {v * 1e3:9.2f} ms  x{v / med['1 adapters']:.3f} of 1 adapter  "
            f"x{v / med['base, no --enable-lora']:.3f} of base"
        )
    print(
        f"  adapter ({adapter_mb:.2f} MiB float32): disk read+check {disk_s * 1e3:.2f} ms, "
        f"host tier -> device slot {slot_s * 1e3:.2f} ms (writing {args.max_loras} files "
        f"took {write_s:.2f} s)"
    )


def dataclasses_replace(md, lora):
    import dataclasses

    return dataclasses.replace(md, lora=lora)


if __name__ == "__main__":
    main()
