"""Replay a round policy over recorded answers: the generator's own :class:`~hf_retrace.generation.round.Round`,
walked offline with a source that replays the drafter's recorded blocks.

The round is the generator's (guard, context lookup first within its budget, else the drafter's block cut by
:meth:`RoundPolicy.cut`; every verdict observed), so a replay and a real call agree round by round
(``tests/test_tuning.py``). The verdict is the recorded greedy answer's; costs are the policy's: one-token target
steps per round (:meth:`RoundPolicy.round_cost`).

A batch of ``rows`` rows (:func:`lockstep_cost`) runs its rows' rounds together, as the batch loop does: the
recorded answers are taken ``rows`` at a time, each row walks its own rounds, and round ``r`` of the batch costs the
drafter once plus the verify of its widest row still running; the batch lasts as long as its slowest row, and plain
batched decoding as long as its longest answer. Pooling every row's rounds instead (a round's width drawn from all of
them, :func:`batch_round_cost`) ignores that a batch's rows differ (the shipped drafter's recorded prompts take 18 to
89 rounds for 28 to 128 tokens) and that the slowest sets the time: with no credit for rows finishing early, the
lockstep figure read 22 % under the pooled one at 4 and at 8 rows on an EPYC (docs/design/batching.md).

Example::

    replay(records.greedy, policy, max_drafts=7)["tokens_per_cost"]   # > 1: faster than plain on this machine
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..generation.lookup_source import LookupSource
from ..generation.policy import RoundPolicy, verify_cost
from ..generation.proposal import Proposal, RoundInputs, Verdict
from ..generation.round import Round
from ..stats import GenerationStats
from .records import AnswerRecord

__all__ = ["RecordedDrafts", "accepted_prefix", "batch_round_cost", "lockstep_cost", "replay", "replay_rounds"]


def accepted_prefix(proposal: Sequence[int], tokens: Sequence[int], anchor: int) -> int:
    """How many of ``proposal`` (drafts for positions ``anchor + 1 ..``) the greedy answer ``tokens`` accepts: the
    matching prefix, up to the answer's end."""
    n, limit = 0, min(len(proposal), len(tokens) - anchor - 1)
    while n < limit and proposal[n] == tokens[anchor + 1 + n]:
        n += 1
    return n


class RecordedDrafts:
    """The drafter as a proposal source, replayed: the full block recorded at each position of one answer, cut by the
    policy (the drafter's confidences were recorded with it)."""

    name = "drafter"

    def __init__(self, record: AnswerRecord, policy: RoundPolicy, max_drafts: int):
        self.record, self.policy, self.max_drafts = record, policy, max_drafts

    def propose(self, inputs: RoundInputs) -> Proposal:
        at = inputs.anchor - self.record.start
        k = min(self.policy.cut(self.record.confidences[at][: self.max_drafts]), self.max_drafts, inputs.room)
        drafts = list(self.record.drafts[at][:k])
        return Proposal(self.name, inputs.anchor, drafts, drafts)

    def observe(self, proposal: Proposal, verdict: Verdict) -> None:
        """Recorded blocks do not depend on earlier verdicts."""


def batch_round_cost(policy: RoundPolicy, drafted: Sequence[int], rows: int) -> float:
    """The expected cost, in ``rows``-row steps, of one round of a batch whose rows draft as many tokens as rounds
    drawn at random from ``drafted`` (0: a plain step): the drafter's forward once for every row (the batch loop
    drafts each row's block every round) and the verify of the widest row,
    ``sum_k verify_cost(k) * (F(k)^rows - F(k-1)^rows)`` with ``F`` the share of rounds drafting at most ``k``."""
    counts, total = Counter(drafted), len(drafted)
    if not total:
        return 1.0
    expected, below = 0.0, 0.0
    for k in sorted(counts):
        share = below + counts[k] / total
        widest = share**rows - below**rows
        expected += widest * (verify_cost(policy.verify_costs, k) if policy.verify_costs is not None else 1.0 + k)
        below = share
    return (policy.draft_cost or 0.0) + expected


def lockstep_cost(policy: RoundPolicy, widths: Sequence[Sequence[int]], tokens: Sequence[int],
                  rows: int, row_share: float = 0.0) -> tuple[float, float]:
    """``(plain steps, drafted cost)`` of decoding answers ``rows`` at a time, both in ``rows``-row steps. Answer
    ``i`` took the rounds drafting ``widths[i]`` (0: a plain step) for ``tokens[i]`` tokens; the batches are
    consecutive ``rows`` answers, wrapping round to fill the last. Plain batched decoding takes as many steps as the
    batch's longest answer (it keeps every row); the drafted batch, per round, the drafter once and the verify of the
    widest row still running, until its slowest row ends, each round over ``n`` running rows costing
    ``(1 - row_share) + row_share * n / rows`` of a full one (a finished row leaves the batch loop:
    :attr:`~hf_retrace.tuning.costs.MachineCosts.row_share`).

    >>> policy = RoundPolicy(verify_costs=(1.0, 1.5, 2.0), draft_cost=0.5)
    >>> lockstep_cost(policy, [[2, 2], [1, 0, 1]], [6, 4], 2)   # 3 rounds: 2.5, 2.5, then 2.0 for one row
    (6.0, 7.0)
    >>> lockstep_cost(policy, [[2, 2], [1, 0, 1]], [6, 4], 2, row_share=0.5)   # the last round at 3/4 the cost
    (6.0, 6.5)
    """
    plain = drafted = 0.0
    count = len(widths)
    for first in range(0, count, rows):
        batch = [(first + j) % count for j in range(min(rows, count))]
        plain += max(tokens[i] for i in batch)
        for r in range(max(len(widths[i]) for i in batch)):
            running = [widths[i][r] for i in batch if r < len(widths[i])]
            # the drafter runs for every row each round (a lookup or plain row too): a drafter round's cost
            drafted += policy.round_cost(max(running), False) * (1 - row_share + row_share * len(running) / rows)
    return plain, drafted


def replay(answers: Sequence[AnswerRecord], policy: RoundPolicy, max_drafts: int,
           keep_rounds: bool = False, rows: int = 1, row_share: float = 0.0) -> dict[str, Any]:
    """Walk every answer under ``policy`` as the generator would. Generation ends at the answer's end; like
    ``generate``, a round never drafts the answer's last token (no room for its bonus token). Plain steps (no room,
    or the guard's back-off) cost one step each; in a batch of ``rows`` > 1 the answers run ``rows`` at a time
    (:func:`lockstep_cost`, with ``row_share``) and ``tokens_per_cost`` is the batch's speed-up over plain batched
    decoding."""
    tokens = cost = 0.0
    rounds = lookup_rounds = plain_steps = 0
    log: list[tuple[str, int, int]] = []
    widths: list[list[int]] = []  # per answer: drafts of every round, 0 for a plain step
    lengths: list[int] = []  # per answer: the tokens it committed
    for record in answers:
        widths.append([])
        committed = tokens
        seq, end = record.tokens, len(record.tokens)
        sources = [LookupSource(policy)] if policy.lookup else []
        round_ = Round(policy, [*sources, RecordedDrafts(record, policy, max_drafts)], GenerationStats(), rows=rows)
        p = record.start
        while p < end - 1:
            inputs = RoundInputs(p, end - p - 2, host_sequence=seq)  # room: drafts that still leave a bonus token
            proposal = round_.propose(inputs) if policy.speculate else None
            if proposal is None:
                tokens, cost, plain_steps, p = tokens + 1, cost + 1.0, plain_steps + 1, p + 1
                widths[-1].append(0)
                continue
            accepted = accepted_prefix(proposal.host_tokens, seq, p)
            round_.observe(proposal, Verdict(accepted))
            from_lookup = proposal.source == "lookup"
            tokens, cost = tokens + accepted + 1, cost + policy.round_cost(len(proposal), from_lookup)
            rounds, lookup_rounds = rounds + 1, lookup_rounds + from_lookup
            widths[-1].append(len(proposal))
            if keep_rounds:
                log.append((proposal.source, len(proposal), accepted))
            p += accepted + 1
        lengths.append(int(tokens - committed))
    gained = tokens
    if rows > 1 and widths and policy.speculate:
        gained, cost = lockstep_cost(policy, widths, lengths, rows, row_share)  # its plain steps over its cost
    result = {"tokens_per_cost": gained / cost if cost else 0.0, "tau": (tokens - plain_steps) / max(rounds, 1),
              "lookup_share": lookup_rounds / max(rounds, 1), "rounds": rounds, "tokens": tokens,
              "plain_steps": plain_steps}
    if keep_rounds:
        result["round_log"] = log
    return result


def replay_rounds(rounds: Sequence[tuple[Sequence[float], int]], policy: RoundPolicy,
                  rows: int = 1) -> dict[str, float]:
    """Tokens per step-cost had ``policy``'s cut shortened the recorded full-block ``(confidences, accepted)``
    rounds (no lookup, no guard): ``min(accepted, k) + 1`` tokens at the cost of ``k`` drafts (in a batch of
    ``rows`` > 1, :func:`batch_round_cost` a round)."""
    tokens = cost = drafted = 0.0
    widths = []
    for confidences, accepted in rounds:
        k = policy.cut(confidences)
        tokens += min(accepted, k) + 1
        cost += policy.round_cost(k, False)
        drafted += k
        widths.append(k)
    if rows > 1 and widths:
        cost = len(widths) * batch_round_cost(policy, widths, rows)
    n = max(len(rounds), 1)
    return {"tau": tokens / n, "mean_drafted": drafted / n, "tokens_per_cost": tokens / cost if cost else 0.0,
            "rounds": len(rounds)}
