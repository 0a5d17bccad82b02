"""Losslessness at T=0: where an output first leaves plain ``generate``'s, and whether that is numerics or a bug.

The one classifier, used by the benchmark (:mod:`hf_retrace.bench.divergence`) and by ``hf-retrace generate``
(:mod:`hf_retrace.side_by_side`). The gap at a divergence comes from one target forward over plain's sequence up to
that position. In fp32 every divergence is a bug; in bf16 a top-2 logit gap within ``NEAR_TIE_ULPS`` bf16 ulps of the
logit magnitude is a near-tie (numerics), anything larger is a bug. At T > 0 outputs legitimately differ and are not
compared.

Example::

    divergence = find_divergence(target, input_ids, plain_tokens, drafted_tokens, "bf16")
    if divergence is not None and divergence.verdict == "bug": ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["NEAR_TIE_ULPS", "Divergence", "bf16_ulp", "find_divergence"]

NEAR_TIE_ULPS = 2


@dataclass
class Divergence:
    """Where a T=0 output first left plain ``generate``'s, and how close the target's top-2 logits were there."""

    position: int  # index among the new tokens
    plain_token: int | None
    method_token: int | None
    top2_gap: float  # target logit of its best token minus its second best, at that position
    chosen_gap: float | None  # logit[plain's token] - logit[the method's token]
    logit_magnitude: float
    bf16_ulp: float
    verdict: str  # "near-tie" (numerics) or "bug"


@torch.inference_mode()
def find_divergence(target: Any, input_ids: torch.Tensor, plain_output: list[int], output: list[int],
                    dtype: str) -> Divergence | None:
    """The first position where ``output`` leaves ``plain_output``, with the target's top-2 logit gap there.

    The gap comes from one target forward over the input plus plain's tokens before that position. ``dtype`` "fp32":
    every divergence is a bug; "bf16": a gap within ``NEAR_TIE_ULPS`` bf16 ulps of the logit magnitude is a near-tie.
    """
    position = next((i for i, (a, b) in enumerate(zip(plain_output, output)) if a != b), None)
    if position is None:
        if len(plain_output) == len(output):
            return None
        position = min(len(plain_output), len(output))
    prefix = torch.tensor([plain_output[:position]], dtype=input_ids.dtype)
    sequence = torch.cat([input_ids, prefix], dim=-1).to(target.device)
    logits = target(input_ids=sequence, attention_mask=torch.ones_like(sequence)).logits[0, -1].float()
    top = logits.topk(2).values
    plain_token = plain_output[position] if position < len(plain_output) else None
    method_token = output[position] if position < len(output) else None
    chosen_gap = None
    if plain_token is not None and method_token is not None:
        chosen_gap = float(logits[plain_token] - logits[method_token])
    magnitude = float(top.abs().max())
    ulp = bf16_ulp(magnitude)
    top2_gap = float(top[0] - top[1])
    near_tie = dtype == "bf16" and top2_gap <= NEAR_TIE_ULPS * ulp
    return Divergence(position, plain_token, method_token, top2_gap, chosen_gap, magnitude, ulp,
                      "near-tie" if near_tie else "bug")


def bf16_ulp(magnitude: float) -> float:
    """Spacing of bfloat16 numbers at ``magnitude`` (8 significant bits)."""
    if magnitude <= 0:
        return 2.0**-133
    return 2.0 ** (math.floor(math.log2(magnitude)) - 7)
