"""Runs the tensor-parallel harness's greedy float32 workload (``tp_harness``) on a tiny MoE
fixture (tests/fixtures/golden) with experts split by width (TP) or by number
(``--enable-expert-parallel``), and prints one JSON line per engine (a subprocess: JAX fixes the
device count at first use).

    python moe_harness.py --devices 8 --model qwen2_moe --run 1 --run ep2 --run tp4

``--run``: "N" / "tpN" for tensor parallel N, "epN" for expert parallel N. Each line:
{"model", "run", "tokens": [[...] per prompt], "placement": {...}} or {"model", "run", "error"}.
"""

from __future__ import annotations

import argparse
import json
import os

from tp_harness import ENGINE_KWARGS, MAX_TOKENS, PROMPTS

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "golden")
MOE_MODELS = ("mixtral", "qwen2_moe", "qwen3_moe")


def parse_run(run: str) -> tuple[int, bool]:
    """ "ep4" -> (4, True); "tp2" or "2" -> (2, False)."""
    if run.startswith("ep"):
        return int(run[2:]), True
    return int(run.removeprefix("tp")), False


def run(name: str, spec: str) -> dict:
    from jaxserve import LLM, SamplingParams

    size, ep = parse_run(spec)
    try:
        llm = LLM(
            os.path.join(GOLDEN, name),
            tensor_parallel_size=size,
            enable_expert_parallel=ep,
            **ENGINE_KWARGS,
        )
    except ValueError as e:
        return {"model": name, "run": spec, "error": str(e)}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    runner = llm.llm_engine.runner
    block = next(layer for layer in runner.state["layers"].values() if "experts" in layer["mlp"])
    up = block["mlp"]["experts"]["up_proj"]["weight"][...]
    return {
        "model": name,
        "run": spec,
        "tokens": [o.outputs[0].token_ids for o in outs],
        "placement": {
            "up_proj": list(up.shape),
            "up_proj_shard": list(up.addressable_shards[0].data.shape),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--run", action="append", required=True)
    args = parser.parse_args()
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    for name in args.model:
        for spec in args.run:
            print(json.dumps(run(name, spec)), flush=True)


if __name__ == "__main__":
    main()
