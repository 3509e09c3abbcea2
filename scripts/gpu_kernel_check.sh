#!/usr/bin/env bash
# The one prepared GPU run for the attention kernels (H200, jax 0.11.2 CUDA 13, no pip
# installs). About 5 minutes in all, each step under `timeout`:
#   1. tests/pallas_kernels compiled on the GPU (interpret mode is chosen only on CPU),
#      including the GPU-only sweep; pytest if importable, else a small built-in runner;
#   2. benchmarks/bench_attention.py: decode and prefill at Llama-3-8B's head layout, our
#      kernel with its automatic tiling and a few alternatives, JAX's Pallas paged_attention,
#      cuDNN and the XLA reference. Targets come first, so a cut-short run still has them.
# Logs go to $OUT (default /tmp/out): env.txt, tests.log, bench.log, bench.jsonl (one JSON
# line per measurement), summary.txt.
#
#   PYTHONPATH=. OUT=/path/to/out bash scripts/gpu_kernel_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
TEST_BUDGET=${TEST_BUDGET:-130}
BENCH_BUDGET=${BENCH_BUDGET:-180}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== 1. kernel tests, compiled (budget ${TEST_BUDGET}s)"
if "$PY" -c "import pytest" 2>/dev/null; then
  # console_output_style=times prints each test's duration as it ends, so a run
  # stopped by the budget still shows where the time went.
  timeout -k 10 "$TEST_BUDGET" "$PY" -m pytest -v -rfEs -p no:cacheprovider \
      -o addopts="" -o console_output_style=times tests/pallas_kernels 2>&1 | tee "$OUT/tests.log"
else
  echo "(pytest not installed: built-in runner)"
  timeout -k 10 "$TEST_BUDGET" "$PY" - tests/pallas_kernels <<'EOF' 2>&1 | tee "$OUT/tests.log"
"""Minimal stand-in for pytest: parametrize, skipif, param, raises, module-level marks."""
import contextlib, glob, importlib.util, itertools, os, re, sys, traceback, types

class _Param:
  def __init__(self, *values, id=None):
    self.values, self.id = values, id

def _mark_factory(name):
  def factory(*args, **kwargs):
    if name not in ("parametrize", "skipif") and len(args) == 1 and callable(args[0]):
      return args[0]  # bare marker such as @pytest.mark.gpu
    def deco(fn):
      fn.__dict__.setdefault("_marks", []).append((name, args, kwargs))
      return fn
    return deco
  return factory

class _Marks:
  def __getattr__(self, name):
    return _mark_factory(name)

@contextlib.contextmanager
def _raises(exc, match=None):
  try:
    yield
  except exc as e:
    if match is not None and not re.search(match, str(e)):
      raise AssertionError(f"{e!r} does not match {match!r}")
  else:
    raise AssertionError(f"did not raise {exc}")

pytest = types.ModuleType("pytest")
pytest.mark, pytest.param, pytest.raises = _Marks(), _Param, _raises
# Libraries that see a "pytest" module may register fixtures at import.
pytest.fixture = lambda *a, **k: a[0] if a and callable(a[0]) else (lambda f: f)
sys.modules["pytest"] = pytest

def cases(fn):
  marks = list(reversed(fn.__dict__.get("_marks", [])))
  for name, args, _ in marks:
    if name == "skipif" and args[0]:
      yield None, "skipped"
      return
  axes = []
  for name, args, _ in marks:
    if name == "parametrize":
      names = [n.strip() for n in args[0].split(",")]
      rows = []
      for v in args[1]:
        v = v.values if isinstance(v, _Param) else v
        rows.append(dict(zip(names, v if len(names) > 1 else (v,))))
      axes.append(rows)
  for combo in itertools.product(*axes):
    kwargs = {}
    for d in combo:
      kwargs.update(d)
    yield kwargs, None

passed = failed = skipped = 0
for path in sorted(glob.glob(os.path.join(sys.argv[1], "test_*.py"))):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for name in dir(module):
    fn = getattr(module, name)
    if not (name.startswith("test_") and callable(fn)):
      continue
    for kwargs, skip in cases(fn):
      if skip:
        skipped += 1
        continue
      try:
        fn(**kwargs)
        passed += 1
      except Exception:
        failed += 1
        print(f"FAILED {path}::{name} {kwargs}")
        traceback.print_exc()
print(f"{passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed else 0)
EOF
fi
echo "tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/tests.log"

echo "== 2. attention benchmark (budget ${BENCH_BUDGET}s)"
rm -f "$OUT/bench.jsonl"
timeout -k 10 "$BENCH_BUDGET" "$PY" benchmarks/bench_attention.py --json "$OUT/bench.jsonl" \
    2>&1 | tee "$OUT/bench.log"
echo "bench exit: ${PIPESTATUS[0]} (124 = stopped by the time budget)" | tee -a "$OUT/bench.log"

{
  echo "tests: $(grep -E '[0-9]+ (passed|failed)' "$OUT/tests.log" | tail -1)"
  echo "best figures of our kernel per shape:"
  "$PY" - "$OUT/bench.jsonl" <<'EOF'
import json, sys
best = {}
for line in open(sys.argv[1]):
  r = json.loads(line)
  if "us" not in r:
    continue
  key = (r["kind"], r["batch"], r["q_len"], r["ctx"], r["impl"].startswith("ours"))
  if key not in best or r["us"] < best[key]["us"]:
    best[key] = r
for (kind, b, q, ctx, is_ours), r in sorted(best.items()):
  fig = f'{r["kv_gbs"]:.0f} GB/s ({r["copy_pct"]:.0f}% of copy)' if kind == "decode" else f'{r["tflops"]:.0f} TFLOP/s'
  who = "ours" if is_ours else "best baseline"
  print(f'{kind:8s} B={b:<4d} q={q:<5d} ctx={ctx:<6d} {who:14s} {r["us"]:9.1f} us  {fig}  [{r["impl"]}]')
EOF
} 2>&1 | tee "$OUT/summary.txt"
