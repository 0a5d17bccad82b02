#!/usr/bin/env bash
# Drafters on the dev sets, each in its own process on a fresh policy cache (it tunes at its first use), back to back,
# then each paired by prompt against the shipped drafter's report (BASE). From the repository root, every other job
# stopped:
#   ARMS="taps8=~/.cache/hf_retrace_runs/shape-l2-b8-c4s8 taps5=~/.cache/hf_retrace_runs/shape-l2-b8-c4s5" \
#     bash docs/bench/2026-12-07-xeon-amx-shared-taps/run.sh
# ARMS: NAME=FOLDER pairs; the shipped drafter runs first, as `shipped`. FULL_BLOCK_ONLY=1 measures the drafters
# alone in full blocks only (tau, which does not depend on the machine's load); without it, plain decoding and the
# default (the tuned policy, as a user gets it) too. SHIPPED=0 leaves the shipped drafter's run out (its report kept).
set -euo pipefail
OUT=${OUT:-docs/bench/2026-12-07-xeon-amx-shared-taps}
methods=plain,plain-no-onednn,default,dflash-full-block
suffix=T0
[ -n "${FULL_BLOCK_ONLY:-}" ] && methods=dflash-full-block && suffix=T0-full-block
lscpu > "$OUT/lscpu.txt"
target=${HF_RETRACE_CACHE:-$HOME/.cache/hf_retrace}/smollm2-135m-instruct  # converted once by any earlier use
arms=()
[ "${SHIPPED:-1}" = 1 ] && arms+=(shipped=)
arms+=(${ARMS:-})
for arm in ${arms[@]+"${arms[@]}"}; do
  name=${arm%%=*} folder=${arm#*=}
  cache=$(mktemp -d)  # a fresh policy cache: each drafter tunes at its first use
  ln -s "$target" "$cache/"
  drafter=()
  [ -n "$folder" ] && drafter=(--drafter "${folder/#\~/$HOME}")
  echo "[bench] $name $(date -u +%H:%M:%S)"
  HF_RETRACE_CACHE="$cache" hf-retrace bench --dataset gsm8k --dataset math500 --dataset humaneval --dataset mtbench \
    --max-new-tokens 128 --limit 8 --seeds 0 --dtype bf16 --threads 2 --temperature 0 --methods "$methods" \
    "${drafter[@]}" --json "$OUT/$name-$suffix.json" --markdown "$OUT/$name-$suffix.md"
done
base=${BASE:-$OUT/shipped-T0.json}  # the shipped drafter's report (every method) that the arms pair against
for arm in ${ARMS:-}; do
  name=${arm%%=*}
  [ -f "$base" ] || { echo "[bench] no $base to pair $name against (run with SHIPPED=1 first)"; break; }
  for method in ${methods//,/ }; do
    case $method in plain*) continue ;; esac
    python examples/paired_tau.py "$OUT/$name-$suffix.json" "$base" --method "$method" \
      --json "$OUT/paired-$name-$method.json"
  done
done
echo "[bench] done $(date -u +%H:%M:%S)"
