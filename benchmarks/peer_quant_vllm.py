"""Peer check (#31): the compressed-tensors fixtures through vLLM's CPU build and through
jaxserve, greedy, the same token-id prompts; prints per scheme how many prompts give the same
tokens.

    /work/vllm-venv/bin/python benchmarks/peer_quant_vllm.py --engine vllm --out /tmp/peer_vllm.json
    .venv/bin/python benchmarks/peer_quant_vllm.py --engine jaxserve --out /tmp/peer_js.json \\
        --compare /tmp/peer_vllm.json
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "quant")
SCHEMES = ("fp8_dynamic", "fp8", "fp8_w8a16", "w8a8", "w8a16")
N_OUT = 12


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[1, 17, 42, 99, 3, 250, 7, 8, 9, 10, 128], [1, 200, 5]] + [
        [1, *rng.integers(3, 256, int(n)).tolist()] for n in rng.integers(4, 40, 6)
    ]


def run_vllm(path: str) -> list[list[int]] | str:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        llm = LLM(model=path, dtype="float32", max_model_len=256, skip_tokenizer_init=True, seed=0)
    except Exception as e:  # noqa: BLE001 - the peer's refusal is a result too
        return f"vLLM refused: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    sp = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, detokenize=False)
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()], sp, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in res]


def run_jaxserve(path: str) -> list[list[int]]:
    from jaxserve.engine.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    llm = LLM(
        path,
        dtype="float32",
        attention_backend="xla",
        max_model_len=256,
        token_buckets="16,64",
        max_num_batched_tokens=64,
        max_num_seqs=8,
        num_gpu_blocks_override=64,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts(), sp, use_tqdm=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--engine", choices=["vllm", "jaxserve"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", default="")
    args = parser.parse_args()
    run = run_vllm if args.engine == "vllm" else run_jaxserve
    results = {s: run(os.path.join(ROOT, s)) for s in SCHEMES}
    json.dump(results, open(args.out, "w"))
    if args.compare:
        other = json.load(open(args.compare))
        for s in SCHEMES:
            a, b = results[s], other.get(s)
            if isinstance(b, str) or isinstance(a, str):
                print(f"{s:12s} {a if isinstance(a, str) else b}")
                continue
            same = sum(x == y for x, y in zip(a, b))
            tok = np.mean([np.mean([p == q for p, q in zip(x, y)]) for x, y in zip(a, b)])
            print(f"{s:12s} same greedy tokens: {same}/{len(a)} prompts, {tok:.3f} of tokens")


if __name__ == "__main__":
    main()
