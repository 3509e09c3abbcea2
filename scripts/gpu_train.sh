#!/usr/bin/env bash
# Train the bundled tiny-llama on a GPU (one H200: jax 0.11.2, no pip installs needed) in
# about BUDGET seconds, as two runs of scripts/train_tiny.py:
#   1. probe (2/5 of the budget): cosine horizon of 40 epochs with early stopping, to find the
#      step where the held-out loss bottoms out (the 2M-token corpus is small; the model
#      overfits if trained for long);
#   2. final (the rest): a fresh run whose cosine schedule ends about there, so the kept
#      model is an annealed one rather than the probe's mid-schedule best.
# Each run writes model.safetensors (HF names), config.json, train_log.json and the tokenizer
# files; $OUT/best is the run with the lower held-out loss (the other runs keep only logs).
#
#   OUT=/path/to/out CORPUS=data/corpus bash scripts/gpu_train.sh
# CORPUS holds train_ids.npy / valid_ids.npy (scripts/train_tokenizer.py); afterwards
#   jaxserve convert $OUT/best checkpoints/tiny-llama-orbax   (or copy the files as they are).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the output directory}
CORPUS=${CORPUS:-data/corpus}
BUDGET=${BUDGET:-170}
PY=${PYTHON:-python3}
export PYTHONPATH=.
mkdir -p "$OUT"
start=$(date +%s)
MIN_FINAL_STEPS=${MIN_FINAL_STEPS:-100}
# EXTRA: more train_tiny.py flags, placed last so they override these (e.g. a CPU dry run).
common=(--corpus "$CORPUS" --tokenizer-dir checkpoints/tiny-llama --batch-size 128
        --seq-len 256 --eval-every 100 --log-every 50)

"$PY" scripts/train_tiny.py "${common[@]}" --out "$OUT/probe" --max-epochs 40 --patience 3 \
    --time-budget-s $((BUDGET * 2 / 5)) ${EXTRA:-} 2>&1 | tee "$OUT/probe.log"

best_step=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['best_step'])" \
    "$OUT/probe/train_log.json")
left=$((BUDGET - ($(date +%s) - start)))
if [ "$left" -ge 45 ] && [ "$best_step" -ge "$MIN_FINAL_STEPS" ]; then
    "$PY" scripts/train_tiny.py "${common[@]}" --out "$OUT/final" --steps $((best_step * 11 / 10)) \
        --max-epochs 1000 --patience 1000 --time-budget-s "$left" ${EXTRA:-} 2>&1 | tee "$OUT/final.log"
fi

"$PY" - "$OUT" <<'EOF'
import json, os, shutil, sys
out = sys.argv[1]
runs = [r for r in ("probe", "final") if os.path.isfile(os.path.join(out, r, "train_log.json"))]
logs = {r: json.load(open(os.path.join(out, r, "train_log.json"))) for r in runs}
best = min(runs, key=lambda r: logs[r]["valid_loss"])
shutil.copytree(os.path.join(out, best), os.path.join(out, "best"), dirs_exist_ok=True)
for r in runs:  # one copy of the weights comes back; each run keeps its log
    os.remove(os.path.join(out, r, "model.safetensors"))
for r in runs:
    l = logs[r]
    print(f"{r}: steps {l['steps']} epochs {l['epochs']} held-out loss {l['valid_loss']} "
          f"ppl {l['valid_ppl']} tokens/s {l['tokens_per_s']} wall {l['wall_s']}s")
print(f"best: {best} -> {os.path.join(out, 'best')}")
print("sample:", repr(logs[best]["sample_greedy"]))
EOF
