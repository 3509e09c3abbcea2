#!/usr/bin/env bash
# jaxserve vs vLLM's CPU engine, side by side on the same checkpoint (#21).
#
# Both servers get the same HF checkpoint and the same engine flags; the same client (`vllm bench serve`, random
# 128 in / 64 out, ignore_eos) runs against each, interleaved: per rep vLLM then jaxserve at rate inf, then both at
# max-concurrency 8. Prints each run's line, the peer's summary (medians and ratios), and our targets as ratios
# jaxserve / vLLM of the per-setting medians: output tok/s >= 1.0, mean e2e latency <= 1.0, TTFT p99 <= 1.0.
# Two diagnostics follow, steadier than the timings on a shared box: each server's CPU seconds per 1,000 output
# tokens (every process of the server's session, from ps; vLLM's engine core and worker included) and the output
# tokens per streamed chunk (a server whose streams lag merges tokens into fewer SSE chunks: less work for the client,
# which shares the cores).
#
# vLLM is never a dependency of ours: it runs from its own venv, built by the peer scripts when missing.
# Usage (from the repo root):
#   benchmarks/bench_vs_vllm.sh [OUT_DIR]
# Variables (defaults): PEER_DIR (../shared/peer beside the repo), VLLM_VENV (/work/peer/vllm-venv),
#   MODELS_ROOT (/work/peer/models), MODEL (llama), REPS (3), NUM_PROMPTS (100), JS_BIN (.venv/bin),
#   PORT_VLLM (18731), PORT_JS (18732), EXTRA_JS_FLAGS (none).
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
PEER_DIR=${PEER_DIR:-$REPO/../shared/peer}
[ -d "$PEER_DIR" ] || PEER_DIR=/work/shared/peer
PEER_DIR=$(cd "$PEER_DIR" && pwd) || { echo "PEER_DIR not found"; exit 2; }
VLLM_VENV=${VLLM_VENV:-/work/peer/vllm-venv}
MODELS_ROOT=${MODELS_ROOT:-/work/peer/models}
MODEL_DIR=$MODELS_ROOT/${MODEL:-llama}
REPS=${REPS:-3}; NUM_PROMPTS=${NUM_PROMPTS:-100}; JS_BIN=${JS_BIN:-$REPO/.venv/bin}
PV=${PORT_VLLM:-18731}; PJ=${PORT_JS:-18732}
OUT=${1:-/tmp/bench_vs_vllm_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT"
. "$PEER_DIR/serverlib.sh"
VLLM_PY=$VLLM_VENV/bin/python
if [ ! -x "$VLLM_PY" ]; then
  echo "## building the vLLM CPU peer in $VLLM_VENV"; bash "$PEER_DIR/setup_vllm_cpu.sh" "$VLLM_VENV" || exit 1
fi
if [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "## making the tiny checkpoints in $MODELS_ROOT"
  "$VLLM_PY" "$PEER_DIR/make_tiny_models.py" "$REPO/checkpoints/tiny-llama" "$MODELS_ROOT" || exit 1
fi
echo "## conditions: $(date -u +%FT%TZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), model $MODEL_DIR, reps $REPS"
# vLLM 0.32 CPU needs a block size that is a multiple of 32.
COMMON=(--dtype float32 --max-model-len 1024 --max-num-seqs 128 --max-num-batched-tokens 512 --block-size 32
        --enable-prefix-caching --served-model-name tiny)
VSERVE=("$VLLM_PY" "$PEER_DIR/vllm_cli.py" serve "$MODEL_DIR" "${COMMON[@]}" --gpu-memory-utilization 0.3 --port "$PV")
# shellcheck disable=SC2206
JSERVE=("$JS_BIN/jaxserve" serve "$MODEL_DIR" "${COMMON[@]}" --port "$PJ" ${EXTRA_JS_FLAGS:-})
session_cpu() {  # CPU clock ticks (user + system) of the processes of session $1
  local p
  for p in $(ps -s "$1" -o pid=); do sed 's/.*) //' "/proc/$p/stat" 2>/dev/null; done | awk '{s += $12 + $13} END {print s + 0}'
}
bench() {  # bench LABEL PORT SEED [extra client flags]
  local label=$1 port=$2 seed=$3; shift 3
  local sid=$VP; [ "$port" = "$PJ" ] && sid=$JP
  local cpu0; cpu0=$(session_cpu "$sid")
  timeout 900 "$VLLM_PY" "$PEER_DIR/vllm_cli.py" bench serve --backend openai --base-url "http://127.0.0.1:$port" \
    --model tiny --tokenizer "$MODEL_DIR" --dataset-name random --random-input-len 128 --random-output-len 64 \
    --num-prompts "$NUM_PROMPTS" --request-rate inf --ignore-eos --num-warmups 1 --percentile-metrics ttft,tpot,itl,e2el \
    --seed "$seed" --disable-tqdm --save-result --result-dir "$OUT" --result-filename "$label.json" --save-detailed "$@" >"$OUT/$label.txt" 2>&1
  awk -v a="$cpu0" -v b="$(session_cpu "$sid")" -v hz="$(getconf CLK_TCK)" 'BEGIN {print (b - a) / hz}' >"$OUT/$label.cpu"
  echo "$label: $(grep -E 'Successful requests|Output token throughput|Mean E2EL' "$OUT/$label.txt" | tr -s ' ' | tr '\n' ' ')"
}
start_server vllm "$PV" "$OUT/vllm_server.log" "${VSERVE[@]}" || exit 1; VP=$SERVER_PID
start_server jaxserve "$PJ" "$OUT/js_server.log" "${JSERVE[@]}" || { stop_server "$VP"; exit 1; }; JP=$SERVER_PID
trap 'stop_server $VP; stop_server $JP' EXIT
for r in $(seq 1 "$REPS"); do
  echo "## rep $r (load $(cut -d' ' -f1 /proc/loadavg))"
  bench "vllm_inf_r$r" "$PV" "$r"; bench "js_inf_r$r" "$PJ" "$r"
  bench "vllm_c8_r$r" "$PV" "$((100 + r))" --max-concurrency 8; bench "js_c8_r$r" "$PJ" "$((100 + r))" --max-concurrency 8
done
for w in inf c8; do
  mkdir -p "$OUT/$w"; for f in "$OUT"/*_"$w"_r*.json; do cp "$f" "$OUT/$w/$(basename "$f" | sed "s/_${w}_/_/")"; done
  echo "## summary $w"; "$VLLM_PY" "$PEER_DIR/summarize.py" "$OUT/$w" vllm js
done
echo "## targets (jaxserve / vLLM, ratio of medians over $REPS interleaved reps)"
python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
for w in ("inf", "c8"):
    def med(label, key):
        vals = [json.load(open(f))[key] for f in glob.glob(os.path.join(out, w, f"{label}_r*.json"))]
        return statistics.median(vals) if vals else float("nan")
    for key, want, ok in (("output_throughput", ">= 1.0", lambda r: r >= 1.0),
                          ("mean_e2el_ms", "<= 1.0", lambda r: r <= 1.0),
                          ("p99_ttft_ms", "<= 1.0", lambda r: r <= 1.0)):
        a, b = med("vllm", key), med("js", key)
        r = b / a if a else float("nan")
        print(f"{w:4s} {key:18s} vllm {a:9.1f}  jaxserve {b:9.1f}  ratio {r:6.3f} (target {want}): {'met' if ok(r) else 'NOT met'}")
print("## diagnostics (medians over the reps): server CPU s per 1,000 output tokens, output tokens per streamed chunk")
for w in ("inf", "c8"):
    for label in ("vllm", "js"):
        cpu, per_chunk = [], []
        for f in sorted(glob.glob(os.path.join(out, f"{label}_{w}_r*.json"))):
            d = json.load(open(f))
            tokens = d["total_output_tokens"]
            cpu_file = f[: -len(".json")] + ".cpu"
            if os.path.exists(cpu_file) and tokens:
                cpu.append(float(open(cpu_file).read()) / tokens * 1000)
            chunks = sum(len(x) + 1 for x in d.get("itls", []) if x is not None)
            if chunks:
                per_chunk.append(tokens / chunks)
        c = statistics.median(cpu) if cpu else float("nan")
        t = statistics.median(per_chunk) if per_chunk else float("nan")
        print(f"{w:4s} {label:8s} server CPU {c:6.3f} s / 1k tokens   {t:5.2f} tokens / chunk")
PY
