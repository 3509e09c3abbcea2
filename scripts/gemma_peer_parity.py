"""Greedy tokens of vLLM's CPU build, or of jaxserve, on a Gemma golden fixture's prompts against
transformers' (the fixture's ``greedy_<i>``), with the largest top-5 log-probability difference.

vLLM's CPU attention refuses head_dim 16 / 24 (the committed fixtures'), so the peer check runs
on fixtures remade with ``--head-dim 32`` (same configs and seeds otherwise):

    /work/vllm-venv/bin/python scripts/make_golden.py --out /tmp/gemma32 --only gemma2 gemma3 --head-dim 32
    VLLM_CPU_KVCACHE_SPACE=1 /work/vllm-venv/bin/python scripts/gemma_peer_parity.py vllm /tmp/gemma32/gemma2
    JAX_PLATFORMS=cpu .venv/bin/python scripts/gemma_peer_parity.py jaxserve /tmp/gemma32/gemma2

Prints one JSON line: per prompt, its length, whether the tokens equal transformers', and the
largest |logprob - transformers' log-softmax| over the returned top-5 (when equal).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def main() -> None:
    engine, path = sys.argv[1], sys.argv[2]
    g = np.load(os.path.join(path, "golden.npz"))
    n = sum(f.startswith("prompt_") for f in g.files)
    prompts = [g[f"prompt_{i}"].tolist() for i in range(n)]
    want = [g[f"greedy_{i}"].tolist() for i in range(n)]
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=path, dtype="float32", max_model_len=128, seed=0, max_num_seqs=4)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    else:
        from jaxserve import LLM, SamplingParams

        llm = LLM(path, dtype="float32", max_model_len=128)
        inputs = prompts
    params = SamplingParams(temperature=0, max_tokens=len(want[0]), ignore_eos=True, logprobs=5)
    rows = []
    for i, r in enumerate(llm.generate(inputs, params, use_tqdm=False)):
        got, lp = list(r.outputs[0].token_ids), g[f"greedy_logprobs_{i}"]
        diff = None
        if got == want[i]:
            top = r.outputs[0].logprobs
            diff = max(
                float(abs(d[t].logprob - lp[pos, t])) for pos, d in enumerate(top) for t in d
            )
        rows.append({"prompt_len": len(prompts[i]), "equal": got == want[i], "max_diff": diff})
    print(json.dumps({"engine": engine, "fixture": path, "rows": rows}))


if __name__ == "__main__":
    main()
