#!/usr/bin/env bash
# Tensor-parallel check for a multi-GPU host (unmeasured so far: the lent machines have one GPU).
# Offline engine at Llama-3.1-8B shapes, dummy bf16 weights, at every tensor-parallel size the
# host's GPU count allows (1, 2, 4, 8), same workload each time; the JSON summaries (output tok/s,
# ms per step) go to $OUT/tp.jsonl. 70B needs the sharded loader first (docs/PARALLELISM.md).
#
#   OUT=/path/to/out bash scripts/gpu_tp_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
ngpu=$("$PY" -c "import jax; print(jax.device_count())")
for tp in 1 2 4 8; do
    [ "$tp" -le "$ngpu" ] || break
    echo "== tensor parallel $tp of $ngpu devices (budget ${TP_BUDGET:-240}s)"
    timeout -k 10 "${TP_BUDGET:-240}" "$PY" benchmarks/bench_offline.py --model llama-3.1-8b \
        --load-format dummy --dtype bfloat16 --tensor-parallel-size "$tp" --max-num-seqs 256 \
        --max-num-batched-tokens 8192 --token-buckets 256,8192 --temperature 0 \
        --compilation-cache-dir /tmp/jaxserve-xla --report-every-s 10 --json-out "$OUT/tp.jsonl" \
        --num-prompts 1000 --input-len 1000 --output-len 1000 --time-limit-s "${TP_GEN_S:-60}" \
        2>&1 | tee "$OUT/tp_$tp.log"
    echo "tp $tp exit: ${PIPESTATUS[0]}" | tee -a "$OUT/tp_$tp.log"
done
