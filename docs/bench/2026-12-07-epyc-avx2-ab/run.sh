#!/usr/bin/env bash
# ABBA: the shipped two-layer drafter against the one-layer one before it (git archive 94f001c, PREVIOUS below), the
# default tuned at first use on a fresh policy cache each run, oneDNN, ATen and MKL capped to AVX2 (a CPU without bf16
# units, emulated). Run from the repository root, every other job stopped: bash docs/bench/2026-12-07-epyc-avx2-ab/run.sh
set -euo pipefail
OUT=${OUT:-avx2-ab}
PREVIOUS=$(mktemp -d)
git archive 94f001c hf_retrace/default_drafter | tar -x -C "$PREVIOUS"
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
target=${HF_RETRACE_CACHE:-$HOME/.cache/hf_retrace}/smollm2-135m-instruct  # converted once by any earlier use
i=0
for arm in two one one two; do
  i=$((i + 1))
  cache=$(mktemp -d)  # a fresh policy cache: each run tunes at its first use
  ln -s "$target" "$cache/"
  drafter=()
  [ "$arm" = one ] && drafter=(--drafter "$PREVIOUS/hf_retrace/default_drafter")
  echo "[avx2-ab] run $i ($arm) $(date -u +%H:%M:%S)"
  env ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 HF_RETRACE_CACHE="$cache" \
    hf-retrace bench --dataset gsm8k --dataset math500 --dataset humaneval --dataset mtbench --max-new-tokens 128 \
      --limit 8 --seeds 0 --dtype bf16 --threads 2 --methods plain,default --temperature 0 "${drafter[@]}" \
      --json "$OUT/run$i-$arm.json" --markdown "$OUT/run$i-$arm.md"
done
echo "[avx2-ab] done $(date -u +%H:%M:%S)"
