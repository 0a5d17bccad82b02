"""Replay the hybrid's round rule offline: which source drafts each round (context lookup or the drafter), how far
the adaptive block drafts, and how lookup's budget grows, on the target's own greedy answers to training prompts.

At T=0 the committed tokens are the target's greedy answer whatever was proposed (lossless), and both sources are
path-independent: the drafter at anchor ``p`` reads the target's states of the positions before ``p`` and the token
at ``p``; the lookup index reads the tokens up to ``p``. So one teacher-forced pass over an answer records, for every
anchor, the drafter's full block and its top probabilities (:func:`record_answers`), and any rule is then a walk over
the answer (:func:`replay_hybrid`): a round at ``p`` commits its accepted drafts plus one token and the walk moves on.
Costs are in plain target steps: ``draft_cost`` per drafter round, ``lookup_cost`` per lookup round, and
``verify_costs[k]`` for verifying ``k`` drafts (as timed by :func:`~hf_retrace.training.calibrate.measure_verify_costs`).

Example::

    records = record_answers(target, drafter, [dataset[i] for i in range(4900, 4932)])
    replay_hybrid(records, threshold=0.7, lookup=True, start_tokens=1, num_tokens=6, max_drafts=7,
                  draft_cost=0.19, verify_costs=costs)["tokens_per_cost"]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..generation.candidate_generator import confident_prefix
from ..generation.lookup import ContextLookup, first_lookup_budget, next_lookup_budget
from .calibrate import verify_cost
from .features import collate_sequences, tapped_hidden_states
from .objective import DFlashObjective

__all__ = ["AnswerRecord", "record_answers", "replay_hybrid"]


@dataclass
class AnswerRecord:
    """One answer: ``tokens`` (prompt + answer), the first anchor ``start`` (the answer's first token, which the
    prefill commits), and per anchor ``start .. len(tokens) - 2`` the drafter's full block and top probabilities."""

    tokens: list[int]
    start: int
    drafts: list[list[int]]
    confidences: list[list[float]]


@torch.no_grad()
def record_answers(target: Any, drafter: Any, sequences: Iterable[dict[str, torch.Tensor]],
                   anchors_per_pass: int = 96) -> list[AnswerRecord]:
    """Teacher-forced drafts at every anchor of each answer (items of a tokenized dataset: ``input_ids``,
    ``loss_mask``; the answer is the loss-masked part)."""
    objective = DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings())
    device = next(drafter.parameters()).device
    records = []
    for item in sequences:
        batch = collate_sequences([item])
        length = int(batch["attention_mask"].sum())
        ids = batch["input_ids"][:, :length].to(device)
        answer = batch["loss_mask"][0, :length].nonzero()
        if len(answer) == 0 or int(answer[0]) >= length - 1:
            continue  # no answer token to draft after
        start = int(answer[0])
        features = tapped_hidden_states(target, ids, None, drafter.config.target_layer_ids).to(drafter.dtype)
        drafts, confidences = [], []
        for chunk in torch.arange(start, length - 1, device=device).split(anchors_per_pass):
            anchors = chunk[None]
            d, _, top = objective.backbone_drafts(ids, features, anchors, torch.ones_like(anchors, dtype=torch.bool))
            drafts += d[0].tolist()
            confidences += top[0].tolist()
        records.append(AnswerRecord(ids[0].tolist(), start, drafts, confidences))
    return records


def _accepted(proposal: Sequence[int], tokens: Sequence[int], anchor: int) -> int:
    n = 0
    while n < len(proposal) and proposal[n] == tokens[anchor + 1 + n]:
        n += 1
    return n


def replay_hybrid(records: Sequence[AnswerRecord], *, threshold: float | None, max_drafts: int, draft_cost: float,
                  verify_costs: Sequence[float], lookup: bool = True, min_ngram: int = 2, max_ngram: int = 4,
                  start_tokens: int = 2, num_tokens: int = 10, lookup_cost: float = 0.01,
                  keep_rounds: bool = False) -> dict[str, Any]:
    """Walk every answer under one rule, as the generator would: lookup first when an n-gram matches (with its
    budget), else the drafter's confident prefix (``threshold``; ``None``: full blocks). Generation ends at the
    answer's end; like ``generate``, a round never drafts the answer's last token (no room for its bonus token)."""
    tokens = cost = 0.0
    rounds = lookup_rounds = plain_steps = 0
    log: list[tuple[str, int, int]] = []
    for record in records:
        seq, end = record.tokens, len(record.tokens)
        index = ContextLookup(max_ngram) if lookup else None
        budget = first_lookup_budget(start_tokens, num_tokens)
        p = record.start
        while p < end - 1:
            room = end - p - 2  # drafts that still leave a bonus token inside the answer
            if room <= 0:  # the target steps alone
                tokens, cost, plain_steps, p = tokens + 1, cost + 1.0, plain_steps + 1, p + 1
                continue
            proposal, source = None, "drafter"
            if index is not None:
                index.extend(seq[len(index) : p + 1])
                matched, continuation = index.propose(min(budget, room), min_ngram)
                if matched:
                    proposal, source = continuation, "lookup"
            if proposal is None:
                a = p - record.start
                k = min(confident_prefix(record.confidences[a], threshold), max_drafts, room)
                proposal = record.drafts[a][:k]
            k = len(proposal)
            accepted = _accepted(proposal, seq, p)
            if source == "lookup":
                budget = next_lookup_budget(k, accepted, start_tokens, num_tokens)
                lookup_rounds += 1
            tokens += accepted + 1
            cost += (lookup_cost if source == "lookup" else draft_cost) + verify_cost(verify_costs, k)
            rounds += 1
            if keep_rounds:
                log.append((source, k, accepted))
            p += accepted + 1
    result = {"tokens_per_cost": tokens / cost if cost else 0.0, "tau": (tokens - plain_steps) / max(rounds, 1),
              "lookup_share": lookup_rounds / max(rounds, 1), "rounds": rounds, "tokens": tokens}
    if keep_rounds:
        result["round_log"] = log
    return result
