"""``hf-retrace tune --verify``: a short real A/B of plain decoding, the tuned choice and the runner-up on the
drafter's recorded prompts, each policy's predicted tokens per step-cost beside the speed-up it realizes.

Decode time excludes the prefill (a plain one-token ``generate`` per prompt, timed once, is subtracted), so the
realized figure compares with the replay's, which prices decoding rounds only.

A batch's choice is checked the same way before it is kept (:func:`batch_check`): the replay's batch figure missed
by 22-30 %, in the verify forwards (docs/design/batching.md; on a Xeon with AMX, bf16, it predicted 1.87 / 1.56 /
1.28 tokens per step-cost at 2 / 4 / 8 rows, and the benchmark realized 1.07-1.72x / 0.99-1.41x / 0.77-1.00x).

Example::

    result = tune(target, drafter)
    rows = verify_tuning(target, drafter, result, records_of(drafter))
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch

from ..generation.batched import left_padded, pad_token_id_of
from ..generation.placement import synchronize
from ..generation.policy import RoundPolicy, shipped_policy
from .costs import MachineCosts
from .records import AnswerRecord, RoundRecords
from .search import lookup_changes, runner_up

__all__ = ["BATCH_CHECK_PROMPTS", "BATCH_CHECK_TOKENS", "BatchAB", "batch_check", "verify_arms", "verify_tuning"]

BATCH_CHECK_TOKENS = 48  # new tokens per row in each arm of a batch's A/B
BATCH_CHECK_PROMPTS = 16  # recorded prompts per A/B, in batches of the call's rows (at least two batches)


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


class BatchAB(NamedTuple):
    """A batch A/B's realized speed-ups over plain batched decoding: over all its batches, and over each half."""

    pooled: float
    halves: tuple[float, float]

    def wins(self, margin: float) -> bool:
        """Drafting pays on the whole mix of prompts."""
        return self.pooled >= 1 + margin

    def loses(self, margin: float) -> bool:
        """Both halves under: plain decoding proved by two measurements."""
        return all(r < 1 + margin for r in self.halves)

    def said(self) -> str:
        return f"{self.pooled:.2f}x (halves {self.halves[0]:.2f}x, {self.halves[1]:.2f}x)"

    def to_dict(self) -> dict[str, Any]:
        return {"pooled": round(self.pooled, 3), "halves": [round(r, 3) for r in self.halves]}


@torch.inference_mode()
def batch_check(target: Any, drafter: Any, policy: RoundPolicy, answers: list[AnswerRecord], rows: int,
                sampling: dict[str, Any] | None = None, max_new_tokens: int = BATCH_CHECK_TOKENS,
                prompts: int = BATCH_CHECK_PROMPTS) -> BatchAB:
    """A real A/B at batch size ``rows`` on about ``prompts`` recorded prompts: the recorded ``answers``' prompts in
    consecutive batches of ``rows`` (at least two batches; repeated when there are too few), each left-padded and
    decoded by plain batched ``generate`` and by ``policy``'s, the arms' order alternating per batch (a load that comes
    and goes hits both). Returns the realized speed-up over all the batches and over each half of them: plain's
    decode seconds over the drafted calls' (the same tokens: the drafted call is lossless), a timed one-token plain
    call per batch (its prefill) taken off both. A batched call lasts as long as its slowest row, so which prompts
    share a batch moves the figure (0.9x to 1.35x for three batches of 4 on one machine): many prompts, not one batch
    twice."""
    device = target.get_input_embeddings().weight.device
    pad = pad_token_id_of(target.generation_config)
    batches = max(2, -(-prompts // rows))
    chosen = [(a := answers[i % len(answers)]).tokens[: a.start] for i in range(batches * rows)]
    view = drafter.with_policy(policy)
    sampling = sampling or {"do_sample": False}

    def seconds(batch: dict[str, torch.Tensor], assistant: Any, new_tokens: int) -> float:
        torch.manual_seed(0)
        kwargs = {"assistant_model": assistant} if assistant is not None else {}
        synchronize(device)
        started = time.perf_counter()
        target.generate(**batch, max_new_tokens=new_tokens, pad_token_id=pad, **sampling, **kwargs)
        synchronize(device)
        return time.perf_counter() - started

    totals = [[0.0, 0.0], [0.0, 0.0]]  # per half: plain, drafted
    for index in range(batches):
        batch = left_padded(chosen[index * rows:(index + 1) * rows], pad, device)
        if index == 0:  # warm-up: a shape's first forwards cost more
            seconds(batch, view, 4)
            seconds(batch, None, 4)
        prefill = seconds(batch, None, 1)
        plain_first = index % 2 == 0
        arms = (None, view) if plain_first else (view, None)
        timed = [seconds(batch, arm, max_new_tokens) - prefill for arm in arms]
        half = totals[0 if index < batches / 2 else 1]
        for column, elapsed in enumerate(timed if plain_first else timed[::-1]):  # plain, drafted
            half[column] += elapsed
    plain, drafted = (sum(column) for column in zip(*totals))
    return BatchAB(max(plain, 1e-9) / max(drafted, 1e-9),
                   tuple(max(p, 1e-9) / max(d, 1e-9) for p, d in totals))
