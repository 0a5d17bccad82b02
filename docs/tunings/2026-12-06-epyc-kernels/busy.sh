#!/usr/bin/env bash
# issue 41 goal 1 with the stand-in: five first-use tunings with one core kept busy, and two clean ones, fresh caches
cd "$(git rev-parse --show-toplevel)"
E=${OUT:-tunings}; mkdir -p $E
run() {
  rm -rf $E/c-$1; mkdir -p $E/c-$1; ln -s ~/.cache/hf_retrace/smollm2-135m-instruct $E/c-$1/smollm2-135m-instruct
  HF_RETRACE_CACHE=$E/c-$1 hf-retrace tune --json $E/tune-$1.json > $E/$1.log 2>&1
}
for i in 1 2 3 4 5; do python -c "while True: pass" & B=$!; sleep 2; run busy$i; kill $B; done
run clean1; run clean2
date -u
