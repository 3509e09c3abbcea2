#!/usr/bin/env bash
# py-spy profile of `jaxserve serve` while `vllm bench serve` sends prompts at rate inf (#21).
#
# Same checkpoint, engine flags and client as benchmarks/bench_vs_vllm.sh; py-spy samples the server for DURATION
# seconds starting WARM seconds after the client starts, then benchmarks/pyspy_breakdown.py prints the shares of the
# sampled Python time by serving-path part. py-spy comes from the jaxserve venv (`.venv/bin/pip install py-spy`); it
# needs ptrace rights over the server (root, or kernel.yama.ptrace_scope 0).
# Usage (from the repo root):
#   benchmarks/profile_serve.sh [OUT_DIR]
# Variables (defaults): PEER_DIR, VLLM_VENV, MODELS_ROOT, MODEL, JS_BIN as bench_vs_vllm.sh; NUM_PROMPTS (300),
#   PORT_JS (18733), RATE (50 samples/s), WARM (2 s after
#   requests start running), DURATION (20), CLIENT_FLAGS (none; e.g. --max-concurrency 8), GIL (0; 1 = only samples holding the GIL),
#   EXTRA_JS_FLAGS (none), INPUT_LEN (128), OUTPUT_LEN (64).
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
PEER_DIR=${PEER_DIR:-$REPO/../shared/peer}
[ -d "$PEER_DIR" ] || PEER_DIR=/work/shared/peer
PEER_DIR=$(cd "$PEER_DIR" && pwd) || { echo "PEER_DIR not found"; exit 2; }
VLLM_PY=${VLLM_VENV:-/work/peer/vllm-venv}/bin/python
MODEL_DIR=${MODELS_ROOT:-/work/peer/models}/${MODEL:-llama}
JS_BIN=${JS_BIN:-$REPO/.venv/bin}; PJ=${PORT_JS:-18733}
OUT=${1:-/tmp/profile_serve_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT"
. "$PEER_DIR/serverlib.sh"
[ -x "$JS_BIN/py-spy" ] || { echo "py-spy missing: $JS_BIN/pip install py-spy"; exit 2; }
echo "## conditions: $(date -u +%FT%TZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), model $MODEL_DIR"
# shellcheck disable=SC2206
JSERVE=("$JS_BIN/jaxserve" serve "$MODEL_DIR" --dtype float32 --max-model-len 1024 --max-num-seqs 128
        --max-num-batched-tokens 512 --block-size 32 --enable-prefix-caching --served-model-name tiny --port "$PJ"
        ${EXTRA_JS_FLAGS:-})
start_server jaxserve "$PJ" "$OUT/js_server.log" "${JSERVE[@]}" || exit 1; JP=$SERVER_PID
trap 'stop_server $JP' EXIT
client() {  # client LABEL NUM_PROMPTS
  timeout 900 "$VLLM_PY" "$PEER_DIR/vllm_cli.py" bench serve --backend openai --base-url "http://127.0.0.1:$PJ" \
    --model tiny --tokenizer "$MODEL_DIR" --dataset-name random --random-input-len "${INPUT_LEN:-128}" --random-output-len "${OUTPUT_LEN:-64}" \
    --num-prompts "$2" --request-rate inf ${CLIENT_FLAGS:-} --ignore-eos --num-warmups 1 --seed 7 --disable-tqdm >"$OUT/$1.txt" 2>&1
}
client warmup 100
client profiled "${NUM_PROMPTS:-300}" & CP=$!
for _ in $(seq 1 600); do  # the client takes seconds to import: wait for its requests to run
  curl -s "http://127.0.0.1:$PJ/metrics" | grep -qE '^jaxserve:num_requests_running\{.*\} [1-9]' && break
  sleep 0.1
done
sleep "${WARM:-2}"
GILFLAG=(); [ "${GIL:-0}" = 1 ] && GILFLAG=(--gil)
gen_tokens() {  # the server's generation-token counter now
  curl -s "http://127.0.0.1:$PJ/metrics" | awk '/^jaxserve:generation_tokens_total/ {print int($NF)}'
}
T0=$(gen_tokens)
"$JS_BIN/py-spy" record -r "${RATE:-50}" -d "${DURATION:-20}" --format raw -o "$OUT/profile.txt" --pid "$JP" \
  "${GILFLAG[@]}" >"$OUT/py-spy.log" 2>&1 || { echo "py-spy failed:"; tail -5 "$OUT/py-spy.log"; }
T1=$(gen_tokens)
wait "$CP"
echo "## client: $(grep -E 'Output token throughput|Mean E2EL' "$OUT/profiled.txt" | tr -s ' ' | tr '\n' ' ')"
echo "## profile ($OUT/profile.txt), load $(cut -d' ' -f1-3 /proc/loadavg); $((T1 - T0)) tokens generated while sampling"
"$JS_BIN/python" "$REPO/benchmarks/pyspy_breakdown.py" "$OUT/profile.txt" "${RATE:-50}" "$((T1 - T0))"
