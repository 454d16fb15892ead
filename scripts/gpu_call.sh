#!/usr/bin/env bash
# What a session runs on the lent GPU, phase by phase, in one call:
#   scripts/gpu_call.sh env train-tests demo study:formats study:stiction ... report
# Every run directory lands under results/ (tracked: a later call skips the runs already there);
# $OUT/results.tgz brings back receipts, metrics, reports and plots (never checkpoints).
# BUDGET (seconds, default 540) bounds the study phases so that the report and tar still run.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4LAB_CACHE=/tmp/fp4lab-cache OMP_NUM_THREADS=2
OUT=${OUT:-/tmp/out}
budget=${BUDGET:-540}
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
quiet() { grep --line-buffered -v -E "it/s|s/it|step/s|s/step|file/s|run/s|s/run"; }
for phase in "$@"; do
  echo "== $phase ($(left) s left)"
  case $phase in
    env) nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
         python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" ;;
    train-tests) python3 -m pytest tests/train -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_train_gpu.log" | tail -3 ;;
    demo) python3 -m fp4lab demo --out results/demo --device gpu 2>&1 | quiet | tee "$OUT/demo.log" ;;
    study:*) name=${phase#study:}
         [ "$(left)" -gt 30 ] || { echo "skipped: out of time"; continue; }
         timeout "$(left)" python3 -m fp4lab study "$name" --scale "${SCALE:-gpu-small}" --jobs "${JOBS:-6}" \
           --out "results/$name" 2>&1 | quiet | grep -v "^|" | tail -40 ;;
    report) for dir in results/*/; do
              name=$(basename "$dir")
              ls "$dir" | grep -q -- "-seed" && python3 -m fp4lab study "$name" --report-only --out "$dir" 2>&1 \
                | grep -E "^\| .* \| (yes|no|partly|not run) \|"
            done ;;
    *) echo "unknown phase $phase" ;;
  esac
done
tar czf "$OUT/results.tgz" --exclude=checkpoint results
ls -la "$OUT"
