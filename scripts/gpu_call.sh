#!/usr/bin/env bash
# What a session runs on the lent GPU, phase by phase, in one call:
#   scripts/gpu_call.sh env train-tests demo study:formats study:stiction ... report
#   scripts/gpu_call.sh env pair-tests bench:quantize sweep    then    bench:linear model-pair
#   WORKERS=4 scripts/gpu_call.sh env tests
# Every run directory lands under results/ (tracked: a later call skips the runs already there);
# $OUT/results.tgz brings back receipts, metrics, reports and plots (never checkpoints).
# BUDGET (seconds, default 540) bounds the study phases so that the report and tar still run.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4LAB_CACHE=/tmp/fp4lab-cache OMP_NUM_THREADS=2
OUT=${OUT:-/tmp/out}
budget=${BUDGET:-540}
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
source "$(dirname "$0")/quiet.sh"
for phase in "$@"; do
  echo "== $phase ($(left) s left)"
  case $phase in
    env) nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
         python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" ;;
    train-tests) python3 -m pytest tests/train -p no:cacheprovider 2>&1 | tee "$OUT/pytest_train_gpu.log" | tail -3 ;;
    demo) python3 -m fp4lab demo --out results/demo --device gpu 2>&1 | quiet | tee "$OUT/demo.log" ;;
    study:*) name=${phase#study:}  # $JOBS runs on each visible GPU
         [ "$(left)" -gt 30 ] || { echo "skipped: out of time"; continue; }
         timeout "$(left)" python3 -m fp4lab study "$name" --scale "${SCALE:-gpu-small}" --jobs "${JOBS:-6}" \
           --out "results/$name" 2>&1 | quiet | grep -v "^|" | tail -40 ;;
    ddp) # 1 GPU vs torchrun on 2 GPUs, the same global batch (32 x 512), BF16 and NVFP4
         python3 -c "from fp4lab.train.corpus import default_dataset; default_dataset('python')" 2>&1 | quiet
         rm -rf results/ddp
         for recipe in bf16 nvfp4; do
           common="--model d6 --data python --recipe $recipe --steps 200 --set batch_size=32 --set seq_len=512 \
                   --set warmup=40 --set lr=2e-3 --set eval_every=50 --set eval_batches=16 --set progress=false"
           CUDA_VISIBLE_DEVICES=0 python3 -m fp4lab train $common --out "results/ddp/$recipe-1gpu" | tail -1
           torchrun --nproc_per_node=2 -m fp4lab train $common --out "results/ddp/$recipe-2gpu" 2>&1 | tail -1
         done
         python3 -m fp4lab report results/ddp/*gpu --out results/ddp --title "DDP: 1 vs 2 GPUs" | tail -6
         python3 scripts/compare_runs.py results/ddp/bf16-1gpu results/ddp/bf16-2gpu results/ddp/nvfp4-1gpu \
           results/ddp/nvfp4-2gpu | tee results/ddp/compare.md ;;
    gpt-d12) # a ~100M GPT (d12, 8192-entry BPE), BF16 then NVFP4, 300 steps of 16 x 1024 tokens, alone on the GPU
         for recipe in bf16 nvfp4; do
           python3 -m fp4lab train --model d12 --data python --recipe "$recipe" --steps 300 --set batch_size=16 \
             --set seq_len=1024 --set warmup=30 --set lr=1e-3 --set eval_every=50 --set eval_batches=16 \
             --set progress=false --out "results/gpt-d12/$recipe" | tail -1
         done
         python3 -m fp4lab report results/gpt-d12/bf16 results/gpt-d12/nvfp4 --out results/gpt-d12 --title "d12 GPT" ;;
    kernel-tests) python3 -m pytest tests/kernels tests/nn -p no:cacheprovider 2>&1 | tee "$OUT/pytest_kernels_nn_gpu.log" | tail -3 ;;
    tests) # the GPU-capable suites in $WORKERS processes (pytest-xdist); -v streams each test's outcome to
         # the log as it comes, so a run the call's limit cuts short still names its failures
         python3 -m pytest -n "${WORKERS:-4}" -v -rfE --tb=short -p no:cacheprovider tests/kernels tests/nn tests/train \
           2>&1 | grep --line-buffered -v "PytestBenchmarkWarning\|warner(" | tee "$OUT/pytest_gpu.log" | grep -E "FAILED|ERROR|passed|failed" | tail -40 ;;
    pair-tests) # the pair kernel (a linear's two copies from one read) and GraphedStep's autocast, on CUDA
         # (-k would filter every listed file: the pair's kernel tests by name, the layer and capture whole)
         { python3 -m pytest tests/kernels/test_quantize.py -k pair -p no:cacheprovider
           python3 -m pytest tests/nn/test_linear.py tests/train/test_graphed.py -p no:cacheprovider; } 2>&1 \
           | tee "$OUT/pytest_pair_cuda.log" | grep -E "passed|failed|FAILED|error" ;;
    model-pair) # d12 graphed and compiled+graphed, with and without the pair, in the same rounds
         timeout "$(left)" python3 benchmarks/bench_model.py --arms bf16 nvfp4 nvfp4:single \
           --modes graphed compiled_graphed 2>&1 | tee "$OUT/bench_model_pair.log" | tail -8 ;;
    model-compiled) # d12 compiled: BF16, NVFP4 (Python wrapper) and NVFP4 under the C++ wrapper, each arm's compile
         # seconds by phase (--compile-times) and in its row (warm_s)
         timeout "$(left)" python3 benchmarks/bench_model.py --modes compiled --arms bf16 nvfp4 nvfp4:cpp --compile-times \
           2>&1 | grep --line-buffered -v Warn | tee "$OUT/bench_model_compiled.log" | grep -E "ms/step|compile_inner|compile_fx_inner|async_compile.wait" ;;
    model) timeout "$(left)" python3 benchmarks/bench_model.py --arms bf16 nvfp4 mxfp4 2>&1 | tee "$OUT/bench_model.log" | tail -4
           timeout "$(left)" python3 benchmarks/bench_model.py --model moe64 --batch 8 --seq 1024 --arms bf16 nvfp4 \
             --steps 10 2>&1 | tee "$OUT/bench_model_moe64.log" | tail -3 ;;
    sweep) timeout "$(left)" python3 benchmarks/sweep_quantize.py 2>&1 | tee "$OUT/sweep_quantize.log" | tail -45 ;;
    bench:*) name=${phase#bench:}  # benchmarks/bench_NAME.py; a "+" passes --compiled to bench_linear
         flag=""; [ "$name" = "linear+" ] && { name=linear; flag=--compiled; }
         [ "$(left)" -gt 30 ] || { echo "skipped: out of time"; continue; }
         timeout "$(left)" python3 "benchmarks/bench_$name.py" $flag 2>&1 | tee "$OUT/bench_${name}.log" | tail -25 ;;
    report) for dir in results/*/; do
              name=$(basename "$dir")
              ls "$dir" | grep -q -- "-seed" && python3 -m fp4lab study "$name" --report-only --out "$dir" 2>&1 \
                | grep -E "^\| .* \| (yes|no|partly|not run) \|"
            done ;;
    *) echo "unknown phase $phase" ;;
  esac
done
tar czf "$OUT/results.tgz" --exclude=checkpoint results benchmarks/results
ls -la "$OUT"
