"""Write the held-out training prompts a drafter's rounds are recorded on (``hf-retrace calibrate``).

8 GSM8K, 8 MATH and 8 ShareGPT training prompts that the shipped drafter never saw (not in the target-answer set it
was trained on), drawn with a fixed seed; never dev or benchmark prompts. With ``--prompts-dir`` (the prompt folder
of examples/make_drafter_data.sh) also 8 library-code problems, 8 ShareGPT code requests and 8 second turns, for a
drafter trained on those kinds; the kinds alternate, so the first prompts of the file (``--eval-limit``) mix them.
Training data must leave these ids out: ``hf-retrace data tokenize --exclude-ids THIS_FILE`` (a second turn's first
turn stays in; an excluded first turn takes its second turn with it).

    python examples/round_record_prompts.py --data DATA_DIR --out ~/.cache/hf_retrace_data/round-record-prompts.jsonl
    hf-retrace calibrate --target default --drafter hf_retrace/default_drafter \
        --prompts ~/.cache/hf_retrace_data/round-record-prompts.jsonl --limit 24 --max-new-tokens 128 --write
"""

import argparse
import json
import random
from pathlib import Path

SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
SOURCES = [("gsm8k-train.jsonl", "question", SUFFIX), ("math-train.jsonl", "problem", SUFFIX),
           ("sharegpt-prompts.jsonl", "prompt", "")]
NEW_KINDS = ["code-library.jsonl", "first-turns-code.jsonl", "second-turns.jsonl"]  # in --prompts-dir, as written


def text_length(record: dict) -> int:
    return sum(len(text) for text in [record.get("prompt", ""), *record.get("turns", []), *record.get("answers", [])])


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--data", required=True, help="the data folder holding train/ and target/")
parser.add_argument("--out", required=True)
parser.add_argument("--per-source", type=int, default=8)
parser.add_argument("--seed", type=int, default=20261202)
parser.add_argument("--prompts-dir", default=None, help="add the code and second-turn kinds from this prompt folder")
args = parser.parse_args()

data = Path(args.data)
trained_on = {json.loads(line)["id"] for line in open(data / "target" / "smollm2-135m-instruct-greedy.jsonl")}
rng = random.Random(args.seed)
kinds = []
for name, field, suffix in SOURCES:
    records = [json.loads(line) for line in open(data / "train" / name)]
    records = [r for r in records if r["id"] not in trained_on and len(r[field]) < 1200]
    kinds.append([{"id": r["id"], "prompt": r[field] + suffix} for r in rng.sample(records, args.per_source)])
for name in NEW_KINDS if args.prompts_dir else []:
    records = [json.loads(line) for line in open(Path(args.prompts_dir).expanduser() / name)]
    records = [r for r in records if r["id"] not in trained_on and text_length(r) < 1200 * (1 + ("turns" in r))]
    kinds.append(rng.sample(records, args.per_source))
out = [kind[i] for i in range(args.per_source) for kind in kinds]  # the kinds alternate
Path(args.out).expanduser().parent.mkdir(parents=True, exist_ok=True)
with open(Path(args.out).expanduser(), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in out)
print(f"{len(out)} prompts written to {args.out}: {[r['id'] for r in out]}")
