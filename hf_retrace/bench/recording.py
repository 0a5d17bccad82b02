"""Per call, record the drafting rounds of transformers' own generators into a ``GenerationStats``.

hf_retrace's generator records its own rounds (``drafter.last_stats``); transformers' generators (prompt lookup,
native DFlash) are recorded by wrapping their two methods for the one call. As in hf_retrace's generator, the
prefill forward and forwards that drafted nothing (prompt lookup found no n-gram) are not rounds.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ..generation.placement import synchronize
from ..stats import GenerationStats

__all__ = ["recording_rounds"]


@contextmanager
def recording_rounds(target: Any, stats: GenerationStats) -> Iterator[GenerationStats]:
    """Record the rounds of transformers' own candidate generator (prompt lookup, native DFlash) into ``stats``.

    Wraps ``get_candidates`` / ``update_candidate_strategy`` of the generator built for this one call; the drafting
    and the acceptance rule stay transformers'. Timing split as in hf_retrace's generator: draft = get_candidates,
    verify = from its return to update_candidate_strategy.
    """
    previous = target.__dict__.get("_get_candidate_generator")
    build = target._get_candidate_generator

    def build_recorded(*args: Any, **kwargs: Any):
        generator = build(*args, **kwargs)
        _record_generator(generator, stats)
        return generator

    target._get_candidate_generator = build_recorded
    try:
        yield stats
    finally:
        if previous is None:
            del target._get_candidate_generator
        else:
            target._get_candidate_generator = previous


def _record_generator(generator: Any, stats: GenerationStats) -> None:
    get_candidates, update = generator.get_candidates, generator.update_candidate_strategy
    state = {"calls": 0, "drafted": 0, "verify_started": 0.0, "prompt_length": None}

    def recorded_get_candidates(input_ids: torch.Tensor, *args: Any, **kwargs: Any):
        started = time.perf_counter()
        candidates, logits = get_candidates(input_ids, *args, **kwargs)
        state["calls"] += 1
        state["prompt_length"] = state["prompt_length"] or input_ids.shape[1]
        # the first call precedes (prompt lookup) or skips (DFlash) the prefill: it is never a drafting round
        state["drafted"] = candidates.shape[1] - input_ids.shape[1] if state["calls"] > 1 else 0
        if state["drafted"] > 0:
            synchronize(candidates.device)  # the drafting's queued work belongs to the draft time, not the verify's
            stats.draft_seconds += time.perf_counter() - started
        state["verify_started"] = time.perf_counter()
        return candidates, logits

    def recorded_update(input_ids: torch.Tensor, scores: torch.Tensor, num_matches: Any):
        result = update(input_ids, scores, num_matches)
        stats.new_tokens = input_ids.shape[1] - state["prompt_length"]
        if state["drafted"] > 0:
            stats.verify_seconds += time.perf_counter() - state["verify_started"]
            stats.record_round(state["drafted"], int(num_matches), False)
        return result

    generator.get_candidates = recorded_get_candidates
    generator.update_candidate_strategy = recorded_update
