"""Where a CPU step's milliseconds go, at realistic prompt lengths (#34).

One context length at a time, ``--batch`` requests of that prompt length go through
``LLMEngine`` (synchronous loop, so a step's host and device work are its own); the prefill
step whose chunk ends at the context and the decode steps after it are measured:

* host phases, from the engine's own timers: schedule, runner host (rows, batch build, sampling
  metadata, launch), output (runner output, scheduler update, outputs);
* device (launch until the step's tokens are on the host), and inside it, each part re-timed
  alone on that step's own inputs (medians of ``--repeats`` calls, the KV pool as the step left
  it): the forward step, the attention of one layer times the number of layers, and the
  sampler; "matmul+rest" is the forward less the attention (projections, MLP, LM head, norms,
  RoPE, embedding, KV write).

The parts are timed in process CPU time: on a shared box wall time swings with other jobs,
CPU time much less. With XLA's intra-op threads off (the ``XLA_FLAGS`` below) it is the work
itself; with them on it also counts both cores' share and the pool's spinning. A profiler trace
is not used for the split: its per-thunk cost (tens of us) would swamp a key-chunk loop of
small thunks. ``--ops`` does trace the re-timed forward once more and prints its XLA time by
category from the trace (attention, KV write, matmuls, the rest): trustworthy for the few large
thunks of the projections and MLP, inflated for the attention loop's many small ones.

  XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \\
  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/profile_cpu_step.py --model MODEL_DIR \\
      --max-model-len 16384 --max-num-batched-tokens 512 --block-size 32 --dtype float32 \\
      --contexts 512,2000,6000,12000 [--batch 16]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxserve.config import EngineArgs  # noqa: E402

COLUMNS = (
    "wall",
    "schedule",
    "runner_host",
    "device",
    "output",
    "forward",
    "attention",
    "matmul+rest",
    "sampler",
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument("--contexts", default="512,2000,6000,12000", help="prompt lengths")
    parser.add_argument("--batch", type=int, default=1, help="requests per context")
    parser.add_argument("--decode-steps", type=int, default=8, help="decode steps measured")
    parser.add_argument("--repeats", type=int, default=5, help="calls per re-timed part")
    parser.add_argument(
        "--ops", action="store_true", help="also split the forward's XLA time by op category"
    )
    args = parser.parse_args(argv)
    args.async_scheduling = False
    return args


def _median_ms(fn, repeats: int) -> float:
    """Median process CPU ms per call (steadier than wall time on a shared box; equal to the
    work with XLA's intra-op threads off, see the module docstring)."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.process_time()
        jax.block_until_ready(fn())
        times.append(time.process_time() - t)
    return 1e3 * statistics.median(times)


def op_categories(forward, exe, repeats: int) -> dict[str, float]:
    """Thread ms per call of the forward's XLA thunks by category, from a profiler trace:
    attention (the ``ragged_attention`` scope), kv_write, matmul (other dot_generals), other."""
    import jax
    from jax.profiler import ProfileData

    names = dict(re.findall(r"%([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"", exe.as_text()))
    trace_dir = tempfile.mkdtemp(prefix="jaxserve_prof_")
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    with jax.profiler.trace(trace_dir, profiler_options=opts):
        for _ in range(repeats):
            jax.block_until_ready(forward())
    total: collections.Counter = collections.Counter()
    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            for ev in line.events:
                op = dict(ev.stats).get("hlo_op")
                if op is None or str(op).split(".")[0] in ("while", "conditional", "call"):
                    continue  # containers: their bodies' thunks count themselves
                name = names.get(str(op), "")
                cat = "other"
                if "ragged_attention" in name:
                    cat = "attention"
                elif "write_kv_cache" in name:
                    cat = "kv_write"
                elif "dot_general" in name:
                    cat = "matmul"
                total[cat] += ev.duration_ns
    return {k: total[k] / 1e6 / repeats for k in ("attention", "kv_write", "matmul", "other")}


def retime_parts(engine, repeats: int, ops: bool = False) -> dict[str, float]:
    """The last step's forward, attention (x layers) and sampler, each re-timed alone (ms)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.model.chunked_attention import chunked_paged_attention
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.worker.compilation import forward_step, sample_step
    from jaxserve.worker.sampling_metadata import SamplingMetadata, SamplingRow

    runner = engine.runner
    batch = runner._last_batch  # noqa: SLF001 (a benchmark reads the runner's last step)
    inputs = batch.inputs
    aot = runner.aot_forward.get(batch.token_bucket)  # None under --no-warmup

    def fwd(params, kv_caches, inputs):
        if aot is not None:
            return aot(params, kv_caches, inputs)
        return forward_step(runner.graph, params, kv_caches, inputs)

    def forward():
        logits, hidden, runner.kv_caches = fwd(runner.params, runner.kv_caches, inputs)
        return logits

    forward_ms = _median_ms(forward, repeats)
    arch = runner.arch
    k_cache, v_cache = runner.kv_caches[0]
    q = jnp.asarray(
        np.random.default_rng(0).standard_normal(
            (batch.token_bucket, arch.num_heads, runner.kv_head_dim), np.float32
        ),
        runner.dtype,
    )
    attend = jax.jit(
        lambda q, k, v, bt, cl, qsl, n: chunked_paged_attention(
            q, k, v, bt, cl, qsl, n, sm_scale=arch.head_dim**-0.5
        )
    )
    tables = inputs.block_tables[0]  # [G, S, P]: group 0, full attention
    args = (q, k_cache, v_cache, tables, inputs.context_lens)
    args += (inputs.query_start_loc, inputs.num_seqs)
    attention_ms = arch.num_layers * _median_ms(lambda: attend(*args), repeats)
    logits = forward()
    md = SamplingMetadata.from_params(
        [SamplingRow(SamplingParams(temperature=0.0), 0, 0, (), ())], pad_to=batch.seq_bucket
    )
    sampler_ms = _median_ms(lambda: sample_step(runner.graph, logits, md), repeats)
    parts = {
        "forward": forward_ms,
        "attention": attention_ms,
        "matmul+rest": forward_ms - attention_ms,
        "sampler": sampler_ms,
    }
    if ops and aot is None:
        print("    --ops needs the compiled step (leave warm-up on)")
    elif ops:
        cats = op_categories(forward, aot, repeats)
        print(
            "    forward by op category (profiler thread ms): "
            + ", ".join(f"{k} {v:.2f}" for k, v in cats.items())
        )
    return parts


def measure_steps(engine, n: int, repeats: int, ops: bool = False) -> dict[str, float]:
    """Runs ``n`` engine steps; ms per step by host phase and device, then the parts of the
    last one re-timed alone."""
    s0 = engine.get_stats()
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    wall = 1e3 * (time.perf_counter() - t0) / n
    s1 = engine.get_stats()
    row = {"wall": wall}
    for col, name in (
        ("schedule", "schedule_s"),
        ("runner_host", "runner_host_s"),
        ("device", "runner_device_s"),
        ("output", "output_s"),
    ):
        row[col] = 1e3 * (getattr(s1, name) - getattr(s0, name)) / n
    return {**row, **retime_parts(engine, repeats, ops)}


def main(argv=None) -> None:
    args = parse_args(argv)
    import numpy as np

    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    runner = engine.runner
    budget = engine.config.scheduler.max_num_batched_tokens
    rng = np.random.default_rng(0)
    print(
        f"ms per step ({runner.backend} attention, {runner.arch.num_layers} layers, budget "
        f"{budget} tokens, batch {args.batch}, load {os.getloadavg()[0]:.1f})"
    )
    print(f"{'step':26s} " + " ".join(f"{c:>11s}" for c in COLUMNS))
    for k, ctx in enumerate(int(c) for c in args.contexts.split(",")):
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 4, ignore_eos=True)
        for b in range(args.batch):
            prompt = rng.integers(3, engine.vocab_size, size=ctx).tolist()
            engine.add_request(f"{k}-{b}", prompt, params, final_only=True)
        for _ in range(-(-ctx * args.batch // budget) - 1):
            engine.step()
        rows = {f"prefill chunk ending @{ctx}": measure_steps(engine, 1, args.repeats, args.ops)}
        engine.step()
        rows[f"decode {args.batch} x @{ctx}"] = measure_steps(
            engine, args.decode_steps, args.repeats, args.ops
        )
        while engine.has_unfinished_requests():
            engine.step()
        for label, r in rows.items():
            print(f"{label:26s} " + " ".join(f"{r[c]:11.2f}" for c in COLUMNS), flush=True)


if __name__ == "__main__":
    main()
