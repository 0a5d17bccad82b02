#!/usr/bin/env bash
# The benchmark reported in the README and the issues' closing notes: SmolLM2-135M-Instruct (bf16) with the shipped
# drafter, on the four shipped dev subsets, T=0 and T=1, every method side by side. Run it on an otherwise idle
# machine (timings are wall-clock).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
hf-retrace bench --dataset gsm8k --dataset math500 --dataset humaneval --dataset mtbench \
  --methods all --temperature 0 --temperature 1 --max-new-tokens 128 --limit "${LIMIT:-3}" --seeds 0 \
  --dtype bf16 --json "$OUT/smollm2.json" --markdown "$OUT/smollm2.md" --plots "$OUT/plots" "$@"
