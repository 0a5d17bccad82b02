"""A learned probe of ReTrace's signal: does a small head predict the next block's tokens better when it also reads the
kept rejected suffix? (issue 37, step 1)

``examples/kept_suffix_signal.py --probe-cache FILE`` saves, for every slot of every next block it scores, the
backbone's state ``h`` there, the label, and the suffix's features aligned with the slot. Here two heads of the same
size are trained for the same steps on one cache and scored on another (held-out sequences):

- *without*: ``h' = h + MLP([h, slot])``, the suffix features zeroed;
- *with*: the same MLP reading ``[h, slot, suffix]``: the kept tokens aligned at the slot and one slot either side
  (their embeddings, whether verified, the target's agreement, the target's probability of its own token and of the
  kept one, the drafter's confidence there), the target's own token at the slot, and at the rejection point the
  target's probability and rank of the rejected draft.

Both score ``h'`` with the drafter's own (frozen) head over its draft vocabulary, so the last layer starts at zero
and both begin as the backbone. Reported: label cross-entropy and top-1 over held-out slots, and τ of the next blocks
drafted by each head's argmax (teacher-forced, as the oracles). The difference between the two heads is what the
suffix's features add to a learned drafter of this size; it is not a bound.

    python examples/retrace_probe.py --drafter hf_retrace/default_drafter --train train.pt --eval heldout.pt
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from torch import nn

HEADS = {
    "residual": "h + MLP([h, slot, suffix]) scored by the drafter's head (the suffix features zeroed without)",
    "candidates": "the backbone's scores + MLP bonuses on candidate tokens (its top-4; with: kept d at -1/0/+1, t)",
}
NEIGHBOURS = (-1, 0, 1)  # kept tokens read at the slot and one slot either side
PER_KEPT_SCALARS = 6  # present, verified, agree, target prob of t, target prob of d, drafter confidence


def suffix_features(rows: dict[str, torch.Tensor], embed: nn.Module) -> torch.Tensor:
    """``[blocks, B-1, F]`` the suffix's features at every slot of each next block (0 where no kept token stands)."""
    kept, slots = rows["kept"], rows["kept"].shape[-1]
    scale = embed.weight.float().std()  # token embeddings on the unit scale of the drafter's normed states
    parts = []
    for k in NEIGHBOURS:
        index = (torch.arange(slots) + k).clamp(0, slots - 1)
        inside = ((torch.arange(slots) + k >= 0) & (torch.arange(slots) + k < slots))[None]
        token = kept[:, index]
        present = (token >= 0) & inside
        verified = rows["kept_verified"][:, index] & present
        agree = verified & (token == rows["kept_target"][:, index])
        scalars = [present, verified, agree, rows["kept_target_prob"][:, index] * verified,
                   rows["kept_draft_prob"][:, index] * verified, rows["kept_confidence"][:, index] * present]
        parts.append(embed(token.clamp(min=0)).float() / scale * present[..., None])
        parts.append(torch.stack([s.float() for s in scalars], dim=-1))
    target = rows["kept_target"]
    parts.append(embed(target.clamp(min=0)).float() / scale * (target >= 0)[..., None])
    rejection = torch.stack([rows["rejected"].float(), rows["rejection_prob"].float() * rows["rejected"],
                             torch.log1p(rows["rejection_rank"].float()) / 10 * rows["rejected"]], dim=-1)
    parts.append(rejection[:, None].expand(-1, slots, -1))
    return torch.cat(parts, dim=-1)


class SlotProbe(nn.Module):
    """``h + MLP([h, slot one-hot, extra])``: a residual correction of the backbone's state, zero at the start."""

    def __init__(self, hidden_size: int, extra_size: int, slots: int, width: int):
        super().__init__()
        self.slots = slots
        self.net = nn.Sequential(nn.Linear(hidden_size + slots + extra_size, width), nn.SiLU(),
                                 nn.Linear(width, hidden_size))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, hidden: torch.Tensor, slot: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        one_hot = nn.functional.one_hot(slot, self.slots).to(hidden.dtype)
        return hidden + self.net(torch.cat([hidden, one_hot, extra], dim=-1))


class CandidateProbe(nn.Module):
    """``logits + bonus`` on a few candidate tokens per slot: the backbone's own top-4 and, with the suffix, the kept
    tokens at the slot and one either side and the target's own token there; each bonus is ``MLP(candidate's
    features)``. A learned picker with a few thousand weights: it cannot memorise the training slots."""

    def __init__(self, feature_size: int, width: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(feature_size, width), nn.SiLU(), nn.Linear(width, 1))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, logits: torch.Tensor, index: torch.Tensor, usable: torch.Tensor,
                features: torch.Tensor) -> torch.Tensor:
        bonus = self.net(features)[..., 0] * usable  # [R, C]
        return logits.scatter_add(-1, index, bonus)


def candidates(rows: dict[str, torch.Tensor], logits: torch.Tensor, drafter, vocab_size: int,
               use_suffix: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per slot row ``(index into the draft head [R, C], usable [R, C], features [R, C, F])`` of the candidates: the
    backbone's top-4 first, then (``use_suffix``; otherwise unusable and zero) the kept tokens at slot -1/0/+1 and t."""
    blocks, slots = rows["labels"].shape
    log_probs = logits.log_softmax(-1)
    own_logp, own = log_probs.topk(4, dim=-1)  # [R, 4]
    suffix_tokens, suffix_scalars = [], []
    for k in NEIGHBOURS:
        index = (torch.arange(slots) + k).clamp(0, slots - 1)
        inside = ((torch.arange(slots) + k >= 0) & (torch.arange(slots) + k < slots))[None]
        token = rows["kept"][:, index]
        present = (token >= 0) & inside
        verified = rows["kept_verified"][:, index] & present
        suffix_tokens.append(torch.where(present, token, -1))
        suffix_scalars.append(torch.stack([present, verified, verified & (token == rows["kept_target"][:, index]),
                                           rows["kept_target_prob"][:, index] * verified,
                                           rows["kept_draft_prob"][:, index] * verified,
                                           rows["kept_confidence"][:, index] * present], -1).float())
    suffix_tokens.append(rows["kept_target"])
    target_present = rows["kept_target"] >= 0
    suffix_scalars.append(torch.stack([target_present, target_present, target_present,
                                       rows["kept_target_prob"] * target_present, torch.zeros(blocks, slots),
                                       torch.zeros(blocks, slots)], -1).float())
    tokens = torch.stack(suffix_tokens, -1).reshape(blocks * slots, -1)  # [R, 4] target ids, -1: none
    index, in_vocab = drafter.draft_index(tokens.clamp(min=0), vocab_size)
    usable = torch.cat([torch.ones_like(own, dtype=torch.bool), in_vocab & (tokens >= 0) & use_suffix], -1)
    index = torch.cat([own, index], -1)
    c = index.shape[-1]
    source = torch.eye(c)[None].expand(len(index), -1, -1)  # which candidate it is (own rank k, or suffix source)
    candidate_logp = log_probs.gather(-1, index)
    scalars = torch.cat([torch.zeros(len(index), 4, PER_KEPT_SCALARS),
                         torch.stack(suffix_scalars, -2).reshape(blocks * slots, -1, PER_KEPT_SCALARS)], 1)
    rejection = torch.stack([rows["rejected"].float(), rows["rejection_prob"].float() * rows["rejected"],
                             torch.log1p(rows["rejection_rank"].float()) / 10 * rows["rejected"]], dim=-1)
    rejection = rejection[:, None].expand(-1, slots, -1).reshape(blocks * slots, 1, 3).expand(-1, c, -1)
    slot = nn.functional.one_hot(torch.arange(slots).repeat(blocks), slots).float()[:, None].expand(-1, c, -1)
    row = torch.stack([own_logp[:, 0], -(log_probs.exp() * log_probs).sum(-1)], -1)[:, None].expand(-1, c, -1)
    features = torch.cat([source, candidate_logp[..., None], row, slot, scalars, rejection * use_suffix], -1)
    return index, usable, features * usable[..., None]


def flatten(rows: dict[str, torch.Tensor], embed: nn.Module, drafter, head: tuple, vocab_size: int,
            use_suffix: bool) -> dict[str, torch.Tensor]:
    """Per slot rows: state, slot index, features (zeroed without the suffix), the backbone's scores and candidates,
    label index and whether it can be drafted at all (in the draft vocabulary)."""
    blocks, slots = rows["labels"].shape
    with torch.no_grad():
        extra = suffix_features(rows, embed)
    if not use_suffix:
        extra = torch.zeros_like(extra)
    label, in_vocab = drafter.draft_index(rows["labels"].reshape(-1), vocab_size)
    hidden = rows["hidden"].reshape(blocks * slots, -1).float()
    with torch.no_grad():  # the [rows, vocab] scores are recomputed per batch, never held for all rows
        chunks = [candidates({k: v[start:start + 512] for k, v in rows.items()},
                             drafter.compute_logits(hidden[start * slots:(start + 512) * slots], head),
                             drafter, vocab_size, use_suffix) for start in range(0, blocks, 512)]
    index, usable, features = (torch.cat(parts) for parts in zip(*chunks))
    return dict(hidden=hidden, slot=torch.arange(slots).repeat(blocks), extra=extra.reshape(blocks * slots, -1),
                index=index, usable=usable, features=features,
                label=label, in_vocab=in_vocab, blocks=torch.tensor(blocks), slots=torch.tensor(slots))


def probe_logits(probe: nn.Module | None, rows: dict[str, torch.Tensor], pick, head: tuple, drafter) -> torch.Tensor:
    """The head's scores over the draft vocabulary for rows ``pick`` (the backbone's own without a probe)."""
    if probe is None:
        return drafter.compute_logits(rows["hidden"][pick], head)
    if isinstance(probe, CandidateProbe):
        logits = drafter.compute_logits(rows["hidden"][pick], head)
        return probe(logits, rows["index"][pick], rows["usable"][pick], rows["features"][pick])
    return drafter.compute_logits(probe(rows["hidden"][pick], rows["slot"][pick], rows["extra"][pick]), head)


def train_probe(train: dict[str, torch.Tensor], head: tuple, drafter, width: int, steps: int, batch: int, lr: float,
                seed: int, kind: str = "residual") -> nn.Module:
    """``steps`` AdamW steps of label cross-entropy over random batches of the trainable rows (same order per seed)."""
    torch.manual_seed(seed)
    if kind == "candidates":
        probe = CandidateProbe(train["features"].shape[-1], width)
    else:
        probe = SlotProbe(train["hidden"].shape[-1], train["extra"].shape[-1], int(train["slots"]), width)
    optimizer = torch.optim.AdamW(probe.parameters(), lr=lr, weight_decay=0.01)
    usable = train["in_vocab"].nonzero()[:, 0]
    order = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        pick = usable[torch.randint(len(usable), (min(batch, len(usable)),), generator=order)]
        loss = nn.functional.cross_entropy(probe_logits(probe, train, pick, head, drafter), train["label"][pick])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return probe.eval()


@torch.no_grad()
def score(rows: dict[str, torch.Tensor], head: tuple, drafter, probe: nn.Module | None = None) -> dict[str, float]:
    """Held-out label cross-entropy and top-1 (draftable labels), and τ of the blocks drafted by the argmax."""
    from hf_retrace.stats import GenerationStats

    logits = probe_logits(probe, rows, slice(None), head, drafter)
    ok = rows["in_vocab"]
    ce = nn.functional.cross_entropy(logits[ok], rows["label"][ok]).item()
    right = (logits.argmax(-1) == rows["label"]) & ok
    per_block = right.reshape(int(rows["blocks"]), int(rows["slots"]))
    tau = GenerationStats(acceptance_lengths=(per_block.long().cumprod(-1).sum(-1) + 1).tolist())
    return dict(ce=ce, top1=right[ok].float().mean().item(), tau=tau.mean_acceptance_length)


def main(argv: Sequence[str] | None = None) -> int:
    import hf_retrace
    from hf_retrace.loading import load_target

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--target", default=None)
    parser.add_argument("--train", required=True, help="a --probe-cache of kept_suffix_signal.py (training sequences)")
    parser.add_argument("--eval", required=True, help="another one, of held-out sequences")
    parser.add_argument("--modes", nargs="*", default=None, help="round shapes to probe (default: every one cached)")
    parser.add_argument("--heads", nargs="*", default=list(HEADS), choices=list(HEADS),
                        help="which probes: " + "; ".join(f"{k}: {v}" for k, v in HEADS.items()))
    parser.add_argument("--width", type=int, default=64, help="the MLP's hidden width (with and without the suffix)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--markdown", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    train_cache, eval_cache = torch.load(args.train), torch.load(args.eval)
    modes = args.modes or [m for m in train_cache["rows"] if m in eval_cache["rows"]]
    missing = [m for m in modes if m not in train_cache["rows"] or m not in eval_cache["rows"]]
    if missing:
        sys.exit(f"mode(s) {missing} are not in both caches (train: {list(train_cache['rows'])}, eval: "
                 f"{list(eval_cache['rows'])}): rerun kept_suffix_signal.py with the same --thresholds for both.")
    target, _ = load_target(args.target, "fp32")
    drafter = hf_retrace.ReTraceDrafter.from_pretrained(args.drafter, dtype=torch.float32)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    head = tuple(None if t is None else t.detach().float() for t in drafter.draft_head(lm_head))
    vocab = lm_head.weight.shape[0]
    lines = [f"Probe: width {args.width}, {args.steps} steps of {args.batch} slots, lr {args.lr}, seed {args.seed}; "
             f"trained on `{args.train}` ({train_cache['data']}, sequences {train_cache['start']}.."
             f"{train_cache['start'] + train_cache['sequences'] - 1}), scored on `{args.eval}` ({eval_cache['data']}, "
             f"sequences {eval_cache['start']}..{eval_cache['start'] + eval_cache['sequences'] - 1}).", "",
             "| mode | train slots | held-out slots | head | CE | top-1 | τ (next block) | τ ratio to the backbone |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in modes:
        results = {}
        flat = {use: (flatten(train_cache["rows"][mode], embed, drafter, head, vocab, use),
                      flatten(eval_cache["rows"][mode], embed, drafter, head, vocab, use)) for use in (False, True)}
        train, held = flat[False]
        results["backbone"] = score(held, head, drafter)
        for kind in args.heads:
            for use_suffix in (False, True):
                train, held = flat[use_suffix]
                probe = train_probe(train, head, drafter, args.width, args.steps, args.batch, args.lr, args.seed, kind)
                results[f"{kind}, {'with' if use_suffix else 'without'} suffix"] = score(held, head, drafter, probe)
        base = results["backbone"]["tau"]
        for name, r in results.items():
            lines.append(f"| {mode} | {len(train['label'])} | {len(held['label'])} | {name} | {r['ce']:.3f} "
                         f"| {r['top1']:.1%} | {r['tau']:.3f} | {r['tau'] / base:.3f} |")
        for kind in args.heads:
            with_, without = results[f"{kind}, with suffix"], results[f"{kind}, without suffix"]
            lines.append(f"| {mode} | | | {kind}: with / without | {with_['ce'] - without['ce']:+.3f} "
                         f"| {with_['top1'] - without['top1']:+.1%} | | {with_['tau'] / without['tau']:.3f} |")
        print("\n".join(lines[-(2 + 3 * len(args.heads)):]), flush=True)
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
