"""Ragged paged attention benchmark: our Pallas kernel against the baselines.

Shapes are Llama-3-8B's head layout (32 query heads, 8 KV heads, head dim
128), block size 16, bfloat16, random block tables (shuffled physical blocks):

* decode: batch 1, 8, 64, 256 x context 512, 2,048, 8,192, one query token per
  sequence. Figures: microseconds per call, GB/s of K+V read and the percent
  of the H200's device copy bandwidth (4,300 GB/s). Our kernel is timed with
  its automatic tiling and, on the target shapes, a few alternatives (the
  sweep tunes in one run).
  Baselines: JAX's ``pallas.ops.gpu.paged_attention`` (decode only; its
  [Hkv, N, bs, D] cache layout is built once outside the timing) and the XLA
  gather-then-attend reference (``ragged_paged_attention_reference``).
* prefill: one sequence, a chunk of 512-4,096 tokens on top of 0-3,584 cached
  tokens. Figures: microseconds and TFLOP/s (4 * Hq * D * sum over query
  tokens of visible keys). Baselines: cuDNN through
  ``jax.nn.dot_product_attention(..., implementation="cudnn")`` on contiguous
  K/V, and the XLA reference where its gather fits in memory.

Timing, two modes (``--timing``):

* in-jit (default for decode): ``R`` chained calls inside ONE jitted
  ``lax.fori_loop`` (each iteration's output is the next one's query, and the
  other arguments pass through ``lax.optimization_barrier`` with it, so XLA
  can neither elide, overlap nor hoist work out of the loop); the loop is run
  >= 7 times after a warm-up and the median divided by ``R``. ``R`` is sized
  from the H200 roofline so a loop runs >= ``--target-ms`` (2 ms): host
  dispatch is paid once per loop, as inside the model's jitted step. The
  per-iteration cost of a loop whose body is one trivial elementwise kernel
  is printed as "in-jit floor"; the flash-decoding merge alone (the
  log-sum-exp reduction of the split partials, a fixed cost per call) is
  printed as "merge" for each decode shape whose automatic tiling splits.
* per-call (default for prefill, the first run's only mode): two warm-up
  calls, then the median of >= 10 runs, each run being ``repeat`` chained
  calls from Python (the output is the next call's query) divided by
  ``repeat``. Python dispatch cost per call is printed as "dispatch floor":
  figures near it are dispatch-bound, not kernel-bound.

The decode targets 1 x 8,192 and 64 x 2,048 are timed both ways so the two
can be compared. Every measurement is wrapped in try/except: a failure prints
its error and the run goes on. Without a GPU only a tiny CPU smoke run
(interpret mode) happens, as with ``--smoke``.

Run:  PYTHONPATH=. python benchmarks/bench_attention.py [--quick] [--smoke] [--json FILE]
          [--timing auto|in-jit|per-call] [--target-ms 2] [--loop-repeat R]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention_tuning import KernelConfig, choose_config
from pallas_kernels.bucketing import next_power_of_2
from pallas_kernels.ragged_paged_attention import (
    merge_split_partials,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

COPY_BANDWIDTH_GBS = 4300.0  # H200 device copy bandwidth used for "% of copy"
# H200 peaks, only to size the in-jit loop (a lower bound on a call's time).
HBM_PEAK_BYTES_S = 4.8e12
BF16_PEAK_FLOPS = 989e12
MIN_CALL_S = 2e-6  # no kernel call in a loop iteration takes less
MAX_LOOP_REPEAT = 1024
SMOKE_LOOP_REPEAT = 4  # interpret mode on CPU: a few iterations prove the path
TARGET_SHAPES_BOTH_TIMINGS = ((1, 8192), (64, 2048))  # decode (batch, ctx)
XLA_REFERENCE_MAX_BYTES = 24 << 30  # skip the gather baseline beyond this
warnings.filterwarnings("ignore", category=DeprecationWarning)


@dataclasses.dataclass(frozen=True)
class Layout:
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: object = jnp.bfloat16


@dataclasses.dataclass
class Problem:
    """One ragged batch on device: B sequences, each ``q_len`` new tokens on a
    context of ``ctx`` tokens (cached + new)."""

    layout: Layout
    batch: int
    q_len: int
    ctx: int
    q: jax.Array  # [B * q_len, Hq, D]
    k_cache: jax.Array  # [N, bs, Hkv, D]
    v_cache: jax.Array
    block_tables: jax.Array  # [B, P]
    context_lens: jax.Array  # [B]
    query_start_loc: jax.Array  # [B + 1]

    @property
    def num_seqs(self):
        return jnp.int32(self.batch)

    def args(self):
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.context_lens,
            self.query_start_loc,
            self.num_seqs,
        )

    def kv_bytes(self) -> int:
        """Bytes of K and V the batch must read (its whole context)."""
        lay = self.layout
        return (
            2
            * self.batch
            * self.ctx
            * lay.num_kv_heads
            * lay.head_dim
            * jnp.dtype(lay.dtype).itemsize
        )

    def flops(self) -> float:
        """Useful attention FLOPs: QK^T and PV over each token's visible keys."""
        lay = self.layout
        cached = self.ctx - self.q_len
        visible = self.q_len * cached + self.q_len * (self.q_len + 1) / 2
        return 4.0 * self.batch * lay.num_q_heads * lay.head_dim * visible


def make_problem(layout: Layout, batch: int, q_len: int, ctx: int, seed: int = 0) -> Problem:
    bs = layout.block_size
    pages = -(-ctx // bs)
    num_blocks = batch * pages + 1  # block 0 is the null block
    keys = jax.random.split(jax.random.key(seed), 4)
    cache_shape = (num_blocks, bs, layout.num_kv_heads, layout.head_dim)
    k_cache = jax.random.normal(keys[0], cache_shape, layout.dtype)
    v_cache = jax.random.normal(keys[1], cache_shape, layout.dtype)
    perm = 1 + jax.random.permutation(keys[2], num_blocks - 1).astype(jnp.int32)
    block_tables = perm.reshape(batch, pages)
    q = jax.random.normal(
        keys[3], (batch * q_len, layout.num_q_heads, layout.head_dim), layout.dtype
    )
    return Problem(
        layout,
        batch,
        q_len,
        ctx,
        q,
        k_cache,
        v_cache,
        block_tables,
        jnp.full((batch,), ctx, jnp.int32),
        jnp.arange(batch + 1, dtype=jnp.int32) * q_len,
    )


# ---------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------
def time_chained(fn, q, *rest, min_runs: int = 10, target_s: float = 0.02) -> float:
    """Per-call timing: median microseconds per call of ``q = fn(q, *rest)``
    chained calls dispatched one by one from Python (includes host dispatch)."""
    jitted = jax.jit(fn)
    out = jitted(q, *rest)
    out = jitted(out.astype(q.dtype), *rest)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    jax.block_until_ready(jitted(q, *rest))
    single = max(time.perf_counter() - t0, 1e-6)
    repeat = int(min(200, max(1, target_s / single)))
    runs = []
    for _ in range(min_runs):
        x = q
        t0 = time.perf_counter()
        for _ in range(repeat):
            x = jitted(x, *rest)
        jax.block_until_ready(x)
        runs.append((time.perf_counter() - t0) / repeat)
    return statistics.median(runs) * 1e6


def time_in_jit(fn, q, *rest, repeat: int, min_runs: int = 7) -> float:
    """In-jit timing: median microseconds per iteration of one jitted
    ``lax.fori_loop`` running ``repeat`` chained calls ``x = fn(x, *rest)``.

    The iteration's output is the next one's ``x`` (a true dependency: calls
    cannot be elided or overlapped), and ``rest`` passes through
    ``lax.optimization_barrier`` together with ``x`` each iteration, so
    query-independent work (the reference's K/V gather, say) cannot be hoisted
    out of the loop. Host dispatch is paid once per loop, not per call.

    Args:
      fn: ``fn(x, *rest) -> array`` of ``x``'s shape (cast back to its dtype).
      q: [T, Hq, D] the first iteration's input.
      rest: further arguments, loop-invariant.
      repeat: iterations per loop (static: the trip count is known to XLA).
      min_runs: timed loops after the compile and one warm-up loop.

    Returns:
      Microseconds per iteration (median over loops).
    """

    def looped(x, *rest):
        def body(_, x):
            x, rest_ = lax.optimization_barrier((x, rest))
            return fn(x, *rest_).astype(x.dtype)

        return lax.fori_loop(0, repeat, body, x)

    jitted = jax.jit(looped)
    jax.block_until_ready(jitted(q, *rest))  # compile
    jax.block_until_ready(jitted(q, *rest))  # warm-up
    runs = []
    for _ in range(min_runs):
        t0 = time.perf_counter()
        jax.block_until_ready(jitted(q, *rest))
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) / repeat * 1e6


def loop_repeat(p: Problem, *, on_gpu: bool, target_s: float, override: int | None) -> int:
    """Iterations of the in-jit loop for problem ``p``: a power of two such
    that the loop takes >= ``target_s`` even at the H200's roofline (HBM peak
    for the K/V bytes, bf16 dense peak for the FLOPs, >= 2 us a call), which is
    a lower bound on a call's time, so the real loop runs at least that long.
    Clamped to [4, 1024]; ``SMOKE_LOOP_REPEAT`` without a GPU (interpret mode
    is ~1000x slower); ``override`` wins when given."""
    if override:
        return override
    if not on_gpu:
        return SMOKE_LOOP_REPEAT
    floor_s = max(p.kv_bytes() / HBM_PEAK_BYTES_S, p.flops() / BF16_PEAK_FLOPS, MIN_CALL_S)
    want = max(1, int(-(-target_s // floor_s)))
    return min(MAX_LOOP_REPEAT, max(4, next_power_of_2(want)))


def dispatch_floor_us(problem: Problem) -> float:
    """Per-call cost of a trivial jitted function with the same arguments."""
    return time_chained(lambda q, *rest: q, *problem.args())


def in_jit_floor_us(problem: Problem, repeat: int) -> float:
    """In-jit cost of one loop iteration whose body is one trivial elementwise
    kernel on q (``x + 1``), same arguments and barrier as the timed loops."""
    return time_in_jit(lambda q, *rest: q + jnp.asarray(1, q.dtype), *problem.args(), repeat=repeat)


def merge_cost_us(p: Problem, num_splits: int, repeat: int) -> float:
    """In-jit microseconds of the flash-decoding merge alone for ``p``'s head
    layout and ``num_splits`` splits: the fixed cost a split call pays after
    the kernel (float32 partials written and read back, separate XLA fusions).
    Iterations are chained through ``l`` (a tiny [splits, T, Hkv, Gp] update)."""
    lay = p.layout
    group_pad = next_power_of_2(lay.num_q_heads // lay.num_kv_heads)
    part = (num_splits, p.q.shape[0], lay.num_kv_heads, group_pad)
    keys = jax.random.split(jax.random.key(2), 3)
    acc = jax.random.normal(keys[0], (*part, lay.head_dim), jnp.float32)
    m = jax.random.normal(keys[1], part, jnp.float32)
    l = 1.0 + jax.random.uniform(keys[2], part, jnp.float32)

    def step(l, acc, m):
        o = merge_split_partials(acc, m, l, dtype=lay.dtype)
        return l + 1e-6 * jnp.abs(o[None, ..., 0]).astype(jnp.float32)

    return time_in_jit(step, l, acc, m, repeat=repeat)


# ---------------------------------------------------------------------------
# Candidates.
# ---------------------------------------------------------------------------
def auto_config(p: Problem) -> KernelConfig:
    lay = p.layout
    return choose_config(
        num_tokens=p.q.shape[0],
        num_seqs=p.batch,
        num_q_heads=lay.num_q_heads,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
        block_size=lay.block_size,
        pages_per_seq=p.block_tables.shape[1],
        dtype=lay.dtype,
    )


def decode_sweep(p: Problem) -> list[KernelConfig]:
    """The automatic tiling and alternatives around it: a deeper pipeline,
    bigger KV tiles (shallower, or with 8 warps), twice / half the splits."""
    auto = auto_config(p)
    r = dataclasses.replace
    sweep = [
        auto,
        r(auto, num_stages=4),
        r(auto, block_k=auto.block_k * 2, num_stages=2),
        r(auto, block_k=auto.block_k * 2, num_warps=8),
        r(auto, num_splits=auto.num_splits * 2 if auto.num_splits < 64 else auto.num_splits // 2),
    ]
    return list(dict.fromkeys(sweep))


def prefill_sweep(p: Problem) -> list[KernelConfig]:
    """The automatic tiling, a shallower pipeline, and 64-row tiles on 4 warps."""
    auto = auto_config(p)
    group = p.layout.num_q_heads // p.layout.num_kv_heads
    r = dataclasses.replace
    sweep = [
        auto,
        r(auto, num_stages=2),
        r(auto, block_q=max(1, 64 // group), num_warps=4, num_stages=2),
    ]
    return list(dict.fromkeys(sweep))


def describe(cfg: KernelConfig) -> str:
    return (
        f"bq{cfg.block_q}/bk{cfg.block_k}/split{cfg.num_splits}/w{cfg.num_warps}/st{cfg.num_stages}"
    )


def ours(p: Problem, cfg: KernelConfig | None, interpret: bool):
    scale = p.layout.head_dim**-0.5

    def fn(q, *rest):
        return ragged_paged_attention(q, *rest, sm_scale=scale, config=cfg, interpret=interpret)

    return fn


def xla_reference(p: Problem):
    scale = p.layout.head_dim**-0.5
    return lambda q, *rest: ragged_paged_attention_reference(q, *rest, sm_scale=scale)


def reference_bytes(p: Problem) -> int:
    """Memory the gather-then-attend reference materialises."""
    lay = p.layout
    keys = p.block_tables.shape[1] * lay.block_size
    tokens = p.q.shape[0]
    gather = 2 * tokens * keys * lay.num_kv_heads * lay.head_dim * jnp.dtype(lay.dtype).itemsize
    return gather + 3 * tokens * keys * lay.num_q_heads * 4


def jax_paged_attention(p: Problem, interpret: bool):
    """JAX's deprecated Pallas GPU decode kernel, on its own KV layout."""
    from jax.experimental.pallas.ops.gpu import paged_attention as pa

    k_pages = jnp.transpose(p.k_cache, (2, 0, 1, 3))  # [Hkv, N, bs, D], built once
    v_pages = jnp.transpose(p.v_cache, (2, 0, 1, 3))
    scale = p.layout.head_dim**-0.5
    pages = p.block_tables.shape[1]
    k_splits = 16 if pages % 16 == 0 else 1

    def fn(q, block_tables, lengths, k_pages, v_pages):
        # paged_attention has no softmax scale: fold it into q.
        return pa.paged_attention(
            q * jnp.asarray(scale, q.dtype),
            k_pages,
            v_pages,
            block_tables,
            lengths,
            k_splits=k_splits,
            interpret=interpret,
        )

    return fn, (p.block_tables, p.context_lens, k_pages, v_pages)


def cudnn_attention(p: Problem):
    """cuDNN flash attention on contiguous K/V of the single prefill sequence."""
    lay = p.layout
    key = jax.random.key(1)
    kk, kv = jax.random.split(key)
    shape = (1, p.ctx, lay.num_kv_heads, lay.head_dim)
    k = jax.random.normal(kk, shape, lay.dtype)
    v = jax.random.normal(kv, shape, lay.dtype)
    cached = p.ctx - p.q_len

    def fn(q, k, v):
        q4 = q[None]  # [1, T, Hq, D]
        if cached == 0:
            out = jax.nn.dot_product_attention(q4, k, v, is_causal=True, implementation="cudnn")
        else:
            # Bottom-right causal: query i sees keys <= cached + i.
            out = jax.nn.dot_product_attention(
                q4, k, v, local_window_size=(p.ctx, cached), implementation="cudnn"
            )
        return out[0]

    return fn, (k, v)


# ---------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------
class Reporter:
    def __init__(self, json_path: str | None):
        self.json = open(json_path, "a") if json_path else None

    def row(
        self,
        kind: str,
        p: Problem,
        impl: str,
        us: float | None,
        error: str | None = None,
        *,
        timing: str = "per-call",
        repeat: int | None = None,
    ):
        """Prints one measurement and appends its JSON line. ``timing`` is
        "in-jit" or "per-call"; when it is not the default of ``kind`` it is
        appended to ``impl`` (so a summary taking the best per impl shows it)."""
        if timing != default_timing(kind):
            impl = f"{impl} [{timing}]"
        rec = dict(kind=kind, batch=p.batch, q_len=p.q_len, ctx=p.ctx, impl=impl, timing=timing)
        if repeat:
            rec["loop_repeat"] = repeat
        how = f"{timing} x{repeat}" if timing == "in-jit" else timing
        if us is None:
            print(
                f"{kind:8s} B={p.batch:<4d} q={p.q_len:<5d} ctx={p.ctx:<6d} {impl:48s} "
                f"{how:13s} FAILED: {error}",
                flush=True,
            )
            rec["error"] = error
        else:
            gbs = p.kv_bytes() / (us * 1e-6) / 1e9
            tflops = p.flops() / (us * 1e-6) / 1e12
            rec.update(us=us, kv_gbs=gbs, copy_pct=100 * gbs / COPY_BANDWIDTH_GBS, tflops=tflops)
            extra = (
                f"{gbs:8.0f} GB/s {100 * gbs / COPY_BANDWIDTH_GBS:5.1f}% of copy"
                if kind == "decode"
                else f"{tflops:7.1f} TFLOP/s"
            )
            print(
                f"{kind:8s} B={p.batch:<4d} q={p.q_len:<5d} ctx={p.ctx:<6d} {impl:48s} "
                f"{how:13s} {us:10.1f} us  {extra}",
                flush=True,
            )
        self.write(rec)

    def note(
        self, kind: str, p: Problem, what: str, us: float | None = None, error: str | None = None
    ):
        """Prints and records a side figure (a floor, the merge cost), in
        microseconds, or its error. Its JSON line keeps the figure under
        "note_us" (no "us" key), so summaries of kernel rows skip it."""
        text = f"{us:.1f} us" if us is not None else f"FAILED: {error}"
        print(
            f"{kind:8s} B={p.batch:<4d} q={p.q_len:<5d} ctx={p.ctx:<6d} {what}: {text}", flush=True
        )
        rec = dict(kind=kind, batch=p.batch, q_len=p.q_len, ctx=p.ctx, note=what)
        if us is not None:
            rec["note_us"] = us
        else:
            rec["error"] = error
        self.write(rec)

    def write(self, rec: dict):
        if self.json:
            self.json.write(json.dumps(rec) + "\n")
            self.json.flush()


def default_timing(kind: str) -> str:
    """In-jit for decode (per-call timing of small decode shapes measures host
    dispatch), per-call for prefill (long enough that dispatch hides)."""
    return "in-jit" if kind == "decode" else "per-call"


def _error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def measure(rep: Reporter, kind: str, p: Problem, impl: str, make, *, timing: str, repeat: int):
    """Times ``make() -> (fn, rest)`` in one timing mode and reports it; a
    failure is reported as a row and the run goes on."""
    try:
        fn, rest = make()
        if timing == "in-jit":
            us = time_in_jit(fn, p.q, *rest, repeat=repeat)
        else:
            us = time_chained(fn, p.q, *rest)
        rep.row(kind, p, impl, us, timing=timing, repeat=repeat if timing == "in-jit" else None)
    except Exception as e:  # noqa: BLE001 - one failure must not end the run
        rep.row(
            kind,
            p,
            impl,
            None,
            _error_text(e),
            timing=timing,
            repeat=repeat if timing == "in-jit" else None,
        )
        if "--traceback" in sys.argv:
            traceback.print_exc()


def timings_for(kind: str, p: Problem, mode: str) -> tuple[str, ...]:
    """Timing modes for a problem: ``mode`` "in-jit" or "per-call" forces one;
    "auto" uses ``default_timing`` and adds per-call on the decode targets
    (``TARGET_SHAPES_BOTH_TIMINGS``, and the smoke run) to compare the two."""
    if mode != "auto":
        return (mode,)
    if kind == "decode" and (
        (p.batch, p.ctx) in TARGET_SHAPES_BOTH_TIMINGS or jax.default_backend() != "gpu"
    ):
        return ("in-jit", "per-call")
    return (default_timing(kind),)


def run_problem(
    rep: Reporter,
    kind: str,
    p: Problem,
    *,
    interpret: bool,
    sweep: bool,
    baselines: bool,
    timing: str = "auto",
    repeat: int = 4,
):
    timings = timings_for(kind, p, timing)
    auto = auto_config(p)
    if kind == "decode" and auto.num_splits > 1:
        try:
            rep.note(
                kind,
                p,
                f"flash-decoding merge alone ({auto.num_splits} splits, in-jit x{repeat})",
                us=merge_cost_us(p, auto.num_splits, repeat),
            )
        except Exception as e:  # noqa: BLE001
            rep.note(kind, p, "flash-decoding merge alone", error=_error_text(e))
    if sweep:
        configs = decode_sweep(p) if kind == "decode" else prefill_sweep(p)
    else:
        configs = [auto]
    for cfg in configs:
        name = "ours " + describe(cfg) + (" (auto)" if cfg == auto else "")
        for t in timings:
            measure(
                rep,
                kind,
                p,
                name,
                lambda cfg=cfg: (ours(p, cfg, interpret), p.args()[1:]),
                timing=t,
                repeat=repeat,
            )
    if not baselines:
        return
    for t in timings:
        if kind == "decode":
            measure(
                rep,
                kind,
                p,
                "jax pallas paged_attention",
                lambda: jax_paged_attention(p, interpret),
                timing=t,
                repeat=repeat,
            )
        elif jax.default_backend() == "gpu":
            measure(
                rep,
                kind,
                p,
                "cudnn dot_product_attention (contiguous)",
                lambda: cudnn_attention(p),
                timing=t,
                repeat=repeat,
            )
        if reference_bytes(p) <= XLA_REFERENCE_MAX_BYTES:
            measure(
                rep,
                kind,
                p,
                "xla gather+attend (reference)",
                lambda: (xla_reference(p), p.args()[1:]),
                timing=t,
                repeat=repeat,
            )
        else:
            rep.row(
                kind,
                p,
                "xla gather+attend (reference)",
                None,
                f"skipped: would materialise {reference_bytes(p) / 2**30:.0f} GiB",
                timing=t,
            )


def report_floors(rep: Reporter, p: Problem, repeat: int):
    """Prints the per-call dispatch floor and the in-jit per-iteration floor."""
    for what, timer in (
        ("dispatch floor (per-call, trivial jit)", dispatch_floor_us),
        (
            f"in-jit floor (x{repeat}, one elementwise kernel per iteration)",
            lambda p: in_jit_floor_us(p, repeat),
        ),
    ):
        try:
            rep.note("floor", p, what, us=timer(p))
        except Exception as e:  # noqa: BLE001
            rep.note("floor", p, what, error=_error_text(e))


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a subset: the target shapes")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run in interpret mode")
    parser.add_argument("--no-sweep", action="store_true", help="only the automatic tiling")
    parser.add_argument("--json", help="append one JSON line per measurement to this file")
    parser.add_argument("--traceback", action="store_true", help="print tracebacks of failures")
    parser.add_argument(
        "--timing",
        choices=("auto", "in-jit", "per-call"),
        default="auto",
        help="auto: in-jit for decode (plus per-call on the decode targets), per-call for "
        "prefill; in-jit / per-call: that mode everywhere (per-call = the first run's)",
    )
    parser.add_argument(
        "--target-ms",
        type=float,
        default=2.0,
        help="minimum duration of one in-jit loop (sizes its repeat count)",
    )
    parser.add_argument(
        "--loop-repeat",
        type=int,
        default=None,
        help="fixed iterations per in-jit loop instead of the sizing rule",
    )
    args = parser.parse_args(argv)
    if args.target_ms <= 0:
        parser.error("--target-ms must be > 0")
    if args.loop_repeat is not None and args.loop_repeat < 1:
        parser.error("--loop-repeat must be >= 1")

    on_gpu = jax.default_backend() == "gpu"
    device = jax.devices()[0]
    print(f"device: {device.platform} {device.device_kind}; jax {jax.__version__}", flush=True)
    rep = Reporter(args.json)
    sizing = dict(on_gpu=on_gpu, target_s=args.target_ms * 1e-3, override=args.loop_repeat)
    if args.smoke or not on_gpu:
        if not on_gpu:
            print("no GPU: tiny smoke run in interpret mode (figures are not kernel speed)")
        lay = Layout(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.float32)
        interpret = not on_gpu
        # Decode context 256: the automatic tiling splits it, so the merge is timed too.
        for kind, batch, q_len, ctx in [("decode", 2, 1, 256), ("prefill", 1, 32, 64)]:
            p = make_problem(lay, batch, q_len, ctx)
            if kind == "decode":
                report_floors(rep, p, loop_repeat(p, **sizing))
            run_problem(
                rep,
                kind,
                p,
                interpret=interpret,
                sweep=False,
                baselines=True,
                timing=args.timing,
                repeat=loop_repeat(p, **sizing),
            )
        return

    lay = Layout()
    small = make_problem(lay, 1, 1, 512)
    report_floors(rep, small, loop_repeat(small, **sizing))
    del small
    # Targets first, so that a run cut short still reports them.
    decode = [(64, 2048), (1, 8192), (256, 2048), (8, 2048)]
    prefill = [(4096, 4096), (512, 4096)]  # (chunk, context incl. chunk)
    if not args.quick:
        decode += [
            (b, c) for b in (1, 8, 64, 256) for c in (512, 2048, 8192) if (b, c) not in decode
        ]
        prefill += [(1024, 1024), (2048, 4096), (4096, 8192), (1024, 8192)]
    # The tiling sweep runs on the target shapes; the others use the automatic tiling.
    for kind, shapes, sweep in (
        ("decode", decode[:4], True),
        ("prefill", prefill[:2], True),
        ("decode", decode[4:], False),
        ("prefill", prefill[2:], False),
    ):
        for a, b in shapes:
            try:
                p = make_problem(lay, a, 1, b) if kind == "decode" else make_problem(lay, 1, a, b)
            except Exception as e:  # noqa: BLE001
                print(f"{kind} {a}x{b}: could not build inputs: {e}", flush=True)
                continue
            run_problem(
                rep,
                kind,
                p,
                interpret=False,
                sweep=sweep and not args.no_sweep,
                baselines=True,
                timing=args.timing,
                repeat=loop_repeat(p, **sizing),
            )
            del p
            gc.collect()


if __name__ == "__main__":
    main()
