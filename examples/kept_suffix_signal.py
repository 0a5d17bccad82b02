"""How much does a kept rejected suffix know? On training sequences, for the next block after each drafted block:
how often the kept rejected draft d, and the target's own token t read from the verification (after the wrong
prefix), equal the true token at each aligned slot. This decided ReTrace's refiner skip (d rather than t).

    python examples/kept_suffix_signal.py --drafter runs/smollm2-dflash/export --data work_data/smollm2-tokenized
"""

import argparse

import torch

import hf_retrace
from hf_retrace.cli import load_target
from hf_retrace.training.data import TokenizedDataset
from hf_retrace.training.features import collate_sequences
from hf_retrace.training.retrace_stage import ReTraceObjective

parser = argparse.ArgumentParser()
parser.add_argument("--drafter", required=True)
parser.add_argument("--data", required=True)
parser.add_argument("--target", default=None)
parser.add_argument("--start", type=int, default=4000)
parser.add_argument("--sequences", type=int, default=12)
args = parser.parse_args()
torch.set_num_threads(1)
target, _ = load_target(args.target, "bf16")
drafter = hf_retrace.ReTraceDrafter.from_pretrained(args.drafter, dtype=torch.bfloat16)
objective = ReTraceObjective(drafter, target, num_anchors=16)
data = TokenizedDataset(args.data)
slots = drafter.config.block_size - 1
total, hit_t, hit_d = torch.zeros(slots), torch.zeros(slots), torch.zeros(slots)
for index in range(args.start, args.start + args.sequences):
    batch = collate_sequences([data[index]])
    with torch.no_grad():
        first = objective._first_pass(batch)
        next_anchors, aligned = objective.align_next_block(first, slots + 1)
        labels, valid = objective.labels(batch["input_ids"], batch["loss_mask"], batch["attention_mask"].sum(1),
                                         next_anchors, first["anchor_valid"])
    labels, valid = labels.reshape(-1, slots), valid.reshape(-1, slots) & aligned.valid
    total += valid.sum(0)
    hit_t += ((aligned.target_tokens == labels) & valid).sum(0)
    hit_d += ((aligned.rejected_tokens == labels) & valid).sum(0)
print("new slot          ", list(range(1, slots + 1)))
print("P(t == true token)", [round(x, 2) for x in (hit_t / total.clamp(min=1)).tolist()])
print("P(d == true token)", [round(x, 2) for x in (hit_d / total.clamp(min=1)).tolist()])
print("aligned slots     ", [int(x) for x in total.tolist()])
