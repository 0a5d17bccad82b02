"""``hf-retrace tune --verify``: a short real A/B of plain decoding, the tuned choice and the runner-up on the
drafter's recorded prompts, each policy's predicted tokens per step-cost beside the speed-up it realizes.

Decode time excludes the prefill (a plain one-token ``generate`` per prompt, timed once, is subtracted), so the
realized figure compares with the replay's, which prices decoding rounds only.

Example::

    result = tune(target, drafter)
    rows = verify_tuning(target, drafter, result, records_of(drafter))
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..generation.policy import RoundPolicy, shipped_policy
from .costs import MachineCosts
from .records import RoundRecords
from .search import lookup_changes, runner_up

__all__ = ["verify_arms", "verify_tuning"]


def verify_arms(result: dict[str, Any], name: str, base: RoundPolicy) -> list[tuple[str, RoundPolicy | None]]:
    """``[(label, policy)]`` for one temperature: plain (None), the choice, and the best other replayed row; where
    the choice is plain, the best replayed row and the next one."""
    chosen = RoundPolicy.from_dict(result["policies"][name])
    costs = MachineCosts.from_dict(result["costs"])
    table = result.get("tables", {}).get(name) or []

    def armed(row: dict[str, Any], label: str) -> tuple[str, RoundPolicy]:
        policy = costs.arm(base, confidence_cut=row["confidence_cut"], **lookup_changes(row["lookup"]))
        return label, policy.replace(source=f"tuned {label}", expected_speedup=round(row["tokens_per_cost"], 3))

    arms: list[tuple[str, RoundPolicy | None]] = [("plain", None)]
    if chosen.speculate:
        arms.append(("choice", chosen))
        lookup = (chosen.lookup_start, chosen.lookup_cap) if chosen.lookup else None
        second = runner_up(table, {"confidence_cut": chosen.confidence_cut, "lookup": lookup})
        if second is not None:
            arms.append(armed(second, "runner-up"))
    elif table:
        best = max(table, key=lambda row: row["tokens_per_cost"])
        arms.append(armed(best, "best drafting"))
        second = runner_up(table, best)
        if second is not None:
            arms.append(armed(second, "runner-up"))
    return arms


def _decode(target: Any, assistant: Any, ids: torch.Tensor, max_new_tokens: int, sampling: dict[str, Any]
            ) -> tuple[float, int]:
    """(seconds, new tokens) of one ``generate`` call, seeded so sampled arms draw alike."""
    torch.manual_seed(0)
    kwargs = {"assistant_model": assistant} if assistant is not None else {}
    started = time.perf_counter()
    out = target.generate(ids, max_new_tokens=max_new_tokens, **sampling, **kwargs)
    return time.perf_counter() - started, out.shape[1] - ids.shape[1]


@torch.inference_mode()
def verify_tuning(target: Any, drafter: Any, result: dict[str, Any], records: RoundRecords, prompts: int = 4,
                  max_new_tokens: int = 64) -> list[dict[str, Any]]:
    """One row per temperature and arm (:func:`verify_arms`): ``predicted`` (the replay's tokens per step-cost; plain
    = 1), ``realized`` (decode tokens per second over plain's on the same prompts) and ``tau``."""
    base = shipped_policy(drafter.config)
    device = target.get_input_embeddings().weight.device
    rows = []
    sampled = {"do_sample": True, "temperature": records.temperature}
    for name, answers, sampling in (("greedy", records.greedy, {"do_sample": False}),
                                    ("sampled", records.sampled, sampled)):
        inputs = [torch.tensor([a.tokens[: a.start]], device=device) for a in answers[:prompts]]
        if not inputs:
            continue
        arms = verify_arms(result, name, base)
        views = {label: drafter.with_policy(policy) if policy is not None else None for label, policy in arms}
        for view in views.values():  # warm-up: first calls pay one-time costs
            _decode(target, view, inputs[0], 4, sampling)
        prefill = [_decode(target, None, ids, 1, sampling)[0] for ids in inputs]
        speeds, taus = {}, {}
        for label, view in views.items():
            seconds = tokens = 0.0
            accepted: list[int] = []
            for ids, prefill_seconds in zip(inputs, prefill):
                took, new = _decode(target, view, ids, max_new_tokens, sampling)
                seconds += max(took - prefill_seconds, 1e-9)
                tokens += new - 1  # the prefill's token is not a decoded one
                if view is not None and view.last_stats is not None:
                    accepted += view.last_stats.acceptance_lengths
            speeds[label] = tokens / seconds
            taus[label] = sum(accepted) / len(accepted) if accepted else 1.0
        for label, policy in arms:
            rows.append({"temperature": "T=0" if name == "greedy" else "T>0", "arm": label,
                         "policy": "plain decoding" if policy is None else policy.describe(),
                         "predicted": 1.0 if policy is None or not policy.speculate else policy.expected_speedup,
                         "realized": speeds[label] / speeds["plain"], "tau": taus[label]})
    return rows
