#!/usr/bin/env bash
# The prepared TPU session (a TPU VM with `pip install -c requirements-lock.txt -e ".[tpu,test]"`;
# never run yet, no TPU was available when it was written): 1. the TPU kernel's tests compiled
# (kernel vs jnp reference, the tpu-marked Llama-shape cases), 2. the engine oracle through
# pallas-tpu compiled, 3. the offline engine at Llama-3.1-8B shapes with dummy bf16 weights,
# pallas-tpu when step 1 passed, else xla (jnp attention). Logs in $OUT.
#
#   OUT=/path/to/out bash scripts/tpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"

echo "== 1. TPU kernel tests, compiled (budget ${TEST_BUDGET:-300}s)"
timeout -k 10 "${TEST_BUDGET:-300}" "$PY" -m pytest -q -x -p no:cacheprovider \
    tests/pallas_kernels/test_ragged_paged_attention_tpu.py 2>&1 | tee "$OUT/tpu_tests.log"
echo "tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/tpu_tests.log"

echo "== 2. engine oracle through pallas-tpu, compiled (budget ${ORACLE_BUDGET:-300}s)"
timeout -k 10 "${ORACLE_BUDGET:-300}" "$PY" -m pytest -q -x -p no:cacheprovider \
    tests/engine/test_oracle_pallas_tpu.py 2>&1 | tee "$OUT/tpu_oracle.log"
echo "oracle exit: ${PIPESTATUS[0]}" | tee -a "$OUT/tpu_oracle.log"

backend=pallas-tpu
grep -q "tests exit: 0" "$OUT/tpu_tests.log" || backend=xla
echo "== 3. offline engine, Llama-3.1-8B shapes, bf16, attention backend $backend (budget ${OFFLINE_BUDGET:-300}s)"
timeout -k 10 "${OFFLINE_BUDGET:-300}" "$PY" benchmarks/bench_offline.py --model llama-3.1-8b \
    --load-format dummy --dtype bfloat16 --max-num-seqs 256 --max-num-batched-tokens 8192 \
    --token-buckets 256,8192 --temperature 1.0 --compilation-cache-dir /tmp/jaxserve-xla \
    --attention-backend "$backend" --report-every-s 10 --json-out "$OUT/offline_tpu.jsonl" \
    --num-prompts 1000 --input-len 1000 --output-len 1000 --time-limit-s "${OFFLINE_GEN_S:-90}" \
    2>&1 | tee "$OUT/offline_tpu.log"
echo "offline exit: ${PIPESTATUS[0]}" | tee -a "$OUT/offline_tpu.log"
