"""Calibrate the adaptive block: the confidence threshold that maximises tokens per second, on training prompts.

A round drafts slot 1, then each next slot while the drafter's own top probability stays at or above the threshold.
The threshold trades acceptance (a cut block can accept at most what it drafted) against the verify cost of the
slots it no longer sends. Both sides are measured here, never assumed:

1. ``generate`` with the full block (threshold 0) on held-out *training* prompts records, per round, the drafter's
   top probability at every slot and how many drafts the target accepted;
2. the target's verify cost of ``k`` drafts (one forward over ``k + 1`` tokens on a cached context) and the drafter's
   round cost, both in units of one plain decoding step, are timed on this machine;
3. every threshold on a grid is replayed over the recorded rounds: ``k_t`` drafts (the confident prefix),
   ``min(accepted, k_t) + 1`` tokens, at cost ``c + verify(k_t)``; the best tokens-per-cost wins (ties within
   0.5 %: the higher tau, :func:`best_row`);
4. the hybrid's lookup budget (``lookup_start_tokens``, ``lookup_num_tokens``) is chosen the same way, by walking the
   target's own answers from step 1 under each setting at the chosen threshold (:mod:`.hybrid_replay`).

Greedy output never depends on the threshold (lossless), so replaying one recorded run is a fair model of the others;
only the round boundaries move. Run it alone on the machine: its timings are the machine's.

Example::

    result = calibrate_confidence_threshold(target, drafter, prompt_ids, max_new_tokens=96)
    drafter.config.draft_confidence_threshold = result["threshold"]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from ..generation.candidate_generator import confident_prefix
from ..generation.target_features import cache_kwargs

__all__ = ["best_row", "calibrate_confidence_threshold", "measure_verify_costs", "replay_grid", "replay_lookup_grid",
           "replay_threshold", "verify_cost"]

GRID = tuple(round(0.05 * i, 2) for i in range(20))
TIE = 0.005  # rows within 0.5 % of the best tokens per step-cost are a tie: below what two calibrations agree on
LOOKUP_GRID = tuple((start, cap) for start in (1, 2, 3) for cap in (2, 4, 6, 8, 10, 16) if start <= cap)


@torch.inference_mode()
def measure_verify_costs(target: Any, max_drafts: int, context_length: int = 256, repeats: int = 9) -> list[float]:
    """``costs[k]``: seconds of a target forward over ``k + 1`` new tokens on a cached context / that of 1 token."""
    device = next(target.parameters()).device
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, context_length + max_drafts + 1), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    cache = DynamicCache()
    target(input_ids=ids[:, :context_length], **cache_kwargs(target, cache), use_cache=True)
    times: list[list[float]] = [[] for _ in range(max_drafts + 1)]
    # every repeat times all k in turn: a drift of the machine's speed moves all of them, not their ratios
    for repeat in range(repeats + 1):  # the first pass warms up and is not counted
        for k in range(max_drafts + 1):
            started = time.perf_counter()
            new = ids[:, context_length : context_length + k + 1]
            target(input_ids=new, **cache_kwargs(target, cache), use_cache=True)
            if repeat:
                times[k].append(time.perf_counter() - started)
            cache.crop(-(k + 1))  # negative: drop the k + 1 new positions (transformers 4.57 and 5.x)
    seconds = [statistics.median(t) for t in times]
    return [s / seconds[0] for s in seconds]


def verify_cost(verify_costs: Sequence[float], k: int) -> float:
    """``verify_costs[k]``, extended past its end along its last step (a lookup round may propose more than a block,
    a drafter may be compared under another drafter's shorter cost vector)."""
    last = len(verify_costs) - 1
    if k <= last or last == 0:
        return verify_costs[min(k, last)]
    return verify_costs[last] + (verify_costs[last] - verify_costs[last - 1]) * (k - last)


def replay_threshold(rounds: Sequence[tuple[Sequence[float], int]], threshold: float, draft_cost: float,
                     verify_costs: Sequence[float]) -> dict[str, float]:
    """Tokens per plain-step cost if ``threshold`` had cut the recorded ``(slot confidences, accepted)`` rounds."""
    tokens = cost = drafted = 0.0
    for confidences, accepted in rounds:
        k = confident_prefix(confidences, threshold)
        tokens += min(accepted, k) + 1
        cost += draft_cost + verify_cost(verify_costs, k)
        drafted += k
    n = max(len(rounds), 1)
    return {"threshold": threshold, "tau": tokens / n, "mean_drafted": drafted / n,
            "tokens_per_cost": tokens / cost if cost else 0.0}


def replay_grid(rounds: Sequence[tuple[Sequence[float], int]], draft_cost: float, verify_costs: Sequence[float],
                grid: Sequence[float] = GRID) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Every threshold of ``grid`` replayed over the recorded rounds: the table, and its best tokens-per-cost row."""
    table = [replay_threshold(rounds, t, draft_cost, verify_costs) for t in grid]
    return table, best_row(table)


def best_row(table: Sequence[dict[str, Any]], tie: float = TIE) -> dict[str, Any]:
    """The row with the most tokens per step-cost; among rows within ``tie`` of it, the one with the highest tau.

    Measured verify costs move by more than ``tie`` between two calibrations on the same machine, so rows that close
    are not told apart; more tokens per round is then the better bet (it loses least where verifying is cheaper).
    """
    top = max(row["tokens_per_cost"] for row in table)
    return max((row for row in table if row["tokens_per_cost"] >= top * (1 - tie)), key=lambda row: row["tau"])


@torch.inference_mode()
def calibrate_confidence_threshold(target: Any, drafter: Any, prompt_ids: Sequence[Sequence[int]],
                                   max_new_tokens: int = 96, grid: Sequence[float] = GRID,
                                   lookup_grid: Sequence[tuple[int, int]] = LOOKUP_GRID,
                                   progress: bool = True) -> dict[str, Any]:
    """Record full-block rounds on ``prompt_ids``, time the costs, replay ``grid`` (and the lookup budgets of
    ``lookup_grid``: ``(start, cap)`` pairs); returns the best threshold and budget, and their tables."""
    import hf_retrace  # noqa: F401  (the generate hook)
    from .hybrid_replay import record_answers

    if not prompt_ids:
        raise ValueError("calibration needs at least one prompt (held-out training prompts, never benchmark prompts).")
    saved = drafter.config.draft_confidence_threshold, drafter.config.lookup
    drafter.config.draft_confidence_threshold, drafter.config.lookup = 0.0, False  # full blocks, confidences kept
    device = next(target.parameters()).device
    rounds: list[tuple[list[float], int]] = []
    answers: list[dict[str, torch.Tensor]] = []  # the target's greedy answers, for the lookup replay
    draft_seconds = plain_seconds = 0.0
    plain_tokens = num_rounds = 0
    try:
        for i, ids in enumerate(prompt_ids):
            input_ids = torch.tensor([list(ids)], device=device)
            started = time.perf_counter()
            plain = target.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
            plain_seconds += time.perf_counter() - started
            plain_tokens += plain.shape[1] - input_ids.shape[1]
            answers.append({"input_ids": plain[0].cpu(),
                            "loss_mask": (torch.arange(plain.shape[1]) >= input_ids.shape[1]).long()})
            target.generate(input_ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
            stats = drafter.last_stats
            accepted = [length - 1 for length in stats.acceptance_lengths]
            rounds += list(zip(stats.slot_confidences, accepted))
            draft_seconds += stats.draft_seconds
            num_rounds += stats.rounds
            if progress:
                print(f"[hf-retrace] calibration prompt {i + 1}/{len(prompt_ids)}: tau {stats.mean_acceptance_length:.2f}",
                      flush=True)
    finally:
        drafter.config.draft_confidence_threshold, drafter.config.lookup = saved
    step = plain_seconds / max(plain_tokens, 1)
    draft_cost = draft_seconds / max(num_rounds, 1) / step
    longest = max([drafter.config.block_size - 1] + [cap for _, cap in lookup_grid])
    verify_costs = measure_verify_costs(target, longest)  # a lookup round may propose more than a block
    table, best = replay_grid(rounds, draft_cost, verify_costs, grid)
    lookup = replay_lookup_grid(record_answers(target, drafter, answers), best["threshold"], drafter.config,
                                draft_cost, verify_costs, lookup_grid) if lookup_grid else None
    return {"threshold": best["threshold"], "best": best, "full_block": table[0], "table": table,
            "lookup": lookup, "draft_cost_c": draft_cost, "verify_costs": verify_costs, "rounds": len(rounds),
            "prompts": len(prompt_ids), "plain_seconds_per_token": step,
            "recorded_rounds": [[list(confidences), accepted] for confidences, accepted in rounds]}


def replay_lookup_grid(records: Sequence[Any], threshold: float, config: Any, draft_cost: float,
                       verify_costs: Sequence[float], lookup_grid: Sequence[tuple[int, int]] = LOOKUP_GRID
                       ) -> dict[str, Any]:
    """The hybrid walked over ``records`` (:func:`~.hybrid_replay.record_answers`) for each ``(start, cap)``
    lookup budget of ``lookup_grid``, and the drafter alone; the best budget (:func:`best_row`)."""
    from .hybrid_replay import replay_hybrid

    def walk(**rule: Any) -> dict[str, Any]:
        return replay_hybrid(records, threshold=threshold, max_drafts=config.block_size - 1, draft_cost=draft_cost,
                             verify_costs=verify_costs, min_ngram=config.lookup_min_ngram,
                             max_ngram=config.lookup_max_ngram, **rule)

    table = [{"start_tokens": start, "num_tokens": cap, **walk(start_tokens=start, num_tokens=cap)}
             for start, cap in lookup_grid]
    best = best_row(table)
    return {"start_tokens": best["start_tokens"], "num_tokens": best["num_tokens"], "best": best, "table": table,
            "drafter_alone": walk(lookup=False)}
