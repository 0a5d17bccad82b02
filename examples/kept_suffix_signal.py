"""How much does a kept rejected suffix know? ReTrace's bound, measured on sequences the drafter never saw (issue 37).

For every drafted block (anchor ``s``, drafts ``d_1..d_{B-1}``, ``n`` leading drafts accepted, first rejection at
slot ``r = n+1``) the kept suffix is ``d_j`` for ``j = r+1..B-1`` (or up to a confidence cut). Its tokens are compared
with the committed tokens (the data: the target's own greedy answers) at the same position and at a shift of -2..+2,
grouped by where the first rejection fell; the target's own token read at a kept position (after the wrong prefix) is
shown beside it. A "cut X" mode drafts slot 1, then each next slot while the drafter's top probability stays >= X, as
at inference; the slots past the cut were computed by the same block forward but never verified (the *tail*).

The bound: the next block (anchor ``s' = s + min(n, cut) + 1``, drafted by the backbone alone, teacher-forced: at T=0
the committed tokens are the data whatever was drafted) is scored as it is and as oracles would score it that, at a
slot holding candidates, take the right one whenever it is among them (:func:`oracle_right`):

- ``d`` at the same slot (the positional alignment ReTrace uses), within +-2 slots per slot, or the whole suffix
  moved by one shift per block (-1, 0, +1 alone, and the best of the three per block);
- ``d`` or the target's own token ``t_j``, or its top-3, at each verified kept slot (the verify pass computed them);
- the tail past the cut as extra ``d`` candidates (no target verdict there);
- the cascade: the oracle's corrections fed to the drafter as block input in place of MASK and the slots after the
  first one re-drafted by the same forward (:func:`redraft_with_tokens`; the block's slots attend to each other);
- controls without any suffix: the backbone's own top-2 and top-4 at every slot (what choosing alone is worth);
- negative information: where the new draft equals a kept token the target disagreed with (``agree = 0``), the
  drafter's second choice instead (a rule anyone can run) or only when right (its bound).

``--probe-cache FILE`` also saves, per next-block slot, the backbone's state and the suffix's features for
``examples/retrace_probe.py`` (a learned head with and without them, trained on one set of sequences, scored on
another).

    python examples/kept_suffix_signal.py --drafter hf_retrace/default_drafter \\
        --data ~/.cache/hf_retrace_runs/tok-heldout --start 0 --sequences 48 --thresholds 0.2 0.65 \\
        --markdown OUT.md --probe-cache heldout.pt
    python examples/kept_suffix_signal.py --drafter hf_retrace/default_drafter \\
        --records hf_retrace/default_drafter --start 0 --sequences 48     # its 48 recorded prompts, no data needed
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Sequence

import torch

SHIFTS = (-2, -1, 0, 1, 2)
BLOCK_SHIFTS = (-1, 0, 1)  # one shift for the whole kept suffix, chosen per block
GROUPS = ("r=1", "r=2", "r=3", "r>=4", "all")
TOP_K = 3  # the target's top-k kept at each verified kept slot

# the oracles of the bound table, in the order printed (name -> what it takes)
ORACLES = {
    "backbone": "the backbone's next block as drafted",
    "control: backbone's own top-2": "no suffix: the backbone's second choice too, at every slot (a picker's control)",
    "control: backbone's own top-4": "no suffix: its top-4 at every slot (as many candidates as d or top-3)",
    "d @0 (verified only)": "a kept verified d at the same slot (the figure docs/retrace/ reported before issue 37)",
    "d @+-2 per slot (verified only)": "any kept verified d within two slots (the former shift-tolerant figure)",
    "d @0": "kept d at the same slot, the tail past the cut included",
    "d @-1": "the whole suffix moved one slot earlier",
    "d @+1": "the whole suffix moved one slot later",
    "d, best shift per block": "the best of -1/0/+1 per block",
    "d or t @0": "d, or the target's own token t_j at a verified kept slot",
    "d or top-3 @0": "d, or any of the target's top-3 at a verified kept slot",
    "d or top-3, best shift per block": "the same, best of -1/0/+1 per block",
    "+ cascade (re-drafted)": "the last row's corrections fed as block input, the slots after the first re-drafted",
    "+ cascade, best of both per block": "per block the better of the last two rows",
    "veto rule (agree=0 -> 2nd choice)": "where the new draft equals a kept d with agree=0, the drafter's 2nd choice",
    "veto oracle (2nd choice when right)": "there, the 2nd choice only when it is right",
    "first wrong slot given, not re-drafted": "the truth at the backbone's first wrong slot, nothing else changed",
    "first wrong slot given, rest re-drafted": "the truth fed there as block input, the slots after it re-drafted",
}


def tokens_per_round(right: Sequence[bool]) -> int:
    """Tokens one round commits: the leading right drafts plus the target's own token (``GenerationStats``' unit)."""
    accepted = 0
    for ok in right:
        if not ok:
            break
        accepted += 1
    return accepted + 1


def shifted_candidates(kept: dict[int, set[int]], shift: int, slots: int) -> list[set[int]]:
    """Candidates per 0-based slot of the next block when every kept token (keyed by its aligned slot) moves by
    ``shift`` slots; tokens moved off the block are dropped."""
    out: list[set[int]] = [set() for _ in range(slots)]
    for slot, tokens in kept.items():
        if 0 <= slot + shift < slots:
            out[slot + shift] |= tokens
    return out


def near_candidates(kept: dict[int, set[int]], slots: int, reach: int = 2) -> list[set[int]]:
    """Candidates per slot: every kept token aligned within ``reach`` slots of it (a per-slot shift-tolerant oracle)."""
    out: list[set[int]] = [set() for _ in range(slots)]
    for shift in range(-reach, reach + 1):
        for slot, tokens in enumerate(shifted_candidates(kept, shift, slots)):
            out[slot] |= tokens
    return out


def oracle_right(right: Sequence[bool], truth: Sequence[int], candidates: Sequence[set[int]]) -> list[bool]:
    """Per slot: the draft is right, or the right token is among the slot's candidates (the oracle picks it)."""
    return [bool(ok) or int(token) in options for ok, token, options in zip(right, truth, candidates)]


def best_shift(right: Sequence[bool], truth: Sequence[int], kept: dict[int, set[int]],
               shifts: Sequence[int] = BLOCK_SHIFTS) -> tuple[int, list[bool]]:
    """The one shift of the whole suffix (first of ``shifts`` on a tie) whose oracle commits the most tokens."""
    scored = [(shift, oracle_right(right, truth, shifted_candidates(kept, shift, len(right)))) for shift in shifts]
    return max(scored, key=lambda pair: tokens_per_round(pair[1]))


def veto_right(right: Sequence[bool], drafts: Sequence[int], second: Sequence[int], truth: Sequence[int],
               vetoed: dict[int, set[int]], oracle: bool) -> list[bool]:
    """Negative information: at a slot whose draft is one of its ``vetoed`` tokens (kept tokens the target disagreed
    with), the drafter's second choice replaces it (``oracle``: only when that is right)."""
    out = []
    for slot, (ok, draft, alt, token) in enumerate(zip(right, drafts, second, truth)):
        if int(draft) in vetoed.get(slot, ()):
            alt_ok = int(alt) == int(token)
            ok = (bool(ok) or alt_ok) if oracle else alt_ok
        out.append(bool(ok))
    return out


def cascaded_right(right: Sequence[bool], redrafted_right: Sequence[bool], fed: Sequence[bool]) -> list[bool]:
    """The block a two-pass design proposes: the first pass's drafts before the first fed slot, the fed (right) tokens,
    and the second pass's re-drafts at the other slots after it."""
    if not any(fed):
        return [bool(ok) for ok in right]
    start = list(fed).index(True)
    return [bool(ok) if i < start else bool(given or again)
            for i, (ok, again, given) in enumerate(zip(right, redrafted_right, fed))]


@torch.no_grad()
def redraft_with_tokens(objective, input_ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor,
                        anchor_valid: torch.Tensor, fed: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The backbone's full block at every anchor, with ``fed`` tokens (``[b, N, B-1]`` target ids, -1 = MASK) as the
    block input at slots 1..B-1 where given, in place of MASK (as slot 0 holds the anchor token).

    The drafter never saw a token there in training: what this measures is how far a right token carries through the
    block's (bidirectional) attention in the architecture as trained. Returns the drafts, their states and the
    drafter's top-4 (``[b, N, B-1]`` / ``[b, N, B-1, H]`` / ``[b, N, B-1, 4]``).
    """
    drafter, block = objective.drafter, objective.block_size
    b, t = input_ids.shape
    embeds, position_ids, mask = objective.block_inputs(input_ids, anchors, anchor_valid, t)
    if fed is not None:
        embeds = embeds.reshape(b, anchors.shape[1], block, -1).clone()
        given = objective.frozen.input_embeddings(fed.clamp(min=0)).to(embeds.dtype)
        given = given * drafter.config.input_embedding_scale  # block_embeddings scales slot 0 the same way
        embeds[:, :, 1:] = torch.where(fed[..., None] >= 0, given, embeds[:, :, 1:])
        embeds = embeds.reshape(b, anchors.shape[1] * block, -1)
    hidden = drafter(target_hidden=features, noise_embedding=embeds, position_ids=position_ids, attention_mask=mask)
    hidden = hidden.reshape(b, anchors.shape[1], block, -1)[:, :, 1:]
    logits = drafter.compute_logits(hidden, objective._draft_head(hidden.dtype, hidden.device))
    top = drafter.draft_token_ids(logits.topk(4, dim=-1).indices)
    return dict(drafts=top[..., 0], top4=top, hidden=hidden, confidence=logits.softmax(-1).amax(-1))


def verdict_objective(drafter, target, num_anchors: int):
    """A :class:`ReTraceObjective` (exact verification) that also keeps, from its verify pass, the target's top-3 at
    each drafted slot and its probability and rank of each draft: what step 2 of issue 37 would keep."""
    from hf_retrace.training.retrace_stage import ReTraceObjective

    class VerdictObjective(ReTraceObjective):
        def _exact_verdict(self, input_ids, anchors, drafts, cache):
            logits, verify_features = super()._exact_verdict(input_ids, anchors, drafts, cache)
            probs = logits.float().softmax(-1)  # row j-1: the target at position s+j after d_1..d_{j-1}
            top = probs.topk(TOP_K, dim=-1)
            draft_probs = probs.gather(-1, drafts[..., None])[..., 0]
            self.verdict = dict(topk=top.indices, topk_probs=top.values, draft_probs=draft_probs,
                                draft_ranks=(probs > draft_probs[..., None]).sum(-1))
            return logits, verify_features

    return VerdictObjective(drafter, target, num_anchors=num_anchors, verification="exact")


def on_next_block(values: torch.Tensor, old_slots: Sequence[int | None], width: int, fill: float) -> torch.Tensor:
    """``[width]``: ``values`` of old slot ``j`` (1-based) at each next-block slot listed in ``old_slots`` (None or
    past the list: ``fill``)."""
    cells = [fill if j is None else values[j - 1].item() for j in old_slots]
    return torch.tensor(cells + [fill] * (width - len(cells)))


def mode_cuts(confidence: torch.Tensor, threshold: float, block: int) -> torch.Tensor:
    """``[N]`` last drafted slot per block under a confidence cut (slot 1 always; ``B-1`` when nothing falls below)."""
    slots = torch.arange(1, block, device=confidence.device)
    unconfident = (confidence < threshold) & (slots >= 2)
    full = torch.full(confidence.shape[:-1], block - 1, dtype=torch.long, device=confidence.device)
    return torch.where(unconfident.any(-1), unconfident.float().argmax(-1), full)


def measure_sequence(objective, batch: dict[str, torch.Tensor], thresholds: dict[str, float], counts: dict,
                     bound: dict, negative: dict, probe_rows: dict | None) -> None:
    """Adds one sequence's blocks to the agreement ``counts``, the oracles' ``bound`` (mode -> oracle -> list of
    tokens per round), the ``negative`` information counts and, when given, the probe's rows per mode."""
    block = objective.block_size
    with torch.no_grad():
        first = objective._first_pass(batch)
        head = objective._draft_head(first["drafter_hidden"].dtype, first["drafter_hidden"].device)
        confidence = objective.drafter.compute_logits(first["drafter_hidden"], head).softmax(-1).amax(-1)[0]
    verdict = {k: v[0] for k, v in objective.verdict.items()}
    ids, mask, lengths = batch["input_ids"], batch["loss_mask"], batch["attention_mask"].sum(1)
    anchors, valid_anchor, features = first["anchors"], first["anchor_valid"], first["features"]
    shifted = {}
    for k in SHIFTS:
        labels, valid = objective.labels(ids, mask, lengths, (anchors + k).clamp(min=0), valid_anchor)
        shifted[k] = (labels[0], valid[0] & (anchors[0, :, None] + k >= 0))
    truth, truth_valid = shifted[0]
    drafts, accepted, target_tokens = first["drafts"][0], first["accepted"][0], first["target_tokens"][0]
    agree = (drafts == target_tokens).tolist()
    for mode, threshold in thresholds.items():
        cut = mode_cuts(confidence, threshold, block)
        n_cut = torch.minimum(accepted, cut)  # the round commits at most the drafted slots (then the bonus)
        next_anchors = (anchors + n_cut[None] + 1)
        next_truth, next_valid = objective.labels(ids, mask, lengths, next_anchors, valid_anchor)
        next_anchors = next_anchors.clamp(max=ids.shape[1] - 1)
        plain = redraft_with_tokens(objective, ids, features, next_anchors, valid_anchor)
        blocks = []  # per block: (index, the top-3 oracle's rights) for the two cascades
        cascade_fed = torch.full_like(plain["drafts"], -1)
        first_wrong_fed = torch.full_like(plain["drafts"], -1)
        for blk in range(drafts.shape[0]):
            if not valid_anchor[0, blk] or not truth_valid[blk, 0]:
                continue
            n, last = int(accepted[blk]), int(cut[blk])
            r = n + 1
            group = "r=1" if r == 1 else "r=2" if r == 2 else "r=3" if r == 3 else "r>=4"
            kept_slots = [j for j in range(r + 1, last + 1) if truth_valid[blk, j - 1]] if r <= last else []
            for g in (group, "all"):
                c = counts[mode][g]
                c["blocks"] += 1
                c["with suffix"] += int(bool(kept_slots))
                for j in kept_slots:
                    c["kept"] += 1
                    c["target"] += int(target_tokens[blk, j - 1] == truth[blk, j - 1])
                    for k in SHIFTS:
                        labels, valid = shifted[k]
                        c[f"n{k}"] += int(valid[blk, j - 1])
                        c[f"hit{k}"] += int(valid[blk, j - 1] and drafts[blk, j - 1] == labels[blk, j - 1])
            if not next_valid[0, blk].all():  # the next block runs past the response: not scored
                continue
            first_kept = min(n, last) + 2  # slot n_cut+1 holds the target's correction or bonus: the next anchor
            verified = range(first_kept, last + 1)
            tail = range(max(first_kept, last + 1), block)
            aligned = {j: j - first_kept for j in (*verified, *tail)}  # old slot j -> 0-based slot of the next block
            d_verified = {aligned[j]: {int(drafts[blk, j - 1])} for j in verified}
            d_all = {aligned[j]: {int(drafts[blk, j - 1])} for j in (*verified, *tail)}
            with_t = {i: tokens | ({int(target_tokens[blk, j - 1])} if j in verified else set())
                      for j, i in aligned.items() for tokens in [d_all[i]]}
            with_top = {i: tokens | (set(verdict["topk"][blk, j - 1].tolist()) if j in verified else set())
                        for j, i in aligned.items() for tokens in [d_all[i]]}
            vetoed = {aligned[j]: {int(drafts[blk, j - 1])} for j in verified if not agree[blk][j - 1]}
            right = (plain["drafts"][0, blk] == next_truth[0, blk]).tolist()
            gold = next_truth[0, blk].tolist()
            width = len(right)
            score = bound[mode]
            score["backbone"].append(tokens_per_round(right))
            score["d @0 (verified only)"].append(tokens_per_round(
                oracle_right(right, gold, shifted_candidates(d_verified, 0, width))))
            score["d @+-2 per slot (verified only)"].append(tokens_per_round(
                oracle_right(right, gold, near_candidates(d_verified, width))))
            for shift, name in ((0, "d @0"), (-1, "d @-1"), (1, "d @+1")):
                score[name].append(tokens_per_round(oracle_right(right, gold, shifted_candidates(d_all, shift, width))))
            score["d, best shift per block"].append(tokens_per_round(best_shift(right, gold, d_all)[1]))
            score["d or t @0"].append(tokens_per_round(oracle_right(right, gold, shifted_candidates(with_t, 0, width))))
            score["d or top-3 @0"].append(tokens_per_round(
                oracle_right(right, gold, shifted_candidates(with_top, 0, width))))
            shift, top_right = best_shift(right, gold, with_top)
            score["d or top-3, best shift per block"].append(tokens_per_round(top_right))
            for i, options in enumerate(shifted_candidates(with_top, shift, width)):
                if not right[i] and gold[i] in options:  # a correction: fed to the second pass
                    cascade_fed[0, blk, i] = gold[i]
            if not all(right):
                first_wrong_fed[0, blk, right.index(False)] = gold[right.index(False)]
                fixed = list(right)
                fixed[right.index(False)] = True
                score["first wrong slot given, not re-drafted"].append(tokens_per_round(fixed))
            else:
                score["first wrong slot given, not re-drafted"].append(tokens_per_round(right))
            own = plain["top4"][0, blk].tolist()
            for k in (2, 4):
                score[f"control: backbone's own top-{k}"].append(tokens_per_round(
                    oracle_right(right, gold, [set(tokens[:k]) for tokens in own])))
            second = [tokens[1] for tokens in own]
            new_drafts = plain["drafts"][0, blk].tolist()
            for name, oracle in (("veto rule (agree=0 -> 2nd choice)", False),
                                 ("veto oracle (2nd choice when right)", True)):
                score[name].append(tokens_per_round(veto_right(right, new_drafts, second, gold, vetoed, oracle)))
            for i in range(width):  # how often a new draft equal to a kept d is right, by the target's agreement
                for j, slot in aligned.items():
                    if slot == i and j in verified and new_drafts[i] == int(drafts[blk, j - 1]):
                        key = "agree" if agree[blk][j - 1] else "disagree"
                        negative[mode][f"{key} slots"] += 1
                        negative[mode][f"{key} right"] += int(right[i])
            for i, j in ((aligned[j], j) for j in verified):
                if not right[i]:
                    negative[mode]["backbone wrong at a verified kept slot"] += 1
                    negative[mode]["kept d right there"] += int(int(drafts[blk, j - 1]) == gold[i])
            blocks.append((blk, top_right))
            if probe_rows is not None:
                rejection = min(r, block - 1)
                old_slots = sorted(aligned, key=aligned.get)  # next-block slots 0, 1, ... hold these old slots j
                verified_only = [j if j in verified else None for j in old_slots]
                probe_rows[mode].append(dict(
                    hidden=plain["hidden"][0, blk].half(), labels=next_truth[0, blk], drafts=plain["drafts"][0, blk],
                    kept=torch.tensor([next(iter(d_all.get(i, {-1}))) for i in range(width)]),
                    kept_verified=torch.tensor([i in d_verified for i in range(width)]),
                    kept_target=on_next_block(target_tokens[blk], verified_only, width, -1),
                    kept_target_prob=on_next_block(first["target_probs"][0, blk], verified_only, width, 0.0),
                    kept_draft_prob=on_next_block(verdict["draft_probs"][blk], verified_only, width, 0.0),
                    kept_confidence=on_next_block(confidence[blk], old_slots, width, 0.0),
                    rejected=torch.tensor(r <= last),
                    rejection_prob=verdict["draft_probs"][blk, rejection - 1].float(),
                    rejection_rank=verdict["draft_ranks"][blk, rejection - 1].float(),
                ))
        if not blocks:
            continue
        cascade = redraft_with_tokens(objective, ids, features, next_anchors, valid_anchor, cascade_fed)["drafts"][0]
        carried = redraft_with_tokens(objective, ids, features, next_anchors, valid_anchor,
                                      first_wrong_fed)["drafts"][0]
        for blk, top_right in blocks:
            gold = next_truth[0, blk]
            right = (plain["drafts"][0, blk] == gold).tolist()
            cascaded = cascaded_right(right, (cascade[blk] == gold).tolist(), (cascade_fed[0, blk] >= 0).tolist())
            bound[mode]["+ cascade (re-drafted)"].append(tokens_per_round(cascaded))
            bound[mode]["+ cascade, best of both per block"].append(
                max(tokens_per_round(cascaded), tokens_per_round(top_right)))
            given = cascaded_right(right, (carried[blk] == gold).tolist(), (first_wrong_fed[0, blk] >= 0).tolist())
            bound[mode]["first wrong slot given, rest re-drafted"].append(tokens_per_round(given))


def bound_table(bound: dict) -> list[str]:
    """The oracles' tau and ratio to the backbone per mode (tau from ``GenerationStats``, the one definition)."""
    from hf_retrace.stats import GenerationStats

    modes = list(bound)
    lines = ["| oracle (next block) | " + " | ".join(f"{m}: τ (ratio)" for m in modes) + " |",
             "|---|" + "---|" * len(modes)]
    for name in ORACLES:
        cells = []
        for mode in modes:
            tau = GenerationStats(acceptance_lengths=bound[mode][name]).mean_acceptance_length
            base = GenerationStats(acceptance_lengths=bound[mode]["backbone"]).mean_acceptance_length
            cells.append(f"{tau:.3f} ({tau / base:.3f})" if base else "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| next blocks scored | " + " | ".join(str(len(bound[m]["backbone"])) for m in modes) + " |")
    return lines


def records_as_sequences(folder_or_file: str) -> list[dict[str, torch.Tensor]]:
    """The greedy answers of a drafter's recorded rounds as training-style sequences: the prompt (no loss) and the
    target's own greedy tokens after it (recorded through a lossless round: the target's answer, up to bf16
    near-ties)."""
    from hf_retrace.tuning.records import RoundRecords

    sequences = []
    for answer in RoundRecords.load(folder_or_file).greedy:
        tokens = torch.tensor(answer.tokens, dtype=torch.long)
        sequences.append({"input_ids": tokens, "loss_mask": torch.arange(len(tokens)) >= answer.start})
    return sequences


def main(argv: Sequence[str] | None = None) -> int:
    import hf_retrace
    from hf_retrace.loading import load_target
    from hf_retrace.training.data import TokenizedDataset
    from hf_retrace.training.features import collate_sequences

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", required=True)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="tokenized folder (hf-retrace data tokenize)")
    source.add_argument("--records", help="a drafter folder (or its round_records.json.gz): the prompts its rounds "
                        "were recorded on, which its training left out, each with the target's greedy answer there")
    parser.add_argument("--target", default=None)
    parser.add_argument("--start", type=int, default=4000, help="first sequence (pick ones the drafter never trained on)")
    parser.add_argument("--sequences", type=int, default=48)
    parser.add_argument("--num-anchors", type=int, default=16)
    parser.add_argument("--thresholds", "--threshold", type=float, nargs="*", default=None,
                        help="confidence cuts measured beside full blocks (default: the drafter's own)")
    parser.add_argument("--markdown", default=None, help="also write the tables here")
    parser.add_argument("--probe-cache", default=None, help="save the probe's rows per mode here (torch.save)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the anchors drawn in every sequence")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads (1: stays polite on a shared CPU)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    source = args.data or args.records
    data = records_as_sequences(args.records) if args.records else TokenizedDataset(args.data)
    if args.start < 0 or args.start + args.sequences > len(data):
        sys.exit(f"--start {args.start} --sequences {args.sequences} runs past the {len(data)} sequences of "
                 f"{source}: lower one of them.")
    target, _ = load_target(args.target, "fp32")
    drafter = hf_retrace.ReTraceDrafter.from_pretrained(args.drafter, dtype=torch.float32)
    cuts = args.thresholds if args.thresholds is not None else [drafter.config.draft_confidence_threshold or 0.0]
    thresholds = {"full block": 0.0, **{f"cut {c:g}": c for c in cuts}}  # 0: no slot is ever cut
    objective = verdict_objective(drafter, target, args.num_anchors)
    counts = {mode: defaultdict(lambda: defaultdict(int)) for mode in thresholds}
    bound = {mode: defaultdict(list) for mode in thresholds}
    negative = {mode: defaultdict(int) for mode in thresholds}
    probe_rows = {mode: [] for mode in thresholds} if args.probe_cache else None
    began = time.time()
    for index in range(args.start, args.start + args.sequences):
        measure_sequence(objective, collate_sequences([data[index]]), thresholds, counts, bound, negative, probe_rows)
    lines = [f"Drafter `{args.drafter}`, sequences {args.start}..{args.start + args.sequences - 1} of `{source}`, "
             f"{args.num_anchors} anchors each (seed {args.seed}), fp32, {time.time() - began:.0f} s. r = slot of the "
             "first rejection; a kept token d_j is compared with the committed token at position s+j+shift; t = the "
             "target's own token read at the kept position (after the wrong prefix).", ""]
    for mode, table in counts.items():
        lines += [f"**{mode}**", "", "| first rejection | blocks | share | with kept suffix | kept tokens | "
                  + " | ".join(f"d = committed @{k:+d}" for k in SHIFTS) + " | t = committed |",
                  "|---|---|---|---|---|" + "---|" * (len(SHIFTS) + 1)]
        total = max(table["all"]["blocks"], 1)
        for g in GROUPS:
            c = table[g]
            cells = [f"{c[f'hit{k}'] / max(c[f'n{k}'], 1):.1%}" for k in SHIFTS]
            lines.append(f"| {g} | {c['blocks']} | {c['blocks'] / total:.0%} "
                         f"| {c['with suffix'] / max(c['blocks'], 1):.0%} | {c['kept']} | " + " | ".join(cells)
                         + f" | {c['target'] / max(c['kept'], 1):.1%} |")
        lines.append("")
    lines += ["**the most a use of the kept suffix can gain** (next block, teacher-forced; each row's τ and its ratio "
              "to the backbone's)", ""] + bound_table(bound) + [""]
    lines += [f"- **{name}**: {meaning}" for name, meaning in ORACLES.items()] + [""]
    lines += ["**negative information** (verified kept slots of the next block)", "",
              "| mode | new draft = kept d, target agreed: slots, right | new draft = kept d, target disagreed: slots, "
              "right | backbone wrong at a verified kept slot | kept d right there |", "|---|---|---|---|---|"]
    for mode, c in negative.items():
        lines.append(f"| {mode} | {c['agree slots']}, {c['agree right'] / max(c['agree slots'], 1):.1%} "
                     f"| {c['disagree slots']}, {c['disagree right'] / max(c['disagree slots'], 1):.1%} "
                     f"| {c['backbone wrong at a verified kept slot']} "
                     f"| {c['kept d right there'] / max(c['backbone wrong at a verified kept slot'], 1):.1%} |")
    lines.append("")
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("# ReTrace's bound: what a kept rejected suffix knows\n\n" + "\n".join(lines))
    if probe_rows is not None:
        torch.save({"drafter": args.drafter, "data": source, "start": args.start, "sequences": args.sequences,
                    "rows": {mode: {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
                             for mode, rows in probe_rows.items() if rows}}, args.probe_cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
