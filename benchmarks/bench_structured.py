"""Structured outputs: the host cost of the token masks and the step-time overhead they add.

1. ``mask``: ``TokenMaskManager.step_mask`` alone at ``--num-reqs`` running requests with JSON
   schemas (the twenty test schemas, each wrapped as "an array of 100+ of these" so no request
   finishes), advancing each request by one random allowed token per step, as the sampler would.
   Reports the median ms per step and us per request.
2. ``engine``: median ``LLMEngine.step()`` time in steady decode at ``--num-reqs`` running
   requests, unconstrained vs every request constrained, interleaved rounds; the overhead is the
   ratio of medians. The mask is computed serially before the step today; with async scheduling
   (#16) it overlaps the device step, and the overhead then falls to what the sampler's masked
   variant costs (also printed: the serial mask time subtracted).

    .venv/bin/python benchmarks/bench_structured.py --num-reqs 256 --steps 40 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "entrypoints"))

from structured_schemas import SCHEMAS  # noqa: E402

from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

MODEL = os.path.join(ROOT, "checkpoints", "tiny-llama")


def _specs(n: int) -> list[StructuredOutputsParams]:
    out = []
    for i in range(n):
        item = dict(SCHEMAS[i % len(SCHEMAS)])
        defs = item.pop("$defs", {})  # refs resolve against the root
        out.append(
            StructuredOutputsParams(
                json={"$defs": defs, "type": "array", "items": item, "minItems": 100}
            )
        )
    return out


def bench_mask(num_reqs: int, steps: int) -> dict:
    import types

    from jaxserve.structured import TokenMaskManager
    from jaxserve.tokenizer import get_tokenizer

    tok = get_tokenizer(MODEL)
    masks = TokenMaskManager(tok)
    requests = {}
    for i, spec in enumerate(_specs(num_reqs)):
        masks.add_request(f"r{i}", SamplingParams(structured_outputs=spec))
        requests[f"r{i}"] = types.SimpleNamespace(output_token_ids=[])
    sched = types.SimpleNamespace(
        num_scheduled_tokens={r: 1 for r in requests}, finished_req_ids=set()
    )
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        mask = masks.step_mask(sched, requests)
        times.append(time.perf_counter() - t0)
        bits = np.unpackbits(mask.bitmask.view(np.uint8), axis=1, bitorder="little")
        for k, rid in enumerate(mask.req_ids):
            allowed = np.nonzero(bits[k, : tok.vocab_size])[0]
            requests[rid].output_token_ids.append(int(rng.choice(allowed)))
    med = statistics.median(times[2:])
    return {"mask_ms_per_step": med * 1e3, "mask_us_per_request": med * 1e6 / num_reqs}


def bench_engine(num_reqs: int, steps: int, rounds: int) -> dict:
    from jaxserve.config import EngineArgs
    from jaxserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=MODEL,
            dtype="float32",
            attention_backend="xla",
            max_model_len=256,
            max_num_seqs=num_reqs,
            max_num_batched_tokens=512,
            token_buckets=f"{num_reqs},512",
            num_gpu_blocks_override=num_reqs * 8 + 8,
        )
    )
    specs = _specs(num_reqs)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 4000, size=8).tolist() for _ in range(num_reqs)]

    def run(constrained: bool, tag: str) -> tuple[float, float]:
        for i, p in enumerate(prompts):
            params = SamplingParams(
                temperature=1.0,
                max_tokens=steps + 16,
                ignore_eos=True,
                seed=i,
                structured_outputs=specs[i] if constrained else None,
            )
            engine.add_request(f"{tag}-{i}", p, params)
        while engine.scheduler.get_request_counts()[1]:
            engine.step()  # admission and prefill
        for _ in range(4):
            engine.step()  # the last prefill chunk, first decode steps (a variant may compile)
        mask0 = engine.token_masks.mask_seconds
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        mask_s = (engine.token_masks.mask_seconds - mask0) / steps
        engine.abort_request([f"{tag}-{i}" for i in range(num_reqs)])
        engine.step()
        return statistics.median(times), mask_s

    free, cons, mask = [], [], []
    for r in range(rounds):
        free.append(run(False, f"f{r}")[0])
        step, m = run(True, f"c{r}")
        cons.append(step)
        mask.append(m)
    f, c, m = statistics.median(free), statistics.median(cons), statistics.median(mask)
    return {
        "step_ms_unconstrained": f * 1e3,
        "step_ms_constrained": c * 1e3,
        "overhead_serial_pct": (c / f - 1) * 100,
        "mask_ms_in_step": m * 1e3,
        "overhead_if_mask_overlapped_pct": ((c - m) / f - 1) * 100,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-reqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", choices=("mask", "engine"), default=None)
    args = parser.parse_args()
    out = {"num_reqs": args.num_reqs}
    if args.only in (None, "mask"):
        out.update(bench_mask(args.num_reqs, args.steps))
        print(json.dumps(out), flush=True)
    if args.only in (None, "engine"):
        out.update(bench_engine(args.num_reqs, args.steps, args.rounds))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
