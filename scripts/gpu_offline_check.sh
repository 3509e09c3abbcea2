#!/usr/bin/env bash
# The one prepared GPU run of the offline engine benchmark (H200, jax 0.11.2 CUDA 13, no pip
# installs, no weights on the machine: dummy weights at real shapes). At most 8.5 minutes in all,
# each run under `timeout` and stopping itself earlier through --time-limit-s (it then prints
# the figures so far):
#   1. Llama-3.2-1B shapes, bf16: 256 prompts x 512 in / 256 out (smoke + figures), cut at 50 s
#      of generation, budget 150 s;
#   2. Llama-3.1-8B shapes, bf16: 1,000 prompts x 1,000 in / 1,000 out (the target: >= 12,000
#      output tok/s), cut at 120 s of generation, budget 360 s (start-up: random-weight init,
#      one profiling compile of the 8,192-token step for the KV sizing, three bucket compiles).
# Token buckets are cut to three (256 for decode at max_num_seqs 256, 1024, 8192 for prefill)
# so start-up compiles three model variants instead of ten.
# Logs go to $OUT (default /tmp/out): env.txt, bench_1b.log, bench_8b.log, results.jsonl
# (one JSON summary per run), summary.txt.
#
#   OUT=/path/to/out bash scripts/gpu_offline_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

COMMON=(--load-format dummy --dtype bfloat16 --max-num-seqs 256 --max-num-batched-tokens 8192
        --token-buckets 256,1024,8192 --temperature 1.0 --compilation-cache-dir /tmp/jaxserve-xla
        --report-every-s 10 --json-out "$OUT/results.jsonl")

echo "== 1. Llama-3.2-1B shapes (budget 150 s)"
timeout -k 10 150 "$PY" benchmarks/bench_offline.py --model llama-3.2-1b "${COMMON[@]}" \
    --num-prompts 256 --input-len 512 --output-len 256 --time-limit-s 50 2>&1 | tee "$OUT/bench_1b.log"

echo "== 2. Llama-3.1-8B shapes (budget 360 s)"
timeout -k 10 360 "$PY" benchmarks/bench_offline.py --model llama-3.1-8b "${COMMON[@]}" \
    --num-prompts 1000 --input-len 1000 --output-len 1000 --time-limit-s 120 2>&1 | tee "$OUT/bench_8b.log"

{
  echo "results (one JSON line per finished run):"
  cat "$OUT/results.jsonl" 2>/dev/null || echo "(none: see the logs)"
  echo "last progress lines:"
  grep -h "tok/s" "$OUT"/bench_*.log | tail -n 8
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
