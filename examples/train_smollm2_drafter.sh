#!/usr/bin/env bash
# The exact commands of the real run behind the shipped drafter for SmolLM2-135M-Instruct, on a 2-core CPU.
# Trained on the target's own greedy answers to training prompts (never dev/); every step resumes after a kill.
#
#   HF_RETRACE_TARGET_ANSWERS=path/to/smollm2-135m-instruct-greedy.jsonl \
#     nohup bash examples/train_smollm2_drafter.sh all > ~/.cache/hf_retrace_runs/train.log 2>&1 &
#
# Work (tokenized data, features, checkpoints) goes to $HF_RETRACE_RUNS (default ~/.cache/hf_retrace_runs),
# outside the work tree. Steps: tokenize | features | backbone | export | calibrate | all, continue (the shipped
# drafter fine-tuned further; then export and calibrate with the same RUN), and retrace (the ReTrace
# module on the shipped, frozen backbone: docs/retrace/retrace-vs-backbone.md; not part of `all`, it ships off).
#
# The breadth drafter (issue 22: code and second turns beside math and first turns), on the answers of
# examples/make_drafter_data.sh in $HF_RETRACE_DATA (default ~/.cache/hf_retrace_data). The shipped drafter since
# 2026-12-05 is issue 36's: `shared-data`, `shape 2 8 4`, `breadth-data`, `shape-continue 2 8`, then
# `DRAFTER=$RUNS/shape-l2-b8-c2 ... breadth-calibrate` (2026-12-03 to 05: breadth-continue's, the one before it, whose
# breadth-data took 14,986 answers where the current machine had 8,002). On a 2-core Xeon with AMX it took: the answers
# 2 h 45 min (WORKERS=2), breadth-data ~35 min, the two runs side by side 77 min (THREADS=1 each), calibration 10 min:
#   breadth-tokens    the tokenization alone (no features: a GPU computes its own, examples/device_calls.sh)
#   breadth-data      tokenize the shipped answers, then the new ones, leaving out the prompts rounds are recorded
#                     on (round-record-prompts.jsonl, examples/round_record_prompts.py --prompts-dir); run it again
#                     as more answers arrive: the folder grows and the features keep their shards
#   breadth-continue  the shipped drafter fine-tuned on all of it (RUN=$RUNS/breadth-continue), its draft vocabulary
#                     re-selected from all of it (the shipped one covers 99.1 % of the shipped answers' response
#                     tokens but 91.3 % of the new ones'; the 8,960 most frequent of all: 97.5 % of the new)
#                     (INIT=folder to start elsewhere; the shipped drafter was continued from the one before it:
#                     `git archive f061c43 hf_retrace/default_drafter | tar -x -C /tmp`,
#                     INIT=/tmp/hf_retrace/default_drafter)
#   breadth-scratch   the same shape from scratch, the same steps (RUN=$RUNS/breadth-scratch)
#   breadth-calibrate DRAFTER=folder: its rounds recorded on the 48 held-out prompts of every kind (--write)
#   shape-continue    LAYERS BLOCK: issue 36 A/B winner trained on (after breadth-data), RUN=$RUNS/shape-lL-bB-c2
#   taps              IDS: one arm of issue 36's tapped-layer A/B (docs/drafter-shapes.md), the arms side by side:
#                     for ids in 1,8,14,20,27 2,15,27 29; do bash examples/train_smollm2_drafter.sh taps $ids & done
#   taps-continue     IDS: the shipped drafter continued on answers it never saw (fresh-tokens: rounds FRESH_FROM
#                     on), reading IDS (its five layers, or more through zero input columns)
#   breadth-heldout   the target's own answers to those 48 prompts, tokenized into $RUNS/tok-heldout: ReTrace's bound
#                     on them (examples/kept_suffix_signal.py --data $RUNS/tok-heldout --start 0 --sequences 48)
# Both evaluate tau on the round-record prompts (every kind) as they train. Run them one after the other with both
# cores, or side by side with THREADS=1 each (the same machine share for both: equal minutes are equal conditions);
# compare them at equal minutes with
# `python examples/plot_learning_curve.py RUN_A/train_log.jsonl RUN_B/train_log.jsonl --label continue scratch --x minutes`.
set -euo pipefail
cd "$(dirname "$0")/.."
STEP=${1:-all}
shift || true
RUNS=${HF_RETRACE_RUNS:-$HOME/.cache/hf_retrace_runs}
TOK=$RUNS/tok
FEATS=$RUNS/feats5
RUN=${RUN:-$RUNS/b8-l1-v8960}
SEQUENCES=${SEQUENCES:-2048}   # sequences trained on (the features of the first ones are enough to start)
DATA=${HF_RETRACE_DATA:-$HOME/.cache/hf_retrace_data}
BTOK=${BTOK:-$RUNS/tok-breadth}   # shape-continue on another tokenized folder (BTOK=$RUNS/tok-shared)
BFEATS=${BFEATS:-$RUNS/feats-breadth}   # BFEATS and BREADTH_TAPS name another store (stage 4: eight layers)
STOK=$RUNS/tok-shared
SFEATS=${SFEATS:-$RUNS/feats-shared}   # SFEATS and SHARED_TAPS likewise (stage 4 on the shipped answers alone)
mkdir -p "$RUNS"

tokenize() {
  : "${HF_RETRACE_TARGET_ANSWERS:?set it to the JSONL of the answers of the target (fields prompt, response)}"
  [ -f "$TOK/manifest.json" ] || hf-retrace data tokenize --target default \
      --responses "$HF_RETRACE_TARGET_ANSWERS" --out "$TOK" --max-length 1024
}
features() {
  # float32 forward (2.5x faster than bf16 on CPUs without bf16 units), bf16 on disk (5.8 KB a token).
  # Resumable per 256-sequence shard; training may start once the first SEQUENCES are covered.
  hf-retrace data features --target default --data "$TOK" --out "$FEATS" --target-layer-ids 1,8,14,20,27 \
      --dtype float32 --storage-dtype bfloat16 --max-batch-tokens 4096 "$@"
}
backbone() {
  # 1 layer, block 8, decay gamma 4, draft vocabulary = the 8,960 most frequent response tokens (99.0 % of them),
  # fp32 (no bf16 units on this CPU), both cores; tau on 16 held-out training sequences as it trains.
  hf-retrace train --stage backbone --target default --data "$TOK" --features-dir "$FEATS" \
      --max-sequences "$SEQUENCES" --holdout 16 --out "$RUN" --resume \
      --block-size 8 --num-layers 1 --target-layer-ids 1,8,14,20,27 --draft-vocab-size 8960 \
      --num-anchors 48 --gamma 4 --batch-size 2 --grad-accum 2 --lr 1e-3 --warmup-ratio 0.02 \
      --epochs "${EPOCHS:-8}" --num-threads 2 --seed 0 --target-dtype bfloat16 --save-dtype bfloat16 \
      --eval-every 500 --eval-limit 6 --eval-max-new-tokens 64 --save-every 200 --keep-checkpoints 2 "$@"
}
continue_run() {
  # a further stage: the shipped drafter fine-tuned on the first MAX_SEQUENCES training answers (the `features` step
  # may be stopped once their shards are on disk; the calibration sequences 4900:4932 always stay unseen) at a lower
  # peak rate. RUN names the new run. The stages run so far:
  #   stage 2 (shipped): RUN=$HF_RETRACE_RUNS/b8-l1-v8960-c2 (defaults: 3,584 answers, 3 epochs, lr 6e-4, seed 1)
  #   stage 3 (not shipped, README): RUN=$HF_RETRACE_RUNS/b8-l1-v8960-c3 MAX_SEQUENCES=4900 EPOCHS=2 LR=4e-4 SEED=2
  hf-retrace train --stage backbone --target default --data "$TOK" --features-dir "$FEATS" \
      --init-from hf_retrace/default_drafter --max-sequences "${MAX_SEQUENCES:-3584}" --holdout 16 --out "$RUN" \
      --resume --block-size 8 --num-anchors 48 --gamma 4 --batch-size 2 --grad-accum 2 --lr "${LR:-6e-4}" \
      --warmup-ratio 0.02 --epochs "${EPOCHS:-3}" --num-threads 2 --seed "${SEED:-1}" --target-dtype bfloat16 \
      --save-dtype bfloat16 --eval-every 1000 --eval-limit 6 --eval-max-new-tokens 64 --save-every 200 \
      --keep-checkpoints 2 "$@"
}
export_run() {
  # a run stopped before its last step: export its latest checkpoint as a from_pretrained folder
  python -c "from hf_retrace.training.checkpoints import export_checkpoint as e; e('$RUN', '$RUN/export')"
}
calibrate() {
  # the adaptive block's threshold, on training sequences the run never saw (its features stop at SEQUENCES)
  hf-retrace calibrate --target default --drafter "${DRAFTER:-$RUN/export}" --data "$TOK" --sequences 4900:4932 \
      --limit 24 --max-new-tokens 96 --num-threads 2 --json "$RUNS/calibration.json" --write "$@"
}
retrace() {
  # exact verification signals (one extra target forward per sequence), 16 anchors, float32 target (faster here);
  # first module: the first-stage backbone, out rt-frozen; second: RT_OUT=$HF_RETRACE_RUNS/rt-frozen-c2 (stage 2,
  # stopped at step 400 for a benchmark, then resumed to 560 by the same command; export_checkpoint exports a stopped run)
  hf-retrace train --stage retrace --target default --data "$TOK" --init-from hf_retrace/default_drafter \
      --out "${RT_OUT:-$RUNS/rt-frozen}" --resume --verification exact --num-anchors 16 --gamma 4 --batch-size 2 --grad-accum 2 \
      --lr 1e-3 --warmup-ratio 0.03 --max-steps 560 --max-sequences 3900 --holdout 16 --num-threads 2 --seed 0 \
      --target-dtype float32 --save-dtype bfloat16 --eval-every 280 --eval-limit 6 --eval-max-new-tokens 64 \
      --save-every 40 --keep-checkpoints 2 "$@"
}
breadth_tokens() {  # the tokenized answers alone (what a GPU lease carries: examples/device_calls.sh prepare-train)
  : "${HF_RETRACE_TARGET_ANSWERS:?set it to the JSONL of the shipped answers of the target}"
  local answers=("$DATA/responses")
  for extra in "$DATA"/responses-w*; do [ -d "$extra" ] && answers+=("$extra"); done  # WORKERS > 1 folders
  hf-retrace data tokenize --target default --responses "$HF_RETRACE_TARGET_ANSWERS" "${answers[@]}" --out "$BTOK" \
      --max-length 1024 --exclude-ids "$DATA/round-record-prompts.jsonl"
}
breadth_data() {
  breadth_tokens
  # --dtype auto: a bf16 forward on a CPU with bf16 units (3.8-4.5x fp32's speed on a Xeon with AMX), fp32 elsewhere
  hf-retrace data features --target default --data "$BTOK" --out "$BFEATS" \
      --target-layer-ids "${BREADTH_TAPS:-1,8,14,20,27}" --dtype auto --storage-dtype bfloat16 \
      --max-batch-tokens 4096 "$@"
}
precision_flags() {  # the training precision of this CPU, as train flags
  # On a CPU without bf16 units the target runs in float32 (its bf16 weights upcast exactly: the objective reads only
  # its embeddings and head, and its tau evaluations run 2-3x faster than in bf16, measured 4 vs 9 s a prompt) and the
  # drafter trains in fp32; on one with bf16 units (hf_retrace/machine.py) the target runs in bf16 and training uses
  # bf16 mixed precision (a step 0.48 vs 0.72 s in fp32 on a Xeon with AMX, one thread each, the same losses).
  if python -c "import sys; from hf_retrace.machine import has_bf16_units; sys.exit(not has_bf16_units())"; then
    echo "--target-dtype bfloat16 --bf16"
  else
    echo "--target-dtype float32"
  fi
}
breadth_run() {  # breadth_run RUN_NAME FLAGS...: the settings both runs share
  local name=$1 precision
  shift
  read -ra precision <<< "$(precision_flags)"
  hf-retrace train --stage backbone --target default --data "$BTOK" --features-dir "$BFEATS" --out "$RUNS/$name" \
      --resume --num-anchors 48 --gamma 4 --batch-size 2 --grad-accum 2 --warmup-ratio 0.02 \
      --epochs "${EPOCHS:-2}" --num-threads "${THREADS:-2}" "${precision[@]}" --save-dtype bfloat16 \
      --eval-prompts "$DATA/round-record-prompts.jsonl" --eval-every 1000 --eval-limit 12 --eval-max-new-tokens 64 \
      --save-every 200 --keep-checkpoints 2 "$@"
}
breadth_heldout() {
  hf-retrace data generate --target default --prompts "$DATA/round-record-prompts.jsonl" --out "$DATA/heldout-responses" \
      --max-new-tokens 256 "$@"
  hf-retrace data tokenize --target default --responses "$DATA/heldout-responses" --out "$RUNS/tok-heldout" \
      --max-length 1024
}
shared_data() {
  # issue 36's shape A/B: the 5,014 answers of \$SHARED_ANSWERS (the data folder's target/ file), the round-record
  # prompts left out, and their features (~10 min on a Xeon with AMX)
  : "${HF_RETRACE_TARGET_ANSWERS:?set it to the JSONL of the shipped answers of the target}"
  hf-retrace data tokenize --target default --responses "$HF_RETRACE_TARGET_ANSWERS" --out "$STOK" --max-length 1024 \
      --exclude-ids "$DATA/round-record-prompts.jsonl"
  hf-retrace data features --target default --data "$STOK" --out "$SFEATS" --target-layer-ids "${SHARED_TAPS:-1,8,14,20,27}" \
      --dtype auto --storage-dtype bfloat16 --max-batch-tokens 4096 "$@"
}
shape_run() {  # shape_run LAYERS BLOCK GAMMA FLAGS...: one arm of the shape A/B, from scratch, RUN=$RUNS/shape-lL-bB
  # DFlash's recipe where a CPU allows it (lr 6e-4, cosine after a 4 % warmup, grad clip 1.0, gamma 4 at block 8 and
  # 7 at block 16, the five evenly spaced tapped layers); 48 anchors a sequence (DFlash: 512), 3 epochs (DFlash: 6).
  # Run the arms side by side, THREADS=1 each, so equal minutes are equal conditions.
  local layers=$1 block=$2 gamma=$3 precision
  shift 3
  read -ra precision <<< "$(precision_flags)"
  hf-retrace train --stage backbone --target default --data "$STOK" --features-dir "$SFEATS" \
      --out "$RUNS/shape-l$layers-b$block" --resume --num-layers "$layers" --block-size "$block" --gamma "$gamma" \
      --target-layer-ids 1,8,14,20,27 --draft-vocab-size 8960 --num-anchors 48 --batch-size 2 --grad-accum 2 \
      --lr "${LR:-6e-4}" --warmup-ratio 0.04 --max-grad-norm 1.0 --epochs "${EPOCHS:-3}" --seed 0 \
      --num-threads "${THREADS:-1}" "${precision[@]}" --save-dtype bfloat16 \
      --eval-prompts "$DATA/round-record-prompts.jsonl" --eval-every "${EVAL_EVERY:-300}" --eval-limit 8 \
      --eval-max-new-tokens 64 --save-every 100 --keep-checkpoints 2 "$@"
}
shape_continue() {  # shape_continue LAYERS BLOCK FLAGS...: the A/B's winner trained on to the end of its curve
  # (RUN=$RUNS/shape-lL-bB-c2): initialized from its shape run, on breadth-data's answers (the shared 5,014 and
  # make_drafter_data.sh's), 2 more epochs, a lower peak rate whose cosine ends at 0, both cores; re-run after a kill.
  # INIT=folder starts from another drafter and NAME names the run (stage 3 of the shipped drafter, on 10,861 answers:
  # INIT=hf_retrace/default_drafter NAME=shape-l2-b8-c3 EPOCHS=0.8 ... shape-continue 2 8 --draft-vocab-size 8960;
  # measured, not shipped: docs/drafter-shapes.md; stage 4, on all 11,711 answers reading eight layers (2, 15 and
  # 29 added with zero input columns), after
  # `BFEATS=$RUNS/feats-breadth8 BREADTH_TAPS=1,2,8,14,15,20,27,29 ... breadth-data`:
  # the same BFEATS and INIT=hf_retrace/default_drafter NAME=shape-l2-b8-c4 EPOCHS=1 ... shape-continue 2 8
  # --draft-vocab-size 8960 --target-layer-ids 1,2,8,14,15,20,27,29 --max-minutes 40; its layers without its
  # answers, on the shipped 5,014 after `SFEATS=$RUNS/feats-shared8 SHARED_TAPS=1,2,8,14,15,20,27,29 ... shared-data`:
  # BTOK=$RUNS/tok-shared BFEATS=$RUNS/feats-shared8 INIT=hf_retrace/default_drafter NAME=shape-l2-b8-c4s8 EPOCHS=2
  # THREADS=1 ... shape-continue 2 8 --target-layer-ids IDS --max-minutes 40, arms side by side: docs/drafter-shapes.md;
  # stage 5, stage 4's answers read through five layers or eight, arms side by side on one store (`cp -al` of the
  # shipped answers' feats-shared8 keeps their shards): BFEATS=$RUNS/feats-breadth8 INIT=hf_retrace/default_drafter
  # NAME=shape-l2-b8-c5t5 (c5t8) EPOCHS=1 THREADS=1 ... shape-continue 2 8 --draft-vocab-size 8960 --target-layer-ids IDS
  # --max-minutes 40)
  local layers=$1 block=$2 precision
  shift 2
  read -ra precision <<< "$(precision_flags)"
  hf-retrace train --stage backbone --target default --data "$BTOK" --features-dir "$BFEATS" \
      --init-from "${INIT:-$RUNS/shape-l$layers-b$block}" --out "$RUNS/${NAME:-shape-l$layers-b$block-c2}" --resume \
      --num-anchors 48 --gamma "${GAMMA:-4}" --batch-size 2 --grad-accum 2 --lr "${LR:-3e-4}" --warmup-ratio 0.02 --max-grad-norm 1.0 \
      --epochs "${EPOCHS:-2}" --seed 1 --num-threads "${THREADS:-2}" "${precision[@]}" --save-dtype bfloat16 \
      --eval-prompts "$DATA/round-record-prompts.jsonl" --eval-every "${EVAL_EVERY:-500}" --eval-limit 8 \
      --eval-max-new-tokens 64 --save-every 100 --keep-checkpoints 2 "$@"
}
tap_run() {  # tap_run IDS FLAGS...: one arm of the tapped-layer A/B (issue 36, item 1), RUN=$RUNS/taps/l1-b8-IDS-sSTEPS
  # shape_run's recipe (1 layer, block 8, from scratch, seed 0: every arm sees the same sequences in the same order)
  # on the first TAP_SEQUENCES (2,000) breadth sequences for TAP_STEPS (700) steps; every arm reads its layers out of
  # one store of the union of the arms' layers (TAP_UNION), so the data's forward runs once for all of them
  local ids=$1 precision
  shift
  read -ra precision <<< "$(precision_flags)"
  hf-retrace data features --target default --data "$BTOK" --out "$RUNS/taps/feats" --limit "${TAP_SEQUENCES:-2000}" \
      --target-layer-ids "${TAP_UNION:-1,2,8,14,15,20,27,29}"
  hf-retrace train --stage backbone --target default --data "$BTOK" --features-dir "$RUNS/taps/feats" \
      --max-sequences "${TAP_SEQUENCES:-2000}" --out "$RUNS/taps/l1-b8-${ids//,/-}-s${TAP_STEPS:-700}" --resume \
      --num-layers 1 --block-size 8 --gamma 4 --target-layer-ids "$ids" --draft-vocab-size 8960 --num-anchors 48 \
      --batch-size 2 --grad-accum 2 --lr "${LR:-6e-4}" --warmup-ratio 0.04 --max-grad-norm 1.0 --epochs 10 \
      --max-steps "${TAP_STEPS:-700}" --seed 0 --num-threads "${THREADS:-1}" "${precision[@]}" --save-dtype bfloat16 \
      --eval-prompts "$DATA/round-record-prompts.jsonl" --eval-every "${EVAL_EVERY:-350}" --eval-limit 8 \
      --eval-max-new-tokens 64 --save-every 100 --keep-checkpoints 2 "$@"
}
fresh_tokens() {  # the answers of make_drafter_data.sh's rounds FRESH_FROM (5) on: ones the shipped drafter never saw
  # (its stage 2 took the first five rounds of the same prompt order; by that order, not checked: its prompt ids were
  # not kept); complete files only, tokenized into $RUNS/tok-fresh
  local files=() f n
  for f in "$DATA"/responses/responses-*.jsonl "$DATA"/responses-w*/responses-*.jsonl; do
    n=$(basename "$f" .jsonl)
    n=$((10#${n#responses-}))
    [ "$n" -ge "${FRESH_FROM:-5}" ] && files+=("$f")
  done
  hf-retrace data tokenize --target default --responses "${files[@]}" --out "$RUNS/tok-fresh" --max-length 1024 \
      --exclude-ids "$DATA/round-record-prompts.jsonl"
}
tap_continue() {  # tap_continue IDS FLAGS...: the shipped drafter continued on fresh answers reading target layers IDS
  # (its own five, or more: the new ones start with zero input columns), RUN=$RUNS/taps-continue/l2-b8-IDS: whether a
  # continued drafter gains from more of the target's depth (issue 36, docs/drafter-shapes.md); the arms side by side:
  # for ids in 1,8,14,20,27 1,2,8,14,15,20,27,29; do bash examples/train_smollm2_drafter.sh taps-continue $ids & done
  local ids=$1 precision
  shift
  read -ra precision <<< "$(precision_flags)"
  [ -f "$RUNS/tok-fresh/manifest.json" ] || fresh_tokens
  hf-retrace data features --target default --data "$RUNS/tok-fresh" --out "$RUNS/taps-continue/feats" \
      --limit "${TAP_SEQUENCES:-2000}" --target-layer-ids "${TAP_UNION:-1,2,8,14,15,20,27,29}" --storage-dtype bfloat16
  hf-retrace train --stage backbone --target default --data "$RUNS/tok-fresh" \
      --features-dir "$RUNS/taps-continue/feats" --max-sequences "${TAP_SEQUENCES:-2000}" \
      --init-from "${INIT:-hf_retrace/default_drafter}" --target-layer-ids "$ids" \
      --out "$RUNS/taps-continue/l2-b8-${ids//,/-}" --resume --num-anchors 48 --gamma 4 --batch-size 2 --grad-accum 2 \
      --lr "${LR:-3e-4}" --warmup-ratio 0.02 --max-grad-norm 1.0 --epochs "${EPOCHS:-2}" --seed 1 \
      --num-threads "${THREADS:-1}" "${precision[@]}" --save-dtype bfloat16 \
      --eval-prompts "$DATA/round-record-prompts.jsonl" --eval-every "${EVAL_EVERY:-250}" --eval-limit 8 \
      --eval-max-new-tokens 64 --save-every 100 --keep-checkpoints 2 "$@"
}
case "$STEP" in
  breadth-data) breadth_data "$@" ;;
  breadth-tokens) breadth_tokens ;;
  breadth-heldout) breadth_heldout "$@" ;;
  breadth-continue) breadth_run breadth-continue --init-from "${INIT:-hf_retrace/default_drafter}" --lr "${LR:-6e-4}" \
      --draft-vocab-size 8960 --seed 1 "$@" ;;
  breadth-scratch) breadth_run breadth-scratch --block-size 8 --num-layers 1 --target-layer-ids 1,8,14,20,27 \
      --draft-vocab-size 8960 --lr "${LR:-1e-3}" --seed 0 "$@" ;;
  breadth-calibrate) hf-retrace calibrate --target default --drafter "${DRAFTER:?set DRAFTER to the drafter folder}" \
      --prompts "$DATA/round-record-prompts.jsonl" --limit 48 --max-new-tokens 128 --num-threads 2 \
      --json "$RUNS/calibration-breadth.json" --write "$@" ;;
  shared-data) shared_data "$@" ;;
  shape) shape_run "$@" ;;
  shape-continue) shape_continue "$@" ;;
  taps) tap_run "$@" ;;
  fresh-tokens) fresh_tokens ;;
  taps-continue) tap_continue "$@" ;;
  tokenize) tokenize ;;
  features) features "$@" ;;
  backbone) backbone "$@" ;;
  continue) continue_run "$@" ;;
  export) export_run ;;
  calibrate) calibrate "$@" ;;
  retrace) retrace "$@" ;;
  all) tokenize; features --limit "$SEQUENCES"; backbone "$@"; export_run; calibrate ;;
  *) echo "unknown step $STEP (tokenize | features | backbone | continue | export | calibrate | all | retrace |" \
          "breadth-data | breadth-continue | breadth-scratch | breadth-calibrate | breadth-heldout | shared-data | shape |" \
          "shape-continue | taps | fresh-tokens | taps-continue)" >&2; exit 2 ;;
esac
