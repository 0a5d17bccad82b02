"""How much does a kept rejected suffix know? ReTrace's premise, measured on training sequences the drafter never saw.

For every drafted block (anchor ``s``, drafts ``d_1..d_{B-1}``, ``n`` leading drafts accepted, first rejection at
slot ``r = n+1``) the kept suffix is ``d_j`` for ``j = r+1..B-1`` (or up to the adaptive cut). Its tokens are
compared with the committed tokens (the data: the target's own greedy answers) at the same position and at a shift
of -2..+2, grouped by where the first rejection fell; the target's own token read at a kept position (after the
wrong prefix) is shown beside it. "adaptive" keeps only the slots the drafter would have drafted under its
``draft_confidence_threshold`` (slot 1 always), as at inference.

The last table bounds what any use of the suffix can gain: the next block (anchor ``s' = s+n+1``, drafted by the
backbone alone, full block) is scored as it is and as an oracle would score it that, at every slot where a kept
token stands, takes the kept token whenever it is right. The oracle's accepted length over the backbone's is the
most a design that picks, slot by slot, between the backbone's draft and the aligned kept token could raise τ by
on these blocks; the shift-tolerant oracle also takes a kept token standing up to two slots away (the bound of a
shift-tolerant alignment).

    python examples/kept_suffix_signal.py --drafter hf_retrace/default_drafter --data ~/.cache/hf_retrace_runs/tok \
        --start 4000 --sequences 48 --markdown docs/retrace/kept-suffix-premise.md
"""

import argparse
from collections import defaultdict

import torch

import hf_retrace
from hf_retrace.loading import load_target
from hf_retrace.training.data import TokenizedDataset
from hf_retrace.training.features import collate_sequences
from hf_retrace.training.retrace_stage import ReTraceObjective

SHIFTS = (-2, -1, 0, 1, 2)
GROUPS = ("r=1", "r=2", "r=3", "r>=4", "all")

parser = argparse.ArgumentParser()
parser.add_argument("--drafter", required=True)
parser.add_argument("--data", required=True, help="tokenized folder (hf-retrace data tokenize)")
parser.add_argument("--target", default=None)
parser.add_argument("--start", type=int, default=4000, help="first sequence (pick ones the drafter never trained on)")
parser.add_argument("--sequences", type=int, default=48)
parser.add_argument("--num-anchors", type=int, default=16)
parser.add_argument("--threshold", type=float, default=None, help="adaptive cut (default: the drafter's own)")
parser.add_argument("--markdown", default=None, help="also write the tables here")
parser.add_argument("--seed", type=int, default=0, help="seeds the anchors drawn in every sequence")
args = parser.parse_args()
torch.manual_seed(args.seed)
target, _ = load_target(args.target, "fp32")
drafter = hf_retrace.ReTraceDrafter.from_pretrained(args.drafter, dtype=torch.float32)
threshold = args.threshold if args.threshold is not None else (drafter.config.draft_confidence_threshold or 0.0)
objective = ReTraceObjective(drafter, target, num_anchors=args.num_anchors)
data = TokenizedDataset(args.data)
block = drafter.config.block_size
slots = torch.arange(1, block)  # 1-based draft slots

# counts[mode][group]: blocks, blocks with a kept suffix, kept tokens, hits per shift, target-token hits
counts = {mode: defaultdict(lambda: defaultdict(int)) for mode in ("full block", "adaptive")}
# bound[mode]: next blocks, their tokens per round (accepted + 1) for the backbone and for the oracle, kept slots where
# the backbone's new draft is wrong, and how many of those the kept token gets right
bound = {mode: defaultdict(int) for mode in ("full block", "adaptive")}
for index in range(args.start, args.start + args.sequences):
    batch = collate_sequences([data[index]])
    with torch.no_grad():
        first = objective._first_pass(batch)
        hidden = first["drafter_hidden"]
        head = objective._draft_head(hidden.dtype, hidden.device)
        confidence = objective.drafter.compute_logits(hidden, head).softmax(-1).amax(-1)[0]
    ids, mask, lengths = batch["input_ids"], batch["loss_mask"], batch["attention_mask"].sum(1)
    anchors, valid_anchor = first["anchors"], first["anchor_valid"]
    shifted = {}
    for k in SHIFTS:
        labels, valid = objective.labels(ids, mask, lengths, (anchors + k).clamp(min=0), valid_anchor)
        shifted[k] = (labels[0], valid[0] & (anchors[0, :, None] + k >= 0))
    truth, truth_valid = shifted[0]
    drafts, accepted, target_tokens = first["drafts"][0], first["accepted"][0], first["target_tokens"][0]
    unconfident = (confidence < threshold) & (slots >= 2)
    cut = torch.where(unconfident.any(-1), unconfident.float().argmax(-1), torch.full_like(accepted, block - 1))
    # the next block of every block, drafted by the backbone alone at s' = s+n+1 (teacher-forced: at T=0 the committed
    # tokens are the data whatever was drafted)
    next_anchors = anchors + accepted[None] + 1
    with torch.no_grad():
        next_drafts, _, _ = objective.backbone_drafts(ids, first["features"], next_anchors.clamp(max=ids.shape[1] - 1),
                                                      valid_anchor)
    next_truth, next_valid = objective.labels(ids, mask, lengths, next_anchors, valid_anchor)
    next_drafts, next_truth, next_valid = next_drafts[0], next_truth[0], next_valid[0]
    for blk in range(drafts.shape[0]):
        if not valid_anchor[0, blk] or not truth_valid[blk, 0]:
            continue
        n = int(accepted[blk])
        r = n + 1
        group = "r=1" if r == 1 else "r=2" if r == 2 else "r=3" if r == 3 else "r>=4"
        for mode, last in (("full block", block - 1), ("adaptive", int(cut[blk]))):
            if r > last:  # every drafted slot accepted (or the rejection fell past the cut): nothing rejected kept
                kept_slots = []
            else:
                kept_slots = [j for j in range(r + 1, last + 1) if truth_valid[blk, j - 1]]
            if next_valid[blk].all():  # the next block lies inside the response: score it both ways
                shift = r  # kept slot j of this block is slot j - r of the next one
                right = next_drafts[blk] == next_truth[blk]
                oracle, shifted_oracle = right.clone(), right.clone()
                kept_tokens = {j - shift - 1: int(drafts[blk, j - 1]) for j in kept_slots}  # next-block slot -> d_j
                for i, token in kept_tokens.items():  # i: 0-based slot of the next block
                    kept_right = token == int(next_truth[blk, i])
                    if not right[i]:
                        bound[mode]["backbone wrong"] += 1
                        bound[mode]["kept right there"] += int(kept_right)
                    oracle[i] |= kept_right
                for i in range(len(right)):  # a shift-tolerant oracle: any kept token within two slots
                    near = [kept_tokens[i + k] for k in (-2, -1, 0, 1, 2) if i + k in kept_tokens]
                    shifted_oracle[i] |= int(next_truth[blk, i]) in near
                bound[mode]["blocks"] += 1
                bound[mode]["backbone tokens"] += int(right.long().cumprod(0).sum()) + 1
                bound[mode]["oracle tokens"] += int(oracle.long().cumprod(0).sum()) + 1
                bound[mode]["shifted oracle tokens"] += int(shifted_oracle.long().cumprod(0).sum()) + 1
            for g in (group, "all"):
                c = counts[mode][g]
                c["blocks"] += 1
                c["rejected"] += int(r <= last)
                c["with suffix"] += int(bool(kept_slots))
                for j in kept_slots:
                    c["kept"] += 1
                    c["target"] += int(target_tokens[blk, j - 1] == truth[blk, j - 1])
                    for k in SHIFTS:
                        labels, valid = shifted[k]
                        c[f"n{k}"] += int(valid[blk, j - 1])
                        c[f"hit{k}"] += int(valid[blk, j - 1] and drafts[blk, j - 1] == labels[blk, j - 1])

lines = [f"Drafter `{args.drafter}`, sequences {args.start}..{args.start + args.sequences - 1} of `{args.data}`, "
         f"{args.num_anchors} anchors each, adaptive threshold {threshold}. r = slot of the first rejection; a kept "
         "token d_j is compared with the committed token at position s+j+shift; t = the target's own token read at "
         "the kept position (after the wrong prefix).", ""]
for mode, table in counts.items():
    lines += [f"**{mode}**", "", "| first rejection | blocks | share | with kept suffix | kept tokens | "
              + " | ".join(f"d = committed @{k:+d}" for k in SHIFTS) + " | t = committed |",
              "|---|---|---|---|---|" + "---|" * (len(SHIFTS) + 1)]
    total = max(table["all"]["blocks"], 1)
    for g in GROUPS:
        c = table[g]
        kept = max(c["kept"], 1)
        cells = [f"{c[f'hit{k}'] / max(c[f'n{k}'], 1):.1%}" for k in SHIFTS]
        lines.append(f"| {g} | {c['blocks']} | {c['blocks'] / total:.0%} | {c['with suffix'] / max(c['blocks'], 1):.0%} "
                     f"| {c['kept']} | " + " | ".join(cells) + f" | {c['target'] / kept:.1%} |")
    lines.append("")
lines += ["**the most any use of the kept suffix can gain** (next block, full block, teacher-forced)", "",
          "| kept suffix | next blocks | τ of the backbone | τ of the oracle | ratio "
          "| τ of the shift-tolerant oracle (±2 slots) | ratio | kept slots where the backbone's new draft is wrong | kept token right there |",
          "|---|---|---|---|---|---|---|---|---|"]
for mode, c in bound.items():
    n, base = max(c["blocks"], 1), max(c["backbone tokens"], 1)
    lines.append(f"| {mode} | {c['blocks']} | {c['backbone tokens'] / n:.3f} | {c['oracle tokens'] / n:.3f} "
                 f"| {c['oracle tokens'] / base:.3f} | {c['shifted oracle tokens'] / n:.3f} "
                 f"| {c['shifted oracle tokens'] / base:.3f} | {c['backbone wrong']} "
                 f"| {c['kept right there'] / max(c['backbone wrong'], 1):.1%} |")
lines.append("")
print("\n".join(lines))
if args.markdown:
    with open(args.markdown, "w") as f:
        f.write("# ReTrace's premise: what a kept rejected suffix knows\n\n" + "\n".join(lines))
