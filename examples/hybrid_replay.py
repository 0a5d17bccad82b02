"""Choose the hybrid's lookup settings by replay: every rule walked over the target's own greedy answers to training
prompts (never dev or benchmark prompts), under measured costs (``hf_retrace.training.hybrid_replay``).

    python examples/hybrid_replay.py --data ~/.cache/hf_retrace_runs/tok --sequences 4900:4932 \
        --calibration ~/.cache/hf_retrace_runs/calibration-c2.json ~/.cache/hf_retrace_runs/calibration-c3.json \
        --records ~/.cache/hf_retrace_runs/replay-4900.json --markdown docs/speed/hybrid-replay.md

``--calibration``: JSON files written by ``hf-retrace calibrate --json`` (their ``draft_cost_c`` and ``verify_costs``;
each is one measurement of this machine's costs, and a rule should win under all of them). ``--records`` keeps the
teacher-forced drafts so a second run (another grid) skips the drafter passes.
"""

import argparse
import json
import os
import sys
from dataclasses import asdict

import torch

from hf_retrace.loading import load_drafter, load_target, portable_path
from hf_retrace.training.data import TokenizedDataset
from hf_retrace.training.hybrid_replay import AnswerRecord, record_answers, replay_hybrid

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--data", required=True, help="tokenized folder (hf-retrace data tokenize) of the target's answers")
parser.add_argument("--sequences", required=True, metavar="A:B", help="sequences no training stage saw")
parser.add_argument("--drafter", default=None, help="folder or Hub id (default: the shipped drafter)")
parser.add_argument("--target", default=None)
parser.add_argument("--calibration", nargs="+", required=True, help="hf-retrace calibrate --json outputs")
parser.add_argument("--records", default=None,
                    help="cache of the teacher-forced drafts (read if present, else written)")
parser.add_argument("--starts", default="1,2,3", help="lookup_start_tokens values")
parser.add_argument("--caps", default="4,6,8,10,16", help="lookup_num_tokens values")
parser.add_argument("--min-ngrams", default="2,3", help="lookup_min_ngram values")
parser.add_argument("--markdown", default=None)
args = parser.parse_args()

drafter = load_drafter(args.drafter, "fp32")
if args.records and os.path.exists(args.records):
    records = [AnswerRecord(**r) for r in json.load(open(args.records))]
else:
    first, last = (int(x) for x in args.sequences.split(":"))
    data = TokenizedDataset(args.data)
    if not 0 <= first < last <= len(data):
        sys.exit(f"--sequences {args.sequences}: the data has sequences 0..{len(data) - 1}")
    target, _ = load_target(args.target, "fp32")
    drafter.to(next(target.parameters()).device)
    records = []
    for i in range(first, last):
        records += record_answers(target, drafter, [data[i]])
        print(f"[hybrid-replay] sequence {i}: {len(records[-1].drafts)} anchors", file=sys.stderr, flush=True)
    if args.records:
        json.dump([asdict(r) for r in records], open(args.records, "w"))

config = drafter.config
calibrations = {os.path.basename(path): json.load(open(path)) for path in args.calibration}
rules = [("drafter alone", dict(lookup=False))]
for min_ngram in (int(x) for x in args.min_ngrams.split(",")):
    for start in (int(x) for x in args.starts.split(",")):
        for cap in (int(x) for x in args.caps.split(",")):
            if start <= cap:
                rules.append((f"lookup: min n-gram {min_ngram}, start {start}, cap {cap}",
                              dict(min_ngram=min_ngram, start_tokens=start, num_tokens=cap)))
rows = []
for name, rule in rules:
    row = {"rule": name}
    for label, cal in calibrations.items():
        result = replay_hybrid(records, threshold=config.draft_confidence_threshold, max_drafts=config.block_size - 1,
                               draft_cost=cal["draft_cost_c"], verify_costs=cal["verify_costs"],
                               max_ngram=config.lookup_max_ngram, **rule)
        row[label] = result
    rows.append(row)
shipped = (config.lookup_min_ngram, config.lookup_start_tokens, config.lookup_num_tokens)
lines = [f"{len(records)} answers (sequences {args.sequences}), {sum(len(r.drafts) for r in records)} anchors; "
         f"drafter threshold {config.draft_confidence_threshold}; the drafter's lookup settings (min n-gram, start, "
         f"cap): {shipped}. Tokens per plain-step cost, tau and lookup's share of rounds, under each cost measurement:",
         "", "| rule | " + " | ".join(f"{label}: tokens/cost, tau, lookup" for label in calibrations) + " |",
         "|---|" + "---|" * len(calibrations)]
for row in rows:
    cells = [f"{r['tokens_per_cost']:.3f}, {r['tau']:.2f}, {r['lookup_share']:.2f}"
             for r in (row[label] for label in calibrations)]
    lines.append(f"| {row['rule']} | " + " | ".join(cells) + " |")
for label in calibrations:
    best = max(rows, key=lambda row: row[label]["tokens_per_cost"])  # (calibrate breaks near-ties by tau: best_row)
    lines.append(f"\nbest under {label}: {best['rule']} ({best[label]['tokens_per_cost']:.3f} tokens per cost)")
text = "\n".join(lines)
print(text)
if args.markdown:
    with open(args.markdown, "a") as f:
        f.write(f"\n## `{' '.join(portable_path(a) for a in sys.argv[1:])}`\n\n" + text + "\n")
