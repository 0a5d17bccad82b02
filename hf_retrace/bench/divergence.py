"""Losslessness at T=0: where an output first leaves plain ``generate``'s, and whether that is numerics or a bug.

The gap at a divergence comes from one target forward over plain's sequence up to that position. In fp32 every
divergence is a bug; in bf16 a top-2 logit gap within ``NEAR_TIE_ULPS`` bf16 ulps of the logit magnitude is a
near-tie (numerics), anything larger is a bug. At T > 0 outputs legitimately differ and are not compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .methods import Method
from .records import Divergence

__all__ = ["NEAR_TIE_ULPS", "Comparison", "Divergence", "bf16_ulp", "compare_with_plain", "find_divergence"]

NEAR_TIE_ULPS = 2


@dataclass
class Comparison:
    """One request against plain's answer: compared or not (and why not), and its first divergence if any."""

    compared: bool
    divergence: Divergence | None = None
    reason: str = ""


def compare_with_plain(target: Any, dtype: str, method: Method, temperature: float, input_ids: torch.Tensor,
                       output: list[int], plain: tuple[torch.Tensor, list[int]] | None) -> Comparison | None:
    """At T=0, the first divergence from plain ``generate`` on the same input (None: nothing to compare)."""
    if temperature > 0 or method.kind == "plain" or plain is None:
        return None
    plain_input, plain_output = plain
    if not torch.equal(plain_input, input_ids):
        return Comparison(False, reason="an earlier turn diverged from plain, so this turn's input differs")
    return Comparison(True, find_divergence(target, input_ids, plain_output, output, dtype))


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
