#!/usr/bin/env bash
# The exact command of the project's real run: a DFlash drafter (block 16, 3 layers, 5 tapped target layers) for the
# default target SmolLM2-135M-Instruct (bf16), trained on the target's own greedy answers
# (/work/shared/data/target/, tokenized into work_data/smollm2-tokenized by `hf-retrace data tokenize`), never on dev/.
# tau is measured by real generate on 30 held-out prompts from /work/shared/data/train (ids not used by the target
# data): work_data/eval-prompts-heldout.jsonl.
#
# Sized for the project's shared 2-core CPU machine (~45-60 min): features online (one pass over ~720 sequences does
# not pay back a 1.6M-token precompute), 1 torch thread (2 threads are ~4x slower when the CPU is oversubscribed).
# Resumable: run the same command again after a kill (--resume picks up the latest checkpoint in --out).
#
#   nohup bash examples/train_smollm2_drafter.sh > runs/smollm2-backbone/train.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/smollm2-backbone}
exec python -m hf_retrace.training.commands train \
  --target default \
  --data work_data/smollm2-tokenized \
  --out "$OUT" \
  --online --bf16 --target-dtype bfloat16 --save-dtype bfloat16 \
  --block-size 16 --num-layers 3 --num-target-features 5 \
  --num-anchors 32 --gamma 7 \
  --batch-size 1 --grad-accum 4 --lr 6e-4 --warmup-ratio 0.04 --max-grad-norm 1.0 \
  --max-steps 180 --seed 0 --num-threads 1 \
  --eval-prompts work_data/eval-prompts-heldout.jsonl --eval-every 60 --eval-limit 5 --eval-max-new-tokens 64 \
  --save-every 15 --keep-checkpoints 2 \
  --resume "$@"
