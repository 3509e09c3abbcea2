"""Where a batch-1 step's time goes, with speculative decoding off, n-gram and the draft model:
each jitted call of a step (the forward, the sampler, the drafts' logits and sampler, the
draft's prefill and proposal) timed to completion (``block_until_ready`` after each, so the
calls run one after another: the sum is the step's device work without overlap), per device
step, beside the wall time per device step (the rest of it: host work).

CPU, the bundled model and its draft (one request at a time, greedy):
  .venv/bin/python benchmarks/profile_spec_step.py --output-len 64
n-gram only (no draft model needed), e.g. SmolLM2:
  .venv/bin/python benchmarks/profile_spec_step.py --model smollm2 --quantization none \
      --max-model-len 1024 --max-num-seqs 4 --output-len 48 --workloads ngram-copy
"""

from __future__ import annotations

import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_spec_decode as bench_mod  # noqa: E402


def _timed(name: str, fn, table: dict):
    import jax

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        jax.block_until_ready(out)
        table[name] += time.perf_counter() - t0
        return out

    return call


def main(argv=None) -> None:
    args = bench_mod.parse_args(argv)
    from jaxserve.config import SpeculativeConfig
    from jaxserve.worker import model_runner as mr

    # --workloads ngram-copy: the n-gram rows only (no draft model needed)
    with_draft = "draft" in args.workloads.split(",")
    if with_draft and args.draft is None:
        raise SystemExit("--draft: the draft rows need a draft model (or --workloads ngram-copy)")
    bench = bench_mod.Bench(args, with_draft=with_draft)
    runner, draft = bench.runner, bench.draft
    table: dict[str, float] = collections.defaultdict(float)
    names = ("forward_step", "sample_step", "spec_logits_step", "spec_sample_step")
    names += ("forward_hidden_step", "verify_logits_step")  # a small verification step
    for name in names:
        setattr(mr, name, _timed(name, getattr(mr, name), table))
    if with_draft:
        draft.prefill = _timed("draft_prefill", draft.prefill, table)
        draft.propose = _timed("draft_propose", draft.propose, table)
    for name, aot in list(runner.aot_forward.items()):  # the warmed-up forwards
        runner.aot_forward[name] = _timed("forward_step", aot, table)
    for name, aot in list(runner.aot_forward_hidden.items()):
        runner.aot_forward_hidden[name] = _timed("forward_hidden_step", aot, table)
    specs = {
        "off": None,
        "ngram": SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=args.ngram_k,
            prompt_lookup_max=args.ngram_max,
            prompt_lookup_min=1,
        ),
    }
    prompts = {"ngram": bench_mod.copy_prompts(bench, args)}  # the bench's copy requests
    if with_draft:
        specs["draft_model"] = SpeculativeConfig(
            method="draft_model", model=args.draft, num_speculative_tokens=args.draft_k
        )
        prompts["draft_model"] = bench_mod.corpus_prompts(args.corpus, args.num_prompts)
    for workload in prompts:
        for mode in ("off", workload):
            for _ in range(2):  # the first run compiles what warm-up did not
                table.clear()
                res = bench.run(specs[mode], prompts[workload], 1, args.copy_prompts == "text")
            n, steps = res["tokens"], res["device_steps"]
            calls = ", ".join(f"{k} {1e3 * v / steps:.2f}" for k, v in sorted(table.items()))
            print(
                f"{workload} prompts, {mode}: {res['tok_s']:.1f} tok/s, {steps / n:.2f} device "
                f"steps per token, acceptance length {res['acceptance_length'] or 1:.2f}; "
                f"ms per device step: wall {1e3 * res['seconds'] / steps:.2f}, jitted calls "
                f"{1e3 * sum(table.values()) / steps:.2f} ({calls}); "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
