"""Losslessness at T=0 in the benchmark: each request compared with plain ``generate``'s answer to the same input.

The classifier itself (first divergence, top-2 logit gap, near-tie or bug) is :mod:`hf_retrace.divergence`, shared
with ``hf-retrace generate``; it is re-exported here. At T > 0 outputs legitimately differ and are not compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..divergence import NEAR_TIE_ULPS, Divergence, bf16_ulp, find_divergence
from .methods import Method

__all__ = ["NEAR_TIE_ULPS", "Comparison", "Divergence", "bf16_ulp", "compare_with_plain", "find_divergence"]


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
