"""Runs the same greedy float32 workload on engines of several tensor-parallel sizes and prints
one JSON line per engine (run in a subprocess: JAX fixes the device count at first use).

    python tp_harness.py --devices 8 --model llama --tp 1,2,4,8 [--backend xla]

``--model`` names a fixture under tests/fixtures/tp, a Gemma golden fixture (tests/fixtures/golden:
4 query / 2 KV heads, so TP 4 replicates KV heads), or "bundled" for checkpoints/tiny-llama.
The workload covers prefix caching (prompts sharing two blocks), chunked prefill (a prompt
longer than the per-request chunk) and preemption (a pool too small for every request at once).
Each line: {"model", "tp", "tokens": [[...] per prompt], "stats": {...}, "placement": {...}} or
{"model", "tp", "error": message} when the engine refuses the size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.path.join(HERE, "..", "fixtures", "tp")
GOLDEN = os.path.join(HERE, "..", "fixtures", "golden")
FIXTURE_MODELS = ("llama", "qwen2", "qwen3", "mistral")
GEMMA_MODELS = ("gemma2", "gemma3")
GEMMA_TP_SIZES = (1, 2, 4)
TP_SIZES = (1, 2, 4, 8)

SHARED = [1, 17, 23, 5, 99, 42, 7, 64, 11, 3, 250, 31, 77, 18, 90, 120]  # two blocks of 8
PROMPTS = [
    SHARED + [5, 6, 7],
    SHARED + [200, 13],
    [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60]
    + [61, 62, 63, 64, 65, 66, 67, 68, 69, 70],  # 32 tokens: 2 chunks of 16
    [1, 9, 8, 7],
    SHARED + [150],
]
MAX_TOKENS = 16

ENGINE_KWARGS = dict(
    dtype="float32",
    block_size=8,
    max_num_batched_tokens=32,
    long_prefill_token_threshold=16,
    max_num_seqs=4,
    max_model_len=128,
    num_gpu_blocks_override=16,  # 15 usable blocks: 4 running requests need up to 20
    token_buckets="32",
    warmup=False,
    compilation_cache_dir="",
)

# Gemma's fixtures run on the hybrid KV cache: three groups (one global layer, two local ones of
# window 4), so a block holds one layer's K/V and a request may hold up to 18 blocks (a 32-token
# chunk on top of each window); 23 usable blocks still preempt (TP under per-group tables).
GEMMA_POOL = dict(num_gpu_blocks_override=24)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child JAX process on CPU: the parent's device flags removed, the
    repository and this folder importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([REPO, HERE]), **extra)
    return env


def model_path(name: str) -> str | None:
    """The fixture's directory, or None (the bundled checkpoint) for "bundled"."""
    if name == "bundled":
        return None
    return os.path.join(GOLDEN if name in GEMMA_MODELS else FIXTURES, name)


def run(
    name: str, tp: int, backend: str, max_tokens: int = MAX_TOKENS, speculative_config: str = ""
) -> dict:
    from jaxserve import LLM, SamplingParams

    extra = {"speculative_config": speculative_config} if speculative_config else {}
    try:
        llm = LLM(
            model_path(name),
            tensor_parallel_size=tp,
            attention_backend=backend,
            pallas_interpret=backend.startswith("pallas"),  # the kernel interpreted on CPU
            # Mistral's 8-token window frees blocks as fast as decoding takes them: with the
            # hybrid KV cache this workload never preempts, and TP under preemption is the point
            # here (the hybrid cache's own tests cover its windows; tests/engine/
            # test_hybrid_kv_engine.py).
            disable_hybrid_kv_cache_manager=name == "mistral",
            **{**ENGINE_KWARGS, **(GEMMA_POOL if name in GEMMA_MODELS else {})},
            **extra,
        )
    except ValueError as e:
        return {"model": name, "tp": tp, "error": str(e)}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    engine = llm.llm_engine
    stats = engine.get_stats()
    runner = engine.runner
    q = runner.state["layers"][0]["self_attn"]["q_proj"]["weight"][...]
    k_cache = runner.kv_caches[0][0]
    return {
        "model": name,
        "tp": tp,
        "tokens": [o.outputs[0].token_ids for o in outs],
        "stats": {
            "preemptions": stats.num_preemptions_total,
            "prefix_cache_hits": stats.prefix_cache_hits_total,
            "spec_decode_drafts": stats.spec_decode_num_drafts_total,
            "spec_decode_accepted_tokens": stats.spec_decode_num_accepted_tokens_total,
        },
        "placement": {
            "mesh": dict(runner.mesh.shape),
            "q_proj_shard": list(q.addressable_shards[0].data.shape),
            "q_proj": list(q.shape),
            # one CPU device: packed for the panel matmul (Linear.pack_panels)
            "q_proj_packed": _q_layer(runner).packed,
            "k_cache_shard": list(k_cache.addressable_shards[0].data.shape),
            "k_cache": list(k_cache.shape),
        },
    }


def _q_layer(runner):
    """Layer 0's q_proj ``Linear`` of the runner's model (its static attributes)."""
    from flax import nnx

    model = nnx.merge(runner.graphdef, runner.state)
    return model.layers[0].self_attn.q_proj


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--tp", default="1,2,4,8")
    parser.add_argument("--backend", default="xla")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--speculative-config", default="", help="vLLM's JSON, as serve's")
    args = parser.parse_args()
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    for name in args.model:
        for tp in (int(t) for t in args.tp.split(",")):
            result = run(name, tp, args.backend, args.max_tokens, args.speculative_config)
            print(json.dumps(result), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
