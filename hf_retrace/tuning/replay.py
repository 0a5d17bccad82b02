"""Replay a round policy over recorded answers: the generator's round rule, walked offline.

The walker asks the same :class:`~hf_retrace.generation.policy.RoundPolicy` methods the generator asks (lookup first
when an n-gram matches, within its budget; else the drafter's block cut by :meth:`RoundPolicy.cut`; the budget's
next value; the guard's back-off), so a replay and a real call agree round by round (``tests/test_tuning.py``).
Costs are the policy's: one-token target steps per round (:meth:`RoundPolicy.round_cost`).

Example::

    replay(records.greedy, policy, max_drafts=7)["tokens_per_cost"]   # > 1: faster than plain on this machine
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..generation.lookup import ContextLookup
from ..generation.policy import RoundPolicy
from .records import AnswerRecord

__all__ = ["accepted_prefix", "replay", "replay_rounds"]


def accepted_prefix(proposal: Sequence[int], tokens: Sequence[int], anchor: int) -> int:
    """How many of ``proposal`` (drafts for positions ``anchor + 1 ..``) the greedy answer ``tokens`` accepts: the
    matching prefix, up to the answer's end."""
    n, limit = 0, min(len(proposal), len(tokens) - anchor - 1)
    while n < limit and proposal[n] == tokens[anchor + 1 + n]:
        n += 1
    return n


def replay(answers: Sequence[AnswerRecord], policy: RoundPolicy, max_drafts: int,
           keep_rounds: bool = False) -> dict[str, Any]:
    """Walk every answer under ``policy`` as the generator would. Generation ends at the answer's end; like
    ``generate``, a round never drafts the answer's last token (no room for its bonus token). Plain steps (no room,
    or the guard's back-off) cost one step each."""
    tokens = cost = 0.0
    rounds = lookup_rounds = plain_steps = 0
    log: list[tuple[str, int, int]] = []
    for record in answers:
        seq, end = record.tokens, len(record.tokens)
        index = ContextLookup(policy.lookup_max_ngram) if policy.lookup else None
        budget = policy.first_lookup_budget()
        guard = policy.guard()
        p = record.start
        while p < end - 1:
            room = end - p - 2  # drafts that still leave a bonus token inside the answer
            if room <= 0 or not policy.speculate or (guard is not None and not guard.drafts_at(p)):
                tokens, cost, plain_steps, p = tokens + 1, cost + 1.0, plain_steps + 1, p + 1
                continue
            proposal, source = None, "drafter"
            if index is not None:
                index.extend(seq[len(index) : p + 1])
                matched, continuation = index.propose(min(budget, room), policy.lookup_min_ngram)
                if matched:
                    proposal, source = continuation, "lookup"
            if proposal is None:
                a = p - record.start
                k = min(policy.cut(record.confidences[a][:max_drafts]), max_drafts, room)
                proposal = record.drafts[a][:k]
            k = len(proposal)
            accepted = accepted_prefix(proposal, seq, p)
            if source == "lookup":
                budget = policy.next_lookup_budget(k, accepted)
                lookup_rounds += 1
            if guard is not None:
                guard.record(p, k, accepted, source == "lookup")
            tokens += accepted + 1
            cost += policy.round_cost(k, source == "lookup")
            rounds += 1
            if keep_rounds:
                log.append((source, k, accepted))
            p += accepted + 1
    result = {"tokens_per_cost": tokens / cost if cost else 0.0, "tau": (tokens - plain_steps) / max(rounds, 1),
              "lookup_share": lookup_rounds / max(rounds, 1), "rounds": rounds, "tokens": tokens,
              "plain_steps": plain_steps}
    if keep_rounds:
        result["round_log"] = log
    return result


def replay_rounds(rounds: Sequence[tuple[Sequence[float], int]], policy: RoundPolicy) -> dict[str, float]:
    """Tokens per step-cost had ``policy``'s cut shortened the recorded full-block ``(confidences, accepted)``
    rounds (no lookup, no guard): ``min(accepted, k) + 1`` tokens at the cost of ``k`` drafts."""
    tokens = cost = drafted = 0.0
    for confidences, accepted in rounds:
        k = policy.cut(confidences)
        tokens += min(accepted, k) + 1
        cost += policy.round_cost(k, False)
        drafted += k
    n = max(len(rounds), 1)
    return {"tau": tokens / n, "mean_drafted": drafted / n, "tokens_per_cost": tokens / cost if cost else 0.0,
            "rounds": len(rounds)}
