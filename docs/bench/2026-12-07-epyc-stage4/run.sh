#!/usr/bin/env bash
# Stage 4 of the two-layer drafter (NEW, a folder) against the shipped one on the dev sets, each tuned at its first use on
# a fresh policy cache, back to back, then paired by prompt. Run from the repository root, every other job stopped:
#   NEW=~/.cache/hf_retrace_runs/shape-l2-b8-c4 bash docs/bench/2026-12-07-epyc-stage4/run.sh
# FULL_BLOCK_ONLY=1 measures the drafters alone in full blocks only (tau does not depend on the machine's load).
set -euo pipefail
: "${NEW:?set NEW to the folder of the new drafter}"
OUT=${OUT:-docs/bench/2026-12-07-epyc-stage4}
methods=plain,plain-no-onednn,default,dflash-full-block
[ -n "${FULL_BLOCK_ONLY:-}" ] && methods=dflash-full-block
lscpu > "$OUT/lscpu.txt"
target=${HF_RETRACE_CACHE:-$HOME/.cache/hf_retrace}/smollm2-135m-instruct  # converted once by any earlier use
for arm in new old; do
  cache=$(mktemp -d)  # a fresh policy cache: each drafter tunes at its first use
  ln -s "$target" "$cache/"
  drafter=()
  [ "$arm" = new ] && drafter=(--drafter "$NEW")
  echo "[stage4] $arm $(date -u +%H:%M:%S)"
  HF_RETRACE_CACHE="$cache" hf-retrace bench --dataset gsm8k --dataset math500 --dataset humaneval --dataset mtbench \
    --max-new-tokens 128 --limit 8 --seeds 0 --dtype bf16 --threads 2 --temperature 0 --methods "$methods" \
    "${drafter[@]}" --json "$OUT/$arm-T0.json" --markdown "$OUT/$arm-T0.md"
done
for method in ${methods//,/ }; do
  case $method in plain*) continue ;; esac
  python examples/paired_tau.py "$OUT/new-T0.json" "$OUT/old-T0.json" --method "$method" --json "$OUT/paired-$method.json"
done
echo "[stage4] done $(date -u +%H:%M:%S)"
