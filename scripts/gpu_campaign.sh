#!/usr/bin/env bash
# Training campaigns longer than one device call (10 min): the lent machine keeps ignored paths
# (runs/) while it stays warm, so one call starts the work in the background and the next calls
# wait on it, each bringing back what finished.
#   scripts/gpu_campaign.sh start NAME PHASE...   run the phases one after another, in the background
#                                                 (study phases need SCALE set in the same call)
#   scripts/gpu_campaign.sh wait [SECONDS]        wait until every campaign is done (or SECONDS pass),
#                                                 refreshing $OUT/runs.tgz every minute and at the end
#   scripts/gpu_campaign.sh collect               $OUT/runs.tgz: receipts, logs, sizes (never checkpoints)
# Phases:
#   corpus                  build the "code" corpus; its size and build time -> runs/gpu/corpus.json
#   receipts                copy every committed results/<study>/<run>/receipt.json to runs/gpu/<study>/<run>/,
#                           so the runner skips what is finished
#   reuse:FROM:TO:ARM,ARM   the same from study FROM's committed runs into study TO (same settings:
#                           e.g. fidelity's bf16 and nvfp4 for gap-closers); OLD=NEW serves FROM's arm OLD
#                           as TO's arm NEW (e.g. nvfp4=full: the runner keeps it only if it trained NEW's arithmetic)
#   study:NAME[:ARM,ARM][@N]
#                           fp4lab study NAME at $SCALE (default gpu-medium), N runs at once on each
#                           visible GPU (default $JOBS, else 3: graphed d6 runs hold ~20 GB each; on a
#                           host of several GPUs each run is pinned to one card, so one phase fills them
#                           all); finished runs are skipped, stopped ones resume from their
#                           checkpoint, and runs that ran out of memory beside others are retried with
#                           fewer at once; $SETS (space-separated KEY=VALUE) adds --set values that do not
#                           change a run's identity, e.g. SETS=deterministic=true, or SETS=cuda_graph=false
#                           (the GPU scales graph every run that allows it, dense or with BF16 experts: 2x a
#                           d6 run's tokens/s);
#                           $SEEDS (space-separated) runs only those seeds, e.g. SEEDS=0 to time one run
#                           Output: runs/gpu/NAME at gpu-medium, NAME-X at gpu-X (e.g.
#                           fidelity-stable), as results/ names them, so a scale never overwrites another's
#                           ($STUDY_DIR names another folder under runs/gpu, for every study phase of
#                           that campaign)
#   parallel:RECIPES:MODES  d6 at gpu-medium's settings, seed 0, under torchrun on every visible GPU, one
#                           run per recipe x mode (ddp, fsdp), all at once -> runs/gpu/ddp/ (issue 18:
#                           the same global batch as the 1-GPU fidelity runs, so seed 0 pairs with them)
#   sweep:MODEL:LRS:TOKENS[:TAG:KEY=VALUE,...]
#                           BF16 seed spread: MODEL at each learning rate (comma list), seeds 0 1 2,
#                           TOKENS million tokens each, $JOBS at once in all, on the first visible
#                           card (not spread like a study phase; the stable-baseline sweep);
#                           a TAG names a variant with extra --set values (e.g. qk:model.qk_norm=true;
#                           a batch_size among them keeps TOKENS, with fewer steps)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FP4LAB_CACHE=${FP4LAB_CACHE:-/tmp/fp4lab-cache} OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/out}
ROOT=${CAMPAIGN_ROOT:-runs/gpu}  # CAMPAIGN_ROOT=results: the reuse phase assembles committed results
mkdir -p "$ROOT"
source "$(dirname "$0")/quiet.sh"

sweep() {  # MODEL LRS TOKENS [TAG SETS]
  # the study scales' settings (catalog.py _D6, _D12), so a sweep run pairs with a study run
  local model=$1 lrs=$2 millions=$3 tag=${4:-} sets="" batch=64 seq=512 warmup=200 every=250 dir
  [ "$model" = d12 ] && { batch=32; seq=1024; warmup=150; every=125; }
  [ -n "${5:-}" ] && sets=$(printf -- '--set %s ' ${5//,/ })
  # a variant's own batch size keeps the token budget: the step count follows it
  local own=$(grep -o 'batch_size=[0-9]*' <<< "${5:-}" | cut -d= -f2)
  [ -n "$own" ] && batch=$own
  dir=$ROOT/sweep-$model${tag:+-$tag}
  local steps=$(( (millions * 1000000 + batch * seq - 1) / (batch * seq) ))  # rounded up, as the studies
  for lr in ${lrs//,/ }; do for seed in 0 1 2; do
    echo "--model $model --data code --recipe bf16 --steps $steps --set batch_size=$batch --set seq_len=$seq \
      --set lr=$lr --set warmup=$warmup --set eval_every=$every --set eval_batches=16 --set log_every=50 \
      --set seed=$seed --set recipe.seed=$seed --set progress=false \
      $sets--out $dir/${tag:+$tag-}lr$lr-seed$seed"
  done; done | xargs -P "${JOBS:-3}" -L 1 bash -c \
      'out=${@: -1}; [ -f "$out/receipt.json" ] || python3 -m fp4lab train "$@" 2>&1 | tail -1' _
  python3 -m fp4lab report "$dir"/*-seed* --out "$dir" --title "BF16 seed spread, $model ${tag:-}" \
    | grep -E "^\| " | head -20
}

parallel() {  # RECIPES MODES
  local recipe mode port=29600 out gpus
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
  for recipe in ${1//,/ }; do for mode in ${2//,/ }; do
    port=$((port + 1)); out=$ROOT/ddp/$recipe-$mode-${gpus}gpu-seed0
    [ -f "$out/receipt.json" ] && continue
    torchrun --nproc_per_node="$gpus" --master_port=$port -m fp4lab train --model d6 --data code \
      --recipe "$recipe" --steps 3052 --set vocab_size=8192 --set batch_size=64 --set seq_len=512 --set lr=2e-3 \
      --set warmup=200 --set eval_every=250 --set eval_batches=16 --set log_every=50 --set seed=0 \
      --set recipe.seed=0 --set parallel="$mode" --set progress=false --out "$out" 2>&1 | tail -2 &
  done; done
  wait
}

copy_receipts() {  # FROM TO [ARMS]: ARM or OLD=NEW (the run serves as arm NEW: the runner checks it
  local from=$1 to=$2 arms=${3:-} f run arm new dest   # trained NEW's arithmetic)
  for f in results/"$from"/*/receipt.json; do
    [ -f "$f" ] || continue
    run=$(basename "$(dirname "$f")"); arm=${run%-seed*}; new=$arm
    if [ -n "$arms" ]; then
      new=$(tr , '\n' <<< "$arms" | awk -F= -v a="$arm" '$1 == a { print ($2 == "" ? $1 : $2); exit }')
      [ -n "$new" ] || continue
    fi
    dest=$ROOT/$to/$new-seed${run##*-seed}
    [ -e "$dest/receipt.json" ] && continue  # never over a run already there
    mkdir -p "$dest"
    python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); r["name"] = sys.argv[2]
json.dump(r, open(sys.argv[3], "w"), indent=1)' "$f" "$(basename "$dest")" "$dest/receipt.json"
  done
  echo "$from -> $to: $(ls "$ROOT/$to"/*/receipt.json 2>/dev/null | wc -l) receipts"
}

collect() {  # receipts, logs, reports into $OUT/runs.tgz (never checkpoints), replaced whole
  find "$ROOT" \( -name receipt.json -o -name '*.log' -o -name '*.json' -o -name '*.md' \) \
    -not -path '*/checkpoint/*' | tar czf "$OUT/runs.tgz.part" -T - && mv "$OUT/runs.tgz.part" "$OUT/runs.tgz"
}

run_phases() {
  for phase in "$@"; do
    echo "== $phase $(date +%T)"
    case $phase in
      corpus) python3 scripts/corpus_size.py 2>&1 | quiet | tee "$ROOT/corpus.json" ;;
      receipts) for d in results/*/; do d=$(basename "$d"); ls results/"$d"/*/receipt.json >/dev/null 2>&1 \
                  && copy_receipts "$d" "$d"; done ;;
      reuse:*) IFS=: read -r _ from to arms <<< "$phase"; copy_receipts "$from" "$to" "$arms" ;;
      study:*) IFS=: read -r _ name arms <<< "${phase%@*}"
               jobs=${JOBS:-3}; [[ $phase == *@* ]] && jobs=${phase##*@}
               scale=${SCALE:-gpu-medium}; dir=$name; [ "$scale" = gpu-medium ] || dir=$name-${scale#gpu-}
               dir=${STUDY_DIR:-$dir}  # a campaign of its own may write elsewhere (e.g. a rerun's FP4-forward score)
               python3 -m fp4lab study "$name" --scale "$scale" --jobs "$jobs" --out "$ROOT/$dir" \
                 ${arms:+--arms ${arms//,/ }} ${SEEDS:+--seeds $SEEDS} ${SETS:+$(printf -- '--set %s ' $SETS)} 2>&1 \
                 | quiet | grep --line-buffered -v "^|" ;;
      parallel:*) IFS=: read -r _ recipes modes <<< "$phase"; parallel "$recipes" "$modes" ;;
      sweep:*) IFS=: read -r _ model lrs millions tag sets <<< "$phase"; sweep "$model" "$lrs" "$millions" "$tag" "$sets" ;;
      *) echo "unknown phase $phase" ;;
    esac
  done
  echo "== done $(date +%T)"
}

case ${1:-} in
  start) name=$2; shift 2
         # each device call is a fresh shell: a SCALE exported in an earlier call is gone, and a
         # study phase would run at the default gpu-medium unnoticed (the thirteenth session's
         # third call did); a campaign started in the background says its scale out loud
         if [[ " $* " == *" study:"* && -z "${SCALE:-}" ]]; then
           echo "refused: study phases need SCALE set in this call (SCALE=gpu-medium for the default)"; exit 2
         fi
         : > "$ROOT/$name.log"  # there before start returns: a wait right after sees it pending
         setsid nohup bash "$0" run "$@" > "$ROOT/$name.log" 2>&1 < /dev/null &
         echo "started $name${SCALE:+ at $SCALE}: $*" ;;
  run) shift; run_phases "$@" ;;
  wait) end=$(( $(date +%s) + ${2:-540} )) last=0
        # no campaign log here: the wrong folder (a call's `cd` put in a background job), not a
        # campaign to wait for; say so at once instead of waiting out the call
        ls "$ROOT"/*.log >/dev/null 2>&1 || { echo "no campaign under $PWD/$ROOT: nothing to wait for"; exit 1; }
        while [ "$(date +%s)" -lt "$end" ]; do
          pending=$(for f in "$ROOT"/*.log; do grep -q "^== done" "$f" || echo "$f"; done)
          [ -z "$pending" ] && break
          # a fresh $OUT/runs.tgz every minute: a call cut off by its time limit (or the device
          # budget) still brings back what had finished (the device returns $OUT on a timeout)
          if [ $(( $(date +%s) - last )) -ge 60 ]; then collect; last=$(date +%s); fi
          sleep 15
        done
        collect
        nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
        for f in "$ROOT"/*.log; do echo "-- $f"; tail -4 "$f"; done ;;
  collect) collect; ls -la "$OUT" ;;
  *) echo "usage: $0 start NAME PHASE... | wait [SECONDS] | collect"; exit 2 ;;
esac
