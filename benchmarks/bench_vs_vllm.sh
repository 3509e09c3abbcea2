#!/usr/bin/env bash
# jaxserve vs vLLM's CPU engine, side by side on the same checkpoints: the #34 grid.
#
# Both servers get the same HF checkpoint and the same engine flags, and run at once (each idle while the other is
# measured); the same client (`vllm bench serve`, random prompts, ignore_eos) runs against each, vLLM then jaxserve
# per cell, REPS interleaved reps. Cells:
#   * shapes (prompt/output tokens) 128/64, 512/128, 1024/256 and 3000/200 (`--max-model-len 4096`), each at request
#     rate inf, max-concurrency 16 and max-concurrency 1 (fewer prompts at the long shapes and at concurrency 1 so
#     that a run stays near a minute), on MODEL (llama); the 512/128 row again on MODEL2 (qwen2);
#   * single requests (one at a time) of 2,000, 6,000 and 12,000 prompt tokens, SINGLE_OUT output tokens each
#     (`--max-model-len 16384`), on MODEL.
# Per cell and metric, `bench_vs_vllm_table.py` prints the medians over the reps and the ratio jaxserve / vLLM: output
# tok/s, mean e2e latency, TTFT p99, TPOT median, server CPU seconds (every process of the server's session, from
# /proc ticks: vLLM's engine core included) and the server's peak RSS during the run (sum over the session's
# processes, sampled every 0.2 s).
#
# The tiny float32 checkpoints come from the peer scripts (`make_tiny_models.py`) in MODELS_ROOT, outside the repo;
# their config says max_position_embeddings 1024, so a copy per model with 16,384 (weights and tokenizer linked, not
# copied) serves the longer max-model-len on both servers. vLLM is never a dependency of ours: it runs from its own
# venv, built by the peer scripts when missing.
# Usage (from the repo root; `nice` it on a shared box):
#   benchmarks/bench_vs_vllm.sh [OUT_DIR]
# Variables (defaults): PEER_DIR (../shared/peer beside the repo, else /work/shared/peer), VLLM_VENV (/work/vllm-venv),
#   MODELS_ROOT (/work/peer-models), MODEL (llama), MODEL2 (qwen2; empty: no second architecture), REPS (3),
#   SHAPES ("128:64:100:16 512:128:64:8 1024:256:32:6 3000:200:24:4" = prompt:output:prompts:prompts at concurrency 1),
#   MODES ("inf c16 c1"), SINGLES ("2000 6000 12000"; empty: none), SINGLE_OUT (128), SINGLE_PROMPTS (2),
#   JS_BIN (.venv/bin), PORT_VLLM (18731), PORT_JS (18732), EXTRA_JS_FLAGS (none), VLLM_CPU_KVCACHE_SPACE (1),
#   JS_REV (the commit printed when REPO is not a git checkout).
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
PEER_DIR=${PEER_DIR:-$REPO/../shared/peer}
[ -d "$PEER_DIR" ] || PEER_DIR=/work/shared/peer
PEER_DIR=$(cd "$PEER_DIR" && pwd) || { echo "PEER_DIR not found"; exit 2; }
VLLM_VENV=${VLLM_VENV:-/work/vllm-venv}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}  # GiB of KV cache for vLLM (its default takes far more)
MODELS_ROOT=${MODELS_ROOT:-/work/peer-models}
MODEL=${MODEL:-llama}; MODEL2=${MODEL2-qwen2}
REPS=${REPS:-3}; JS_BIN=${JS_BIN:-$REPO/.venv/bin}
SHAPES=${SHAPES-128:64:100:16 512:128:64:8 1024:256:32:6 3000:200:24:4}
MODES=${MODES-inf c16 c1}
SINGLES=${SINGLES-2000 6000 12000}; SINGLE_OUT=${SINGLE_OUT:-128}; SINGLE_PROMPTS=${SINGLE_PROMPTS:-2}
PV=${PORT_VLLM:-18731}; PJ=${PORT_JS:-18732}
OUT=${1:-/tmp/bench_vs_vllm_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT"
. "$PEER_DIR/serverlib.sh"
VLLM_PY=$VLLM_VENV/bin/python
if [ ! -x "$VLLM_PY" ]; then
  echo "## building the vLLM CPU peer in $VLLM_VENV"; bash "$PEER_DIR/setup_vllm_cpu.sh" "$VLLM_VENV" || exit 1
fi
if [ ! -f "$MODELS_ROOT/$MODEL/config.json" ]; then
  echo "## making the tiny checkpoints in $MODELS_ROOT"
  "$VLLM_PY" "$PEER_DIR/make_tiny_models.py" "$REPO/jaxserve/checkpoints/tiny-llama" "$MODELS_ROOT" || exit 1
fi
long_copy() {  # long_copy NAME -> prints the dir of NAME with max_position_embeddings 16384
  local src=$MODELS_ROOT/$1 dst=$MODELS_ROOT/$1-16k f
  if [ ! -f "$dst/config.json" ]; then
    mkdir -p "$dst"
    for f in "$src"/*; do [ "$(basename "$f")" = config.json ] || ln -sf "$f" "$dst/"; done
    python3 -c "import json, sys; c = json.load(open(sys.argv[1])); c['max_position_embeddings'] = 16384
json.dump(c, open(sys.argv[2], 'w'), indent=2)" "$src/config.json" "$dst/config.json"
  fi
  echo "$dst"
}
echo "## conditions: $(date -u +%FT%TZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), reps $REPS, jaxserve $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo "${JS_REV:-unknown}")"
echo "$(date -u +%FT%TZ) $(cut -d' ' -f1-3 /proc/loadavg)" >"$OUT/load_start"
session_cpu() {  # CPU clock ticks (user + system) of the processes of session $1
  local p
  for p in $(ps -s "$1" -o pid=); do sed 's/.*) //' "/proc/$p/stat" 2>/dev/null; done | awk '{s += $12 + $13} END {print s + 0}'
}
peak_rss() {  # peak_rss SID FILE: samples the session's summed RSS (KiB) every 0.2 s into FILE (max) until killed
  local peak=0 r
  while :; do
    r=$(ps -s "$1" -o rss= | awk '{s += $1} END {print s + 0}')
    [ "$r" -gt "$peak" ] && { peak=$r; echo "$peak" >"$2"; }
    sleep 0.2
  done
}
bench() {  # bench LABEL PORT MODEL_DIR SEED IN OUT PROMPTS [extra client flags]
  local label=$1 port=$2 dir=$3 seed=$4 in=$5 out=$6 n=$7; shift 7
  local sid=$VP; [ "$port" = "$PJ" ] && sid=$JP
  local cpu0 sampler; cpu0=$(session_cpu "$sid")
  peak_rss "$sid" "$OUT/$label.rss" & sampler=$!
  timeout 1200 "$VLLM_PY" "$PEER_DIR/vllm_cli.py" bench serve --backend openai --base-url "http://127.0.0.1:$port" \
    --model tiny --tokenizer "$dir" --dataset-name random --random-input-len "$in" --random-output-len "$out" \
    --num-prompts "$n" --request-rate inf --ignore-eos --num-warmups 1 --percentile-metrics ttft,tpot,itl,e2el \
    --seed "$seed" --disable-tqdm --save-result --result-dir "$OUT" --result-filename "$label.json" "$@" >"$OUT/$label.txt" 2>&1
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  awk -v a="$cpu0" -v b="$(session_cpu "$sid")" -v hz="$(getconf CLK_TCK)" 'BEGIN {print (b - a) / hz}' >"$OUT/$label.cpu"
  echo "$label: $(grep -E 'Successful requests|Output token throughput|Mean E2EL' "$OUT/$label.txt" | tr -s ' ' | tr '\n' ' ')"
}
VP=; JP=
stop_both() { [ -n "$VP" ] && stop_server "$VP"; [ -n "$JP" ] && stop_server "$JP"; VP=; JP=; }
trap stop_both EXIT
start_both() {  # start_both MODEL_DIR MAX_MODEL_LEN
  local common=(--dtype float32 --max-model-len "$2" --max-num-seqs 128 --max-num-batched-tokens 512 --block-size 32
                --enable-prefix-caching --served-model-name tiny)
  local tag; tag=$(basename "$1")_$2
  start_server vllm "$PV" "$OUT/vllm_server_$tag.log" "$VLLM_PY" "$PEER_DIR/vllm_cli.py" serve "$1" "${common[@]}" \
    --gpu-memory-utilization 0.3 --port "$PV" || exit 1
  VP=$SERVER_PID
  # shellcheck disable=SC2086
  start_server jaxserve "$PJ" "$OUT/js_server_$tag.log" "$JS_BIN/jaxserve" serve "$1" "${common[@]}" --port "$PJ" \
    ${EXTRA_JS_FLAGS:-} || exit 1
  JP=$SERVER_PID
}
run_cell() {  # run_cell CELL MODEL_DIR REP SEED IN OUT PROMPTS [client flags]: vLLM, then jaxserve
  local cell=$1 dir=$2 r=$3; shift 3
  bench "vllm__${cell}_r$r" "$PV" "$dir" "$@"; bench "js__${cell}_r$r" "$PJ" "$dir" "$@"
}
shape_rows() {  # shape_rows ARCH SHAPES: the shape cells of one architecture, REPS interleaved reps
  local arch=$1 shapes=$2 dir r s in out n n1 mode
  dir=$(long_copy "$arch"); start_both "$dir" 4096
  for r in $(seq 1 "$REPS"); do
    echo "## $arch rep $r (load $(cut -d' ' -f1 /proc/loadavg))"
    for s in $shapes; do
      IFS=: read -r in out n n1 <<<"$s"
      for mode in $MODES; do
        case $mode in
          inf) run_cell "${arch}_${in}x${out}_inf" "$dir" "$r" "$r" "$in" "$out" "$n" ;;
          c16) run_cell "${arch}_${in}x${out}_c16" "$dir" "$r" "$((100 + r))" "$in" "$out" "$n" --max-concurrency 16 ;;
          c1) run_cell "${arch}_${in}x${out}_c1" "$dir" "$r" "$((200 + r))" "$in" "$out" "$n1" --max-concurrency 1 ;;
        esac
      done
    done
  done
  stop_both
}
[ -n "$SHAPES" ] && shape_rows "$MODEL" "$SHAPES"
if [ -n "$MODEL2" ]; then
  second=""; for s in $SHAPES; do case $s in 512:128:*) second=$s ;; esac; done
  [ -n "$second" ] && shape_rows "$MODEL2" "$second"
fi
if [ -n "$SINGLES" ]; then
  dir=$(long_copy "$MODEL"); start_both "$dir" 16384
  for r in $(seq 1 "$REPS"); do
    echo "## $MODEL singles rep $r (load $(cut -d' ' -f1 /proc/loadavg))"
    for len in $SINGLES; do
      run_cell "${MODEL}_${len}x${SINGLE_OUT}_single" "$dir" "$r" "$((300 + r))" "$len" "$SINGLE_OUT" "$SINGLE_PROMPTS" --max-concurrency 1
    done
  done
  stop_both
fi
echo "$(date -u +%FT%TZ) $(cut -d' ' -f1-3 /proc/loadavg)" >"$OUT/load_end"
echo "## table (jaxserve / vLLM, ratio of medians over $REPS interleaved reps)"
python3 "$REPO/benchmarks/bench_vs_vllm_table.py" "$OUT"
