"""τ of drafters on held-out prompts, by kind: the drafter alone, full blocks, no lookup (training's evaluation policy).

The prompt file's kinds alternate (examples/round_record_prompts.py --prompts-dir writes GSM8K, MATH, ShareGPT first
turns, library code, code requests, second turns, in turn), so prompt ``i`` is of kind ``i % len(--kinds)``.
``--vocab`` re-scores a drafter over another draft vocabulary first: ``own`` (as saved), ``full`` (none), or a
tokenized folder (its most frequent response tokens, as many as the drafter's own).

    python examples/tau_by_kind.py --drafter hf_retrace/default_drafter \
        --prompts ~/.cache/hf_retrace_data/round-record-prompts.jsonl --vocab own full ~/.cache/hf_retrace_runs/tok-breadth
"""

import argparse
import json

import torch

import hf_retrace
from hf_retrace.loading import load_target
from hf_retrace.training.data import read_prompts, records_token_ids
from hf_retrace.training.drafter_init import frequent_response_tokens
from hf_retrace.training.evaluation import TauEvaluator

KINDS = ["gsm8k", "math", "chat", "code-library", "code-request", "second-turn"]

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--drafter", nargs="+", required=True)
parser.add_argument("--prompts", required=True)
parser.add_argument("--kinds", nargs="+", default=KINDS)
parser.add_argument("--vocab", nargs="+", default=["own"], help="own | full | a tokenized folder")
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--dtype", default="fp32", help="the target's (fp32 is the faster on CPUs without bf16 units)")
parser.add_argument("--json", default=None)
args = parser.parse_args()

target, tokenizer = load_target(None, args.dtype)
ids = records_token_ids(tokenizer, read_prompts(args.prompts))
results = {}
for path in args.drafter:
    for vocab in args.vocab:
        drafter = hf_retrace.ReTraceDrafter.from_pretrained(path, dtype=torch.float32)
        if vocab == "full":
            drafter.draft_vocab = None
            drafter.config.draft_vocab_size = None
        elif vocab != "own":
            size = drafter.config.draft_vocab_size or target.config.get_text_config().vocab_size
            drafter.set_draft_vocab(frequent_response_tokens(vocab, size, target.config))
        row = {}
        for k, kind in enumerate(args.kinds):
            prompts = ids[k :: len(args.kinds)]
            row[kind] = round(TauEvaluator(target, prompts, max_new_tokens=args.max_new_tokens)(drafter)["tau"], 3)
        results[f"{path} [{vocab}]"] = row
        print(f"{path} [{vocab}]: " + ", ".join(f"{kind} {tau:.2f}" for kind, tau in row.items()), flush=True)
if args.json:
    with open(args.json, "w") as handle:
        json.dump(results, handle, indent=2)
