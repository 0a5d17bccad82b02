#!/usr/bin/env bash
# The benchmark behind the README's results: SmolLM2-135M-Instruct (bf16) with the shipped drafter on the four shipped
# dev subsets (8 prompts each, 128 new tokens), every method side by side in one process, both CPU cores.
# Run it alone on the machine (no training, tests or second benchmark): timings are wall-clock.
#
#   bash examples/bench_smollm2.sh            # T=0: plain, prompt lookup, the default (tuned), shipped constants, drafter
#   TEMPS=1 bash examples/bench_smollm2.sh    # T=1 (sampling): plain, prompt lookup, the default (tuned), shipped
#   GRID=1 LIMIT=4 bash examples/bench_smollm2.sh   # T=0: the default against the static grid (cut x lookup cap)
#
# The default is exactly what a user gets: the round policy tuned for this machine at first use (cached in
# ~/.cache/hf_retrace/policies; `hf-retrace tune` prints it). The warm-up call tunes before any timing.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
TEMPS=${TEMPS:-0}
mkdir -p "$OUT"
GRID_METHODS=plain,default,static-full-4,static-full-8,static-full-16,static-0.3-4,static-0.3-8,static-0.3-16,static-0.5-4,static-0.5-8,static-0.5-16,static-0.65-4,static-0.65-8,static-0.65-16
if [ "${GRID:-0}" = 1 ]; then
  METHODS=${METHODS:-$GRID_METHODS}
  TAG=grid-
elif [ "$TEMPS" = 0 ]; then
  METHODS=${METHODS:-plain,prompt-lookup,default,shipped,dflash}
else
  METHODS=${METHODS:-plain,prompt-lookup,default,shipped}
fi
hf-retrace bench --dataset gsm8k --dataset math500 --dataset humaneval --dataset mtbench \
  --methods "$METHODS" --temperature "$TEMPS" --max-new-tokens 128 --limit "${LIMIT:-8}" --seeds 0 \
  --dtype bf16 --threads 2 --json "$OUT/smollm2-${TAG:-}T$TEMPS.json" --markdown "$OUT/smollm2-${TAG:-}T$TEMPS.md" \
  --plots "$OUT/plots-${TAG:-}T$TEMPS" "$@"
