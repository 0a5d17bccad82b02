"""Calibrate the adaptive block: the confidence threshold that maximises tokens per second, on training prompts.

A round drafts slot 1, then each next slot while the drafter's own top probability stays at or above the threshold.
The threshold trades acceptance (a cut block can accept at most what it drafted) against the verify cost of the
slots it no longer sends. Both sides are measured here, never assumed:

1. ``generate`` with the full block (threshold 0) on held-out *training* prompts records, per round, the drafter's
   top probability at every slot and how many drafts the target accepted;
2. the target's verify cost of ``k`` drafts (one forward over ``k + 1`` tokens on a cached context) and the drafter's
   round cost, both in units of one plain decoding step, are timed on this machine;
3. every threshold on a grid is replayed over the recorded rounds: ``k_t`` drafts (the confident prefix),
   ``min(accepted, k_t) + 1`` tokens, at cost ``c + verify(k_t)``; the best tokens-per-cost wins.

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

__all__ = ["calibrate_confidence_threshold", "measure_verify_costs", "replay_grid", "replay_threshold"]

GRID = tuple(round(0.05 * i, 2) for i in range(20))


@torch.inference_mode()
def measure_verify_costs(target: Any, max_drafts: int, context_length: int = 256, repeats: int = 9) -> list[float]:
    """``costs[k]``: seconds of a target forward over ``k + 1`` new tokens on a cached context / that of 1 token."""
    device = next(target.parameters()).device
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, context_length + max_drafts + 1), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    out = target(input_ids=ids[:, :context_length], use_cache=True)
    cache = out.past_key_values
    times: list[list[float]] = [[] for _ in range(max_drafts + 1)]
    # every repeat times all k in turn: a drift of the machine's speed moves all of them, not their ratios
    for repeat in range(repeats + 1):  # the first pass warms up and is not counted
        for k in range(max_drafts + 1):
            started = time.perf_counter()
            target(input_ids=ids[:, context_length : context_length + k + 1], past_key_values=cache, use_cache=True)
            if repeat:
                times[k].append(time.perf_counter() - started)
            cache.crop(-(k + 1))  # negative: drop the k + 1 new positions (transformers 4.57 and 5.x)
    seconds = [statistics.median(t) for t in times]
    return [s / seconds[0] for s in seconds]


def replay_threshold(rounds: Sequence[tuple[Sequence[float], int]], threshold: float, draft_cost: float,
                     verify_costs: Sequence[float]) -> dict[str, float]:
    """Tokens per plain-step cost if ``threshold`` had cut the recorded ``(slot confidences, accepted)`` rounds."""
    tokens = cost = drafted = 0.0
    for confidences, accepted in rounds:
        k = 1
        while k < len(confidences) and confidences[k] >= threshold:
            k += 1
        tokens += min(accepted, k) + 1
        cost += draft_cost + verify_costs[min(k, len(verify_costs) - 1)]
        drafted += k
    n = max(len(rounds), 1)
    return {"threshold": threshold, "tau": tokens / n, "mean_drafted": drafted / n,
            "tokens_per_cost": tokens / cost if cost else 0.0}


def replay_grid(rounds: Sequence[tuple[Sequence[float], int]], draft_cost: float, verify_costs: Sequence[float],
                grid: Sequence[float] = GRID) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Every threshold of ``grid`` replayed over the recorded rounds: the table, and its best tokens-per-cost row."""
    table = [replay_threshold(rounds, t, draft_cost, verify_costs) for t in grid]
    return table, max(table, key=lambda row: row["tokens_per_cost"])


@torch.inference_mode()
def calibrate_confidence_threshold(target: Any, drafter: Any, prompt_ids: Sequence[Sequence[int]],
                                   max_new_tokens: int = 96, grid: Sequence[float] = GRID,
                                   progress: bool = True) -> dict[str, Any]:
    """Record full-block rounds on ``prompt_ids``, time the costs, replay ``grid``; returns the best and the table."""
    import hf_retrace  # noqa: F401  (the generate hook)

    if not prompt_ids:
        raise ValueError("calibration needs at least one prompt (held-out training prompts, never benchmark prompts).")
    saved = drafter.config.draft_confidence_threshold, drafter.config.lookup
    drafter.config.draft_confidence_threshold, drafter.config.lookup = 0.0, False  # full blocks, confidences kept
    device = next(target.parameters()).device
    rounds: list[tuple[list[float], int]] = []
    draft_seconds = plain_seconds = 0.0
    plain_tokens = num_rounds = 0
    try:
        for i, ids in enumerate(prompt_ids):
            input_ids = torch.tensor([list(ids)], device=device)
            started = time.perf_counter()
            plain = target.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
            plain_seconds += time.perf_counter() - started
            plain_tokens += plain.shape[1] - input_ids.shape[1]
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
    verify_costs = measure_verify_costs(target, drafter.config.block_size - 1)
    table, best = replay_grid(rounds, draft_cost, verify_costs, grid)
    return {"threshold": best["threshold"], "best": best, "full_block": table[0], "table": table,
            "draft_cost_c": draft_cost, "verify_costs": verify_costs, "rounds": len(rounds),
            "prompts": len(prompt_ids), "plain_seconds_per_token": step,
            "recorded_rounds": [[list(confidences), accepted] for confidences, accepted in rounds]}
