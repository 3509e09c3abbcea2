"""Runs the LoRA parity workload (base, a1 and a2 mixed in one batch) at the tensor-parallel
sizes given, on simulated CPU devices; prints one JSON line per size (run as a subprocess:
JAX fixes its device count when it first initialises)."""

from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "fixtures", "lora")
BASE = os.path.join(HERE, "..", "fixtures", "golden", "llama")


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--tp", default="1,2,4")
    args = p.parse_args()
    import jax
    import numpy as np

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
    from jaxserve import LLM, SamplingParams

    golden = np.load(os.path.join(FIXTURES, "golden.npz"))
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(3)]
    names = [None, "a1", "a2"] * 3
    for tp in map(int, args.tp.split(",")):
        llm = LLM(
            BASE,
            dtype="float32",
            tensor_parallel_size=tp,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            lora_modules=[f"a1={FIXTURES}/a1", f"a2={FIXTURES}/a2"],
            max_model_len=64,
            max_num_seqs=16,
            max_num_batched_tokens=64,
            token_buckets="64",
            warmup=False,
        )
        params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
        outs = llm.generate(
            [prompts[i % 3] for i in range(len(names))], params, use_tqdm=False, lora_name=names
        )
        runner = llm.llm_engine.runner
        pool = runner.state["layers"][0]["self_attn"]["q_proj"]["lora_b"][...]
        print(
            json.dumps(
                {
                    "tp": tp,
                    "names": names,
                    "tokens": [o.outputs[0].token_ids for o in outs],
                    "logprobs": [
                        [
                            lp[t].logprob
                            for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)
                        ]
                        for o in outs
                    ],
                    "lora_b_shard": list(pool.addressable_shards[0].data.shape),
                    "lora_b": list(pool.shape),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
