"""τ measured the way users will see it: real ``target.generate(..., assistant_model=drafter)`` on held-out prompts.

Example::

    evaluate = TauEvaluator(target, eval_prompt_ids, max_new_tokens=64)
    evaluate(drafter)["tau"]
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..generation.batched import pad_token_id_of
from ..generation.policy import RoundPolicy, shipped_policy
from ..stats import GenerationStats

__all__ = ["TauEvaluator", "evaluation_policy", "sequence_prompt_ids"]


def evaluation_policy(drafter: nn.Module) -> RoundPolicy:
    """The round policy τ is measured under while training: the drafter alone, full blocks, no lookup, no guard,
    ReTrace as its config says (on for a module the run trains). The same on every machine: never the policy tuned
    for the machine, which may decode plainly where drafting does not pay (a τ of 0 that says nothing of the
    drafter)."""
    return shipped_policy(drafter.config).replace(confidence_cut=None, lookup=False, source="evaluation")


def sequence_prompt_ids(dataset: Any, indices: Sequence[int]) -> list[list[int]]:
    """The prompt tokens (everything before the first response token) of ``dataset``'s sequences ``indices``.

    For τ on sequences never trained on: a run's ``--holdout`` tail, or calibration's ``--sequences``."""
    ids = []
    for index in indices:
        item = dataset[index]
        mask = item["loss_mask"]
        first = int(mask.nonzero()[0]) if mask.any() else len(mask)
        ids.append(item["input_ids"][:first].tolist())
    return ids


class TauEvaluator:
    """Measures τ with REAL ``target.generate(ids, assistant_model=drafter, do_sample=False)`` on held-out prompts.

    ``prompts`` are token-id lists (already chat-templated). τ is the DFlash protocol's: the mean over prompts of
    each call's ``last_stats.mean_acceptance_length``, under :func:`evaluation_policy` (full blocks, no lookup).
    ``limit`` evaluates only the first prompts (cheap periodic evals); ``evaluate(drafter, limit=None)`` runs them
    all.
    """

    def __init__(self, target: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                 limit: int | None = None):
        if not prompts:
            raise ValueError("TauEvaluator needs at least one prompt.")
        self.target = target
        self.prompts = [list(map(int, p)) for p in prompts]
        self.max_new_tokens = max_new_tokens
        self.limit = limit

    @torch.no_grad()
    def __call__(self, drafter: nn.Module, limit: int | None = -1) -> dict[str, Any]:
        limit = self.limit if limit == -1 else limit
        prompts = self.prompts[:limit] if limit else self.prompts
        was_training = drafter.training
        drafter.eval()
        view = drafter.with_policy(evaluation_policy(drafter))
        device = next(self.target.parameters()).device
        all_stats = []
        started = time.perf_counter()
        try:
            for ids in prompts:
                input_ids = torch.tensor([ids], device=device)
                pad = pad_token_id_of(self.target.generation_config)
                self.target.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=view,
                    max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=pad,
                )
                if view.last_stats is not None:
                    all_stats.append(view.last_stats)
        finally:
            drafter.train(was_training)
        pooled = GenerationStats.pooled(all_stats)
        return {
            "tau": GenerationStats.mean_tau_per_request(all_stats) or 0.0,
            "tau_pooled": pooled.mean_acceptance_length,
            "eval_prompts": len(prompts),
            "eval_rounds": pooled.rounds,
            "per_position_acceptance": [round(rate, 4) for rate in pooled.per_position_acceptance],
            "eval_seconds": time.perf_counter() - started,
        }
