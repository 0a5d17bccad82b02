#!/usr/bin/env bash
# The benchmark behind the README's results: SmolLM2-135M-Instruct (bf16) with the shipped drafter on the four shipped
# dev subsets (8 prompts each, 128 new tokens), every method side by side in one process, both CPU cores.
# Run it alone on the machine (no training, tests or second benchmark): timings are wall-clock.
#
#   bash examples/bench_smollm2.sh            # T=0: plain, prompt lookup, drafter (adaptive / full block), hybrid
#   TEMPS=1 bash examples/bench_smollm2.sh    # T=1 (sampling): plain, prompt lookup, drafter, hybrid
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
TEMPS=${TEMPS:-0}
mkdir -p "$OUT"
if [ "$TEMPS" = 0 ]; then
  METHODS=${METHODS:-plain,prompt-lookup,dflash,dflash-full-block,dflash+lookup}
else
  METHODS=${METHODS:-plain,prompt-lookup,dflash,dflash+lookup}
fi
hf-retrace bench --dataset gsm8k --dataset math500 --dataset humaneval --dataset mtbench \
  --methods "$METHODS" --temperature "$TEMPS" --max-new-tokens 128 --limit "${LIMIT:-8}" --seeds 0 \
  --dtype bf16 --threads 2 --json "$OUT/smollm2-T$TEMPS.json" --markdown "$OUT/smollm2-T$TEMPS.md" \
  --plots "$OUT/plots-T$TEMPS" "$@"
