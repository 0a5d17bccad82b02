#!/usr/bin/env bash
# The exact commands of the project's real runs for the default target SmolLM2-135M-Instruct (bf16), trained on the
# target's own greedy answers (/work/shared/data/target/, tokenized into work_data/smollm2-tokenized), never on dev/.
# tau is measured by real generate on held-out train prompts (work_data/eval-prompts-heldout.jsonl).
# Both stages are resumable: run the same command again after a kill.
#
#   nohup bash examples/train_smollm2_drafter.sh backbone > runs/smollm2-dflash/train.log 2>&1 &
#   nohup bash examples/train_smollm2_drafter.sh retrace  > runs/smollm2-retrace/train.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:-backbone}
shift || true
if [ ! -f work_data/smollm2-tokenized/manifest.json ]; then
  hf-retrace data tokenize --target default --responses /work/shared/data/target/smollm2-135m-instruct-greedy.jsonl \
    --out work_data/smollm2-tokenized --max-length 1024
fi
COMMON=(--target default --data work_data/smollm2-tokenized --bf16 --target-dtype bfloat16 --save-dtype bfloat16
        --eval-prompts work_data/eval-prompts-heldout.jsonl --eval-limit 5 --eval-max-new-tokens 64
        --keep-checkpoints 2 --resume)
if [ "$STAGE" = backbone ]; then
  # DFlash backbone: block 16, 3 layers, 5 tapped target layers, drafting over the 16384 most frequent response
  # tokens. Features online: on this 2-core CPU the target forward runs at ~1k tok/s, so one pass over more
  # sequences beats precomputing (25+ min for 1.6M tokens) and repeating fewer (--features-dir DIR does that).
  # One torch thread: with another process on the second core, two threads run 3-6x slower here.
  exec hf-retrace train --stage backbone --out runs/smollm2-dflash "${COMMON[@]}" --online \
    --block-size 16 --num-layers 3 --num-target-features 5 --draft-vocab-size 16384 \
    --num-anchors 32 --gamma 7 --batch-size 1 --grad-accum 2 --lr 6e-4 --warmup-ratio 0.04 \
    --epochs 0.5 --seed 0 --num-threads 1 --eval-every 200 --save-every 50 "$@"
else
  # The backbone run was cut at step 1000 of 1253 for time (the cosine tail) and exported first:
  #   python -c "from hf_retrace.training.trainer import export_checkpoint as e; \
  #              e('runs/smollm2-dflash', 'runs/smollm2-dflash/export')"
  # ReTrace: fusion module only, backbone frozen, exact verification signals.
  exec hf-retrace train --stage retrace --out runs/smollm2-retrace "${COMMON[@]}" \
    --init-from runs/smollm2-dflash/export --verification exact \
    --num-anchors 16 --gamma 7 --batch-size 1 --grad-accum 4 --lr 1e-3 --warmup-ratio 0.04 \
    --max-steps 160 --seed 1 --num-threads 1 --eval-every 0 --save-every 20 "$@"
fi
