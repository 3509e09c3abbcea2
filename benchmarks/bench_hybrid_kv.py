"""The hybrid KV cache (#29): capacity, step time, and on/off output equality.

Gemma-3-style layers: five local layers of a 1,024-token sliding window to one global layer.

1. Capacity (pure Python, the real Scheduler and KV manager, a token-echoing fake runner): a
   fixed KV memory (``--kv-gib`` GiB, Gemma-3-12B's KV shape by default: 48 layers, 8 KV heads,
   head dim 256, bfloat16), as many 32k-token requests as the scheduler takes (each: a prompt in
   chunks, then decode to 32,768 tokens). Hybrid on: 6 KV-cache groups share arrays of 8 layers, a
   block is 8 layers' K/V; off (``--disable-hybrid-kv-cache-manager``): one group, a block is all
   48 layers'. Printed: blocks per 32k sequence (the admission peak, and what a decoding
   sequence holds), the most sequences running at once in steady decode, preemptions.
2. Step time (the real ModelRunner on this machine's device): a tiny model of the same pattern
   (6 layers, hidden 256, 2 KV heads of 64, float32; ``--attention-backend``, default the
   platform's: the xla path on CPU, the Pallas kernel on a GPU or TPU), ``--seqs``
   sequences decoding at a 32,768-token context, hybrid on vs off, steps interleaved; median
   and spread of the runner's wall time per step (``execute_model``: build, forward, sample,
   tokens back). The K/V content does not matter for time, so the sequences start at their
   32k context with tables of the shape the manager gives them (no prefill).
3. Equality: the same tiny model served end to end (``LLMEngine``), greedy float32, prompts of
   1,500-3,000 tokens (past the window), hybrid on vs off: identical tokens and logprobs.

Run:  .venv/bin/python benchmarks/bench_hybrid_kv.py [--kv-gib 40] [--seqs 4] [--steps 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.kv_cache_groups import blocks_per_sequence, make_kv_cache_layout
from jaxserve.core.request import Request
from jaxserve.core.runner_output import ModelRunnerOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams

WINDOW = 1024
CONTEXT = 32768
BLOCK = 16


def pattern(num_layers: int) -> list[int | None]:
    """Gemma 3's layer kinds: every sixth layer global, the rest local."""
    return [None if (i + 1) % 6 == 0 else WINDOW for i in range(num_layers)]


# ---------------------------------------------------------------- 1. capacity


def capacity(hybrid: bool, args) -> dict:
    layout = make_kv_cache_layout(pattern(args.layers), hybrid=hybrid, max_model_len=CONTEXT)
    block_bytes = 2 * layout.num_tensors * args.kv_heads * args.head_dim * 2 * BLOCK  # bf16
    num_blocks = int(args.kv_gib * 2**30) // block_bytes
    sched_cfg = SchedulerConfig(
        max_num_batched_tokens=args.budget,
        max_num_seqs=256,
        long_prefill_token_threshold=args.budget,
        max_model_len=CONTEXT,
    )
    cache_cfg = CacheConfig(block_size=BLOCK, kv_cache_groups=layout.sliding_windows)
    s = Scheduler(sched_cfg, cache_cfg, num_gpu_blocks=num_blocks)
    rng = np.random.default_rng(0)
    for i in range(args.requests):
        prompt = rng.integers(3, 30000, CONTEXT - args.decode).tolist()
        s.add_request(
            Request(f"r{i}", prompt, SamplingParams(max_tokens=args.decode), eos_token_id=None)
        )
    most = preempted = steps = 0
    running_at_decode = []
    while s.has_unfinished_requests() and steps < 100_000:
        out = s.schedule()
        steps += 1
        preempted += len(out.preempted_req_ids)
        ids = list(out.num_scheduled_tokens)
        sampled = [[7]] * len(ids)  # a partial prompt chunk's token is dropped by the update
        if out.total_num_scheduled_tokens == len(ids):  # every scheduled request decodes
            running_at_decode.append(len(ids))
        most = max(most, len(s.running))
        s.update_from_output(
            out,
            ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled),
        )
    kv = s.kv_cache_manager
    peak = blocks_per_sequence(layout.sliding_windows, CONTEXT, BLOCK, args.budget)
    held = blocks_per_sequence(layout.sliding_windows, CONTEXT, BLOCK, 1)
    return dict(
        groups=len(layout.groups),
        tensors=layout.num_tensors,
        block_kib=block_bytes / 1024,
        num_blocks=num_blocks,
        peak=peak,
        held=held,
        analytic=(num_blocks - 1) // held,
        most=most,
        decode_running=max(running_at_decode, default=0),
        preempted=preempted,
        steps=steps,
        leak=kv.usage,
    )


# ---------------------------------------------------------------- 2. step time


def tiny_hf(max_len: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def make_runner(hybrid: bool, seqs: int, max_len: int, budget: int, num_blocks: int, backend: str):
    from jaxserve.config import EngineArgs
    from jaxserve.model.loader import load_model
    from jaxserve.worker.model_runner import ModelRunner

    hf = tiny_hf(max_len)
    model, arch, gen = load_model(hf, "float32", "dummy", seed=0)
    args = EngineArgs(
        model="tiny-hybrid",
        dtype="float32",
        load_format="dummy",
        attention_backend=backend,
        max_model_len=max_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        token_buckets=",".join(str(b) for b in sorted({16, budget})),
        num_gpu_blocks_override=num_blocks,
        disable_hybrid_kv_cache_manager=not hybrid,
        compilation_cache_dir="",
    )
    config = args.create_engine_config(max_len)
    greedy = SamplingParams(temperature=0.0)
    runner = ModelRunner(model, arch, config, warmup_sampling=(greedy,))
    spec = runner.initialize_kv_cache()
    runner.warmup(progress=False)
    config = dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, num_gpu_blocks=spec.num_blocks)
    )
    return model, arch, gen, config, runner


def table_skips(layout, start: int) -> list[int]:
    """Per group, the leading table entries the KV manager holds as null blocks for a sequence
    whose next query is at ``start`` (blocks wholly before its window)."""
    return [
        0 if g.sliding_window is None else max(0, start - g.sliding_window + 1) // BLOCK
        for g in layout.groups
    ]


def decode_steps(runner, seqs: int, steps: int, rng) -> list[tuple[float, float]]:
    """(wall seconds, process CPU seconds) per decode step of ``seqs`` sequences at a
    CONTEXT-token context, ``steps`` steps; tables as the KV manager lays them out (a window
    group: nulls before the window)."""
    from jaxserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput

    runner.reset_requests()
    num_table = CONTEXT // BLOCK
    start = CONTEXT - steps - 1
    next_block = 1
    news = []
    for i in range(seqs):
        tables = []
        for skip in table_skips(runner.kv_layout, start):
            n = num_table - skip
            tables.append([0] * skip + list(range(next_block, next_block + n)))
            next_block += n
        prompt = rng.integers(3, 4000, start + 1).tolist()
        news.append(
            NewRequestData(
                f"s{i}", prompt, [], SamplingParams(temperature=0.0), 2, tuple(tables), start
            )
        )
    assert next_block <= runner.kv_spec.num_blocks, (next_block, runner.kv_spec.num_blocks)
    ids = [n.req_id for n in news]
    sched = SchedulerOutput(news, CachedRequestData(), dict.fromkeys(ids, 1), seqs, set(), set())
    out = runner.execute_model(sched)
    times = []
    for k in range(1, steps):
        tokens = [[t[0]] for t in out.sampled_token_ids]
        cached = CachedRequestData(ids, [None] * seqs, [start + k] * seqs, tokens)
        sched = SchedulerOutput([], cached, dict.fromkeys(ids, 1), seqs, set(), set())
        t0, c0 = time.perf_counter(), time.process_time()
        out = runner.execute_model(sched)
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, set(), set(ids)))
    return times


# ---------------------------------------------------------------- 3. equality


def served_outputs(run, prompts, max_tokens: int):
    from jaxserve.engine.llm_engine import LLMEngine

    model, arch, gen, config, runner = run
    runner.reset_requests()
    engine = LLMEngine(config, runner, arch, None, gen)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (
                    list(c.token_ids),
                    [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                )
    assert engine.scheduler.kv_cache_manager.usage == 0.0
    return [done[f"p{i}"] for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--kv-gib", type=float, default=40.0, help="KV memory for part 1")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument(
        "--decode",
        type=int,
        default=512,
        help="output tokens per request (prompt + output = 32,768; enough decode steps that "
        "every request the pool holds is running at once)",
    )
    parser.add_argument("--seqs", type=int, default=4, help="sequences per step (part 2)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--attention-backend", default="auto", help="parts 2 and 3 (auto: the platform's)"
    )
    parser.add_argument("--skip", nargs="*", default=[], choices=["capacity", "step", "equal"])
    args = parser.parse_args()

    if "capacity" not in args.skip:
        print(
            f"1. capacity: {args.kv_gib} GiB of KV, {args.layers} layers (5 local of window "
            f"{WINDOW} : 1 global), {args.kv_heads} KV heads x {args.head_dim}, bfloat16, "
            f"{args.requests} requests of {CONTEXT - args.decode} + {args.decode} tokens, "
            f"budget {args.budget}"
        )
        for hybrid in (True, False):
            t0 = time.perf_counter()
            c = capacity(hybrid, args)
            assert c["leak"] == 0.0
            print(
                f"  hybrid {'on ' if hybrid else 'off'}: {c['groups']} groups, {c['tensors']} "
                f"layers per block ({c['block_kib']:.0f} KiB), {c['num_blocks']} blocks; per 32k "
                f"sequence {c['held']} blocks decoding ({c['peak']} admission peak); fit by "
                f"arithmetic {c['analytic']}; ran at once: {c['most']} (in all-decode steps "
                f"{c['decode_running']}); preemptions {c['preempted']}; {c['steps']} steps "
                f"({time.perf_counter() - t0:.1f} s); usage after {c['leak']}"
            )

    rng = np.random.default_rng(1)
    runs = {}
    if "step" not in args.skip or "equal" not in args.skip:
        start = CONTEXT - args.steps - 1
        for hybrid in (True, False):
            layout = make_kv_cache_layout(pattern(6), hybrid=hybrid)
            per_seq = sum(CONTEXT // BLOCK - skip for skip in table_skips(layout, start))
            num_blocks = args.seqs * per_seq + 2
            runs[hybrid] = make_runner(
                hybrid, args.seqs, CONTEXT, 256, num_blocks, args.attention_backend
            )
    if "step" not in args.skip:
        print(
            f"2. decode step at a {CONTEXT}-token context, {args.seqs} sequences, tiny 6-layer "
            f"model (float32, {runs[True][4].backend} attention), {args.rounds} interleaved "
            f"rounds of {args.steps - 1} steps"
        )
        times = {True: [], False: []}
        for _ in range(args.rounds):
            for hybrid in (True, False):
                times[hybrid] += decode_steps(runs[hybrid][4], args.seqs, args.steps, rng)
        med = {}
        for hybrid in (True, False):
            for k, what in ((0, "wall"), (1, "CPU (all threads)")):
                t = sorted(x[k] for x in times[hybrid])
                med[hybrid, k] = statistics.median(t)
                print(
                    f"  hybrid {'on ' if hybrid else 'off'} {what}: median "
                    f"{med[hybrid, k] * 1e3:.1f} ms (p10 {t[len(t) // 10] * 1e3:.1f}, "
                    f"p90 {t[9 * len(t) // 10] * 1e3:.1f})"
                )
        print(
            f"  on / off: wall {med[True, 0] / med[False, 0]:.3f}, "
            f"CPU {med[True, 1] / med[False, 1]:.3f}"
        )
    if "equal" not in args.skip:
        prompts = [rng.integers(3, 4000, int(n)).tolist() for n in (1500, 2100, 2600, 3000)]
        got = {h: served_outputs(runs[h], prompts, 24) for h in (True, False)}
        same = got[True] == got[False]
        print(
            f"3. greedy float32, {len(prompts)} prompts of 1,500-3,000 tokens x 24 tokens, "
            f"hybrid on vs off: tokens and logprobs identical: {same}"
        )
        assert same


if __name__ == "__main__":
    main()
