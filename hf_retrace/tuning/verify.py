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
from typing import Any

import torch

from ..generation.batched import left_padded, pad_token_id_of
from ..generation.placement import synchronize
from ..generation.policy import RoundPolicy, shipped_policy
from .costs import MachineCosts
from .records import AnswerRecord, RoundRecords
from .search import lookup_changes, runner_up

__all__ = ["BATCH_CHECK_PAIRS", "BATCH_CHECK_TOKENS", "batch_check", "verify_arms", "verify_tuning"]

BATCH_CHECK_TOKENS = 48  # new tokens per row in each arm of a batch's A/B
BATCH_CHECK_PAIRS = 2  # interleaved plain / drafted pairs: a decision needs both to agree


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


@torch.inference_mode()
def batch_check(target: Any, drafter: Any, policy: RoundPolicy, answers: list[AnswerRecord], rows: int,
                sampling: dict[str, Any] | None = None, max_new_tokens: int = BATCH_CHECK_TOKENS,
                pairs: int = BATCH_CHECK_PAIRS) -> list[float]:
    """A real A/B at batch size ``rows``: the prompts of the first ``rows`` recorded ``answers`` (repeated when there
    are fewer), left-padded into one batch, decoded by plain batched ``generate`` and by ``policy``'s, ``pairs``
    times interleaved (plain, drafted, plain, drafted: a load that comes and goes hits both arms). Returns each
    pair's realized speed-up: plain's decode seconds over the drafted call's (the same tokens: the drafted call is
    lossless), a timed one-token plain call (the prefill) taken off both."""
    device = target.get_input_embeddings().weight.device
    prompts = [a.tokens[: a.start] for a in answers[:rows]]
    prompts = [prompts[i % len(prompts)] for i in range(rows)]
    pad = pad_token_id_of(target.generation_config)
    batch = left_padded(prompts, pad, device)
    view = drafter.with_policy(policy)
    sampling = sampling or {"do_sample": False}

    def seconds(assistant: Any, new_tokens: int) -> float:
        torch.manual_seed(0)
        kwargs = {"assistant_model": assistant} if assistant is not None else {}
        synchronize(device)
        started = time.perf_counter()
        target.generate(**batch, max_new_tokens=new_tokens, pad_token_id=pad, **sampling, **kwargs)
        synchronize(device)
        return time.perf_counter() - started

    seconds(view, 4)  # warm-up: a shape's first forwards cost more
    seconds(None, 4)
    prefill = seconds(None, 1)
    ratios = []
    for _ in range(pairs):
        plain = seconds(None, max_new_tokens) - prefill
        drafted = seconds(view, max_new_tokens) - prefill
        ratios.append(max(plain, 1e-9) / max(drafted, 1e-9))
    return ratios
