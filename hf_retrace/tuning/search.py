"""Choose the round policy for this machine: replay candidate policies over the drafter's recorded rounds under the
measured costs, per temperature, and keep the one with the most tokens per step-cost; plain decoding where none
beats plain by ``PLAIN_MARGIN``.

The search is coordinate-wise (a cut alone, then lookup budgets at that cut, then the cut again under the best
budget), about 40 replays: well under a second on a CPU for the shipped records.

Example::

    choice = choose_policies(records, costs, base=shipped_policy(drafter.config))
    choice["greedy"].describe(), choice["sampled"].describe()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..generation.policy import RoundPolicy
from .costs import MachineCosts
from .records import RoundRecords
from .replay import accepted_prefix, replay, replay_rounds

__all__ = ["CUTS", "LOOKUP_BUDGETS", "PLAIN_MARGIN", "TIE", "apply_price", "best_row", "choose_policies", "decide",
           "lookup_changes", "pays", "runner_up", "search_policy"]

CUTS: tuple[float | None, ...] = (None, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.65, 0.7, 0.8, 0.9)
LOOKUP_BUDGETS: tuple[tuple[int, int] | None, ...] = (None, (1, 2), (1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (2, 16),
                                                       (3, 8), (3, 16), (4, 32))
PLAIN_MARGIN = 0.05  # speculate only where the replay (times the measured price of real rounds) beats plain by 5 %
TIE = 0.005  # rows within 0.5 % of the best are a tie: below what two measurements of one machine agree on


def best_row(table: Sequence[dict[str, Any]], tie: float = TIE) -> dict[str, Any]:
    """The row with the most tokens per step-cost; among rows within ``tie`` of it, the one with the highest tau
    (more tokens per round loses least where verifying is cheaper than measured)."""
    top = max(row["tokens_per_cost"] for row in table)
    return max((row for row in table if row["tokens_per_cost"] >= top * (1 - tie)), key=lambda row: row["tau"])


def lookup_changes(lookup: tuple[int, int] | None) -> dict[str, Any]:
    """A table row's lookup budget ``(start, cap)`` (None: off) as :class:`RoundPolicy` fields."""
    return {"lookup": False} if lookup is None else {"lookup": True, "lookup_start": lookup[0],
                                                     "lookup_cap": lookup[1]}


def search_policy(answers: Sequence[Any], costs: MachineCosts, base: RoundPolicy, max_drafts: int,
                  cuts: Sequence[float | None] = CUTS,
                  budgets: Sequence[tuple[int, int] | None] = LOOKUP_BUDGETS) -> tuple[dict[str, Any], list[dict]]:
    """The best replayed row for ``answers`` (one temperature's records; its ``policy``) and the table of every
    replayed candidate."""
    table: list[dict[str, Any]] = []

    def walk(cut: float | None, lookup: tuple[int, int] | None) -> dict[str, Any]:
        policy = costs.arm(base, confidence_cut=cut, **lookup_changes(lookup))
        row = {"confidence_cut": cut, "lookup": lookup, "policy": policy,
               **replay(answers, policy, max_drafts, rows=costs.rows, row_share=costs.row_share)}
        table.append(row)
        return row

    best = best_row([walk(cut, None) for cut in cuts])
    best = best_row([walk(best["confidence_cut"], b) for b in budgets])
    best = best_row([walk(cut, best["lookup"]) for cut in cuts])
    if base.lookup or base.confidence_cut is not None:  # the shipped constants are a candidate too
        shipped = walk(base.confidence_cut, (base.lookup_start, base.lookup_cap) if base.lookup else None)
        best = best_row([best, shipped])
    return best, table


def _plain(reason: str, best: RoundPolicy) -> RoundPolicy:
    """Plain decoding that keeps the knobs of the best replayed drafting policy ``best`` (armed with the machine's
    costs): a view that asks for drafting on top of it, and the calls that check a plain choice by drafting
    (:func:`~hf_retrace.tuning.auto.auto_policy`), draft with them, the guard on (docs/round-policy.md, precedence)."""
    return best.replace(speculate=False, reason=reason, source="tuned", expected_speedup=None)


def runner_up(table: Sequence[dict[str, Any]], chosen: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The best replayed row of ``table`` whose cut and lookup budget differ from ``chosen``'s (from the table's best
    when None): what ``hf-retrace tune --verify`` runs beside the choice."""
    rows = sorted(table, key=lambda row: -row["tokens_per_cost"])
    if not rows:
        return None
    first = chosen if chosen is not None else rows[0]
    taken = (first["confidence_cut"], tuple(first["lookup"] or ()))
    return next((row for row in rows if (row["confidence_cut"], tuple(row["lookup"] or ())) != taken), None)


def choose_policies(records: RoundRecords, costs: MachineCosts, base: RoundPolicy) -> dict[str, Any]:
    """``{"greedy": policy, "sampled": policy, "tables": ..., "replayed": ...}``: the tuned policy per temperature
    (greedy: T=0; sampled: T>0, recorded at ``records.temperature``; ``replayed``: the best row's tokens per step-cost)
    decided by :func:`decide` at ``costs.price``. A temperature without records keeps ``base`` (with the guard armed
    by the measured costs)."""
    max_drafts = records.block_size - 1
    result: dict[str, Any] = {"tables": {}, "replayed": {}}
    for name, answers in (("greedy", records.greedy), ("sampled", records.sampled)):
        if not answers:
            result[name] = costs.arm(base).replace(source="shipped", reason="no recorded rounds to replay")
            continue
        best, table = search_policy(answers, costs, base.replace(proposal_mode="argmax"), max_drafts)
        policy = best["policy"]
        if name == "sampled" and records.sample_rounds:
            policy = _proposal_mode(records, policy, costs, result["tables"])
        result["replayed"][name] = best["tokens_per_cost"]
        result[name] = decide(policy, best["tokens_per_cost"], costs.price)
        result["tables"][name] = [{k: v for k, v in row.items() if k != "policy"} for row in table]
    return result


def pays(figure: float, price: float | None = None) -> bool:
    """Whether drafting at ``figure`` tokens per step-cost beats plain decoding by :data:`PLAIN_MARGIN` at ``price``,
    the real speed-up per unit of that figure measured on this machine (None: the figure alone). The one plain-or-draft
    line: for the replay's figures at the price of real rounds (:func:`decide`), and for real calls' clocked figures at
    theirs (the calls that check a plain choice, :func:`hf_retrace.tuning.realized.note_realized`)."""
    return figure * (price if price is not None else 1.0) >= 1 + PLAIN_MARGIN


def decide(policy: RoundPolicy, speedup: float, price: float | None = None) -> RoundPolicy:
    """``policy`` (the best replayed drafting policy, ``speedup`` its tokens per step-cost) where it beats plain
    decoding by :data:`PLAIN_MARGIN` at this machine's measured ``price`` of real rounds (None: not measured, the
    replay's figure alone); else plain decoding that keeps its knobs. The one plain-or-draft rule of the search."""
    if not pays(speedup, price):
        expected = speedup * (price if price is not None else 1.0)
        priced = f", {expected:.2f} at the measured price of its real rounds" if price is not None else ""
        return _plain(f"the best replayed policy commits {speedup:.2f} tokens per step-cost on this machine{priced}, "
                      f"under plain decoding's 1 + {PLAIN_MARGIN:g}", policy.replace(price=price))
    return policy.replace(speculate=True, source="tuned", reason="", expected_speedup=round(speedup, 3), price=price)


def apply_price(choice: dict[str, Any], price: float | None) -> dict[str, Any]:
    """:func:`choose_policies`' ``choice`` decided again at the measured ``price`` of real rounds (no replay: the
    price scales every row alike, so only the plain-or-draft decision can move); unchanged where ``price`` is None or a
    temperature was not replayed."""
    if price is None:
        return choice
    for name, speedup in choice.get("replayed", {}).items():
        choice[name] = decide(choice[name], speedup, price)
    return choice


def _proposal_mode(records: RoundRecords, policy: RoundPolicy, costs: MachineCosts, tables: dict) -> RoundPolicy:
    """Sampled proposals (rejection sampling) instead of argmax ones (sample-and-match) where their recorded rounds
    replay better at the same cut, lookup left as chosen."""
    argmax_rounds = [row for a in records.sampled for row in _full_block_rounds(a, records.block_size - 1)]
    rows = []
    for mode, rounds in (("argmax", argmax_rounds), ("sample", records.sample_rounds)):
        for cut in CUTS:
            candidate = costs.arm(policy, confidence_cut=cut, proposal_mode=mode)
            rows.append({"proposal_mode": mode, "confidence_cut": cut,
                         **replay_rounds(rounds, candidate, rows=costs.rows)})
    tables["proposal_mode"] = rows
    best = best_row(rows)
    if best["proposal_mode"] == "argmax":
        return policy
    return costs.arm(policy, proposal_mode="sample", confidence_cut=best["confidence_cut"])


def _full_block_rounds(answer: Any, max_drafts: int) -> list[tuple[list[float], int]]:
    """An answer's anchors as full-block drafter rounds ``(confidences, accepted)`` (every anchor, not a walk: the
    same sampling of positions as the recorded sampled-proposal rounds, which are walks; close enough to compare)."""
    return [(list(confidences[:max_drafts]), accepted_prefix(drafts[:max_drafts], answer.tokens, answer.start + a))
            for a, (drafts, confidences) in enumerate(zip(answer.drafts, answer.confidences))]
