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

from pallas_kernels.attention_tuning import KernelConfig
from pallas_kernels.attention_tuning import choose_config
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

COPY_BANDWIDTH_GBS = 4300.0  # H200 device copy bandwidth used for "% of copy"
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
    return (self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
            self.query_start_loc, self.num_seqs)

  def kv_bytes(self) -> int:
    """Bytes of K and V the batch must read (its whole context)."""
    lay = self.layout
    return 2 * self.batch * self.ctx * lay.num_kv_heads * lay.head_dim * jnp.dtype(lay.dtype).itemsize

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
  q = jax.random.normal(keys[3], (batch * q_len, layout.num_q_heads, layout.head_dim), layout.dtype)
  return Problem(
      layout, batch, q_len, ctx, q, k_cache, v_cache, block_tables,
      jnp.full((batch,), ctx, jnp.int32),
      jnp.arange(batch + 1, dtype=jnp.int32) * q_len,
  )


# ---------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------
def time_chained(fn, q, *rest, min_runs: int = 10, target_s: float = 0.02) -> float:
  """Median microseconds per call of ``q = fn(q, *rest)`` chained calls."""
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


def dispatch_floor_us(problem: Problem) -> float:
  """Per-call cost of a trivial jitted function with the same arguments."""
  return time_chained(lambda q, *rest: q, *problem.args())


# ---------------------------------------------------------------------------
# Candidates.
# ---------------------------------------------------------------------------
def auto_config(p: Problem) -> KernelConfig:
  lay = p.layout
  return choose_config(
      num_tokens=p.q.shape[0], num_seqs=p.batch, num_q_heads=lay.num_q_heads,
      num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim, block_size=lay.block_size,
      pages_per_seq=p.block_tables.shape[1], dtype=lay.dtype)


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
  return (f"bq{cfg.block_q}/bk{cfg.block_k}/split{cfg.num_splits}"
          f"/w{cfg.num_warps}/st{cfg.num_stages}")


def ours(p: Problem, cfg: KernelConfig | None, interpret: bool):
  scale = p.layout.head_dim ** -0.5

  def fn(q, *rest):
    return ragged_paged_attention(q, *rest, sm_scale=scale, config=cfg, interpret=interpret)

  return fn


def xla_reference(p: Problem):
  scale = p.layout.head_dim ** -0.5
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
  scale = p.layout.head_dim ** -0.5
  pages = p.block_tables.shape[1]
  k_splits = 16 if pages % 16 == 0 else 1

  def fn(q, block_tables, lengths, k_pages, v_pages):
    # paged_attention has no softmax scale: fold it into q.
    return pa.paged_attention(
        q * jnp.asarray(scale, q.dtype), k_pages, v_pages, block_tables, lengths,
        k_splits=k_splits, interpret=interpret)

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
          q4, k, v, local_window_size=(p.ctx, cached), implementation="cudnn")
    return out[0]

  return fn, (k, v)


# ---------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------
class Reporter:
  def __init__(self, json_path: str | None):
    self.json = open(json_path, "a") if json_path else None

  def row(self, kind: str, p: Problem, impl: str, us: float | None, error: str | None = None):
    rec = dict(kind=kind, batch=p.batch, q_len=p.q_len, ctx=p.ctx, impl=impl)
    if us is None:
      print(f"{kind:8s} B={p.batch:<4d} q={p.q_len:<5d} ctx={p.ctx:<6d} {impl:44s} "
            f"FAILED: {error}", flush=True)
      rec["error"] = error
    else:
      gbs = p.kv_bytes() / (us * 1e-6) / 1e9
      tflops = p.flops() / (us * 1e-6) / 1e12
      rec.update(us=us, kv_gbs=gbs, copy_pct=100 * gbs / COPY_BANDWIDTH_GBS, tflops=tflops)
      extra = (f"{gbs:8.0f} GB/s {100 * gbs / COPY_BANDWIDTH_GBS:5.1f}% of copy"
               if kind == "decode" else f"{tflops:7.1f} TFLOP/s")
      print(f"{kind:8s} B={p.batch:<4d} q={p.q_len:<5d} ctx={p.ctx:<6d} {impl:44s} "
            f"{us:10.1f} us  {extra}", flush=True)
    if self.json:
      self.json.write(json.dumps(rec) + "\n")
      self.json.flush()


def measure(rep: Reporter, kind: str, p: Problem, impl: str, make):
  try:
    fn, rest = make()
    us = time_chained(fn, p.q, *rest)
    rep.row(kind, p, impl, us)
  except Exception as e:  # noqa: BLE001 - one failure must not end the run
    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    rep.row(kind, p, impl, None, msg)
    if "--traceback" in sys.argv:
      traceback.print_exc()


def run_problem(rep: Reporter, kind: str, p: Problem, *, interpret: bool, sweep: bool,
                baselines: bool):
  if sweep:
    configs = decode_sweep(p) if kind == "decode" else prefill_sweep(p)
  else:
    configs = [auto_config(p)]
  for cfg in configs:
    name = "ours " + ("auto" if cfg is None else describe(cfg))
    if cfg is not None and cfg == auto_config(p):
      name += " (auto)"
    measure(rep, kind, p, name,
            lambda cfg=cfg: (ours(p, cfg, interpret), p.args()[1:]))
  if not baselines:
    return
  if kind == "decode":
    measure(rep, kind, p, "jax pallas paged_attention",
            lambda: jax_paged_attention(p, interpret))
  else:
    if jax.default_backend() == "gpu":
      measure(rep, kind, p, "cudnn dot_product_attention (contiguous)",
              lambda: cudnn_attention(p))
  if reference_bytes(p) <= XLA_REFERENCE_MAX_BYTES:
    measure(rep, kind, p, "xla gather+attend (reference)",
            lambda: (xla_reference(p), p.args()[1:]))
  else:
    rep.row(kind, p, "xla gather+attend (reference)", None,
            f"skipped: would materialise {reference_bytes(p) / 2**30:.0f} GiB")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="a subset: the target shapes")
  parser.add_argument("--smoke", action="store_true", help="tiny CPU run in interpret mode")
  parser.add_argument("--no-sweep", action="store_true", help="only the automatic tiling")
  parser.add_argument("--json", help="append one JSON line per measurement to this file")
  parser.add_argument("--traceback", action="store_true", help="print tracebacks of failures")
  args = parser.parse_args(argv)

  on_gpu = jax.default_backend() == "gpu"
  device = jax.devices()[0]
  print(f"device: {device.platform} {device.device_kind}; jax {jax.__version__}", flush=True)
  rep = Reporter(args.json)
  if args.smoke or not on_gpu:
    if not on_gpu:
      print("no GPU: tiny smoke run in interpret mode (figures are not kernel speed)")
    lay = Layout(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.float32)
    interpret = not on_gpu
    for kind, batch, q_len, ctx in [("decode", 2, 1, 64), ("prefill", 1, 32, 64)]:
      p = make_problem(lay, batch, q_len, ctx)
      run_problem(rep, kind, p, interpret=interpret, sweep=False, baselines=True)
    return

  lay = Layout()
  floor = dispatch_floor_us(make_problem(lay, 1, 1, 512))
  print(f"dispatch floor: {floor:.1f} us per call (figures near it are dispatch-bound)",
        flush=True)
  # Targets first, so that a run cut short still reports them.
  decode = [(64, 2048), (1, 8192), (256, 2048), (8, 2048)]
  prefill = [(4096, 4096), (512, 4096)]  # (chunk, context incl. chunk)
  if not args.quick:
    decode += [(b, c) for b in (1, 8, 64, 256) for c in (512, 2048, 8192)
               if (b, c) not in decode]
    prefill += [(1024, 1024), (2048, 4096), (4096, 8192), (1024, 8192)]
  # The tiling sweep runs on the target shapes; the others use the automatic tiling.
  for kind, shapes, sweep in (("decode", decode[:4], True), ("prefill", prefill[:2], True),
                              ("decode", decode[4:], False), ("prefill", prefill[2:], False)):
    for a, b in shapes:
      try:
        p = (make_problem(lay, a, 1, b) if kind == "decode" else make_problem(lay, 1, a, b))
      except Exception as e:  # noqa: BLE001
        print(f"{kind} {a}x{b}: could not build inputs: {e}", flush=True)
        continue
      run_problem(rep, kind, p, interpret=False, sweep=sweep and not args.no_sweep,
                  baselines=True)
      del p
      gc.collect()


if __name__ == "__main__":
  main()
