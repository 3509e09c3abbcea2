"""Peer check (#31): the compressed-tensors fixtures through vLLM's CPU build and through
jaxserve, greedy, the same token-id prompts; prints per scheme how many prompts give the same
tokens.

    /work/vllm-venv/bin/python scripts/make_quant_fixtures.py --head-dim 32 --out /tmp/peerfix
    VLLM_CPU_KVCACHE_SPACE=1 /work/vllm-venv/bin/python benchmarks/peer_quant_vllm.py \\
        --engine vllm --root /tmp/peerfix --out /tmp/peer_vllm.json
    .venv/bin/python benchmarks/peer_quant_vllm.py --engine jaxserve --root /tmp/peerfix \\
        --out /tmp/peer_js.json --compare /tmp/peer_vllm.json

``--root`` defaults to the committed fixtures (head_dim 16), which vLLM's CPU attention refuses
("Unsupported CPU attention configuration: head_dim=16"); the same script writes them with
head_dim 32 for this check.
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
        # enforce_eager: torch.compile took minutes per tiny model on the shared CPU box; the
        # eager path runs the same quantized kernels
        llm = LLM(
            model=path,
            dtype="float32",
            max_model_len=256,
            skip_tokenizer_init=True,
            seed=0,
            enforce_eager=True,
        )
    except Exception as e:  # noqa: BLE001 - the peer's refusal is a result too
        return f"vLLM refused: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    sp = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, detokenize=False)
    try:
        res = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts()], sp, use_tqdm=False
        )
    except Exception as e:  # noqa: BLE001
        return f"vLLM failed to run it: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        del llm
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
    parser.add_argument(
        "--engine",
        choices=["vllm", "jaxserve", "none"],
        required=True,
        help="none: read --out (an earlier run) and only --compare",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", default="")
    parser.add_argument("--root", default=ROOT, help="the fixtures' folder (one per scheme)")
    parser.add_argument(
        "--schemes", default=",".join(SCHEMES), help="comma-separated subset of the schemes"
    )
    args = parser.parse_args()
    schemes = args.schemes.split(",")
    if args.engine == "none":  # --out may name several files (runs of a few schemes each)
        results = {}
        for path in args.out.split(","):
            results.update(json.load(open(path)))
    else:
        run = run_vllm if args.engine == "vllm" else run_jaxserve
        results = {s: run(os.path.join(args.root, s)) for s in schemes}
        print(json.dumps(results), flush=True)
        json.dump(results, open(args.out, "w"))
    if args.compare:
        other = {}
        for path in args.compare.split(","):
            other.update(json.load(open(path)))
        for s in schemes:
            a, b = results[s], other.get(s)
            if isinstance(b, str) or isinstance(a, str):
                print(f"{s:12s} {a if isinstance(a, str) else b}")
                continue
            same = sum(x == y for x, y in zip(a, b))
            tok = np.mean([np.mean([p == q for p, q in zip(x, y)]) for x, y in zip(a, b)])
            print(f"{s:12s} same greedy tokens: {same}/{len(a)} prompts, {tok:.3f} of tokens")


if __name__ == "__main__":
    main()
