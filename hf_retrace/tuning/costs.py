"""What a round costs on this machine, in one-token target steps: the target's verify forward over ``k`` drafts and
the drafter's round. Timed on random inputs with separate random generators, so a call's sampling is untouched.

Example::

    costs = measure_costs(target, drafter, max_drafts=16)
    costs.verify_costs[7], costs.draft_cost(None)   # verify 7 drafts; a full-block drafter round
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from transformers import DynamicCache

from ..generation.candidate_generator import drafter_first
from ..generation.placement import synchronize
from ..generation.policy import LOOKUP_COST, RoundPolicy, verify_cost
from ..generation.target_features import cache_kwargs

__all__ = ["MachineCosts", "measure_costs", "measure_draft_cost", "measure_verify_costs", "timed"]

PROBE_POINTS = (1, 2, 3, 4, 8, 16)  # timed against a one-token forward; the k between are interpolated
SHORT_DRAFTS = 4  # verifies this short are timed on every pass (the common case); longer ones on the first only


def timed(fn: Any, device: Any) -> float:
    """Seconds ``fn()`` takes on ``device``, synchronised before and after."""
    synchronize(device)
    started = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - started


@dataclass(frozen=True)
class MachineCosts:
    """``verify_costs[k]``: the target's forward over ``k + 1`` new tokens / its one-token forward (k = 0..max);
    ``draft_cost_chunk`` / ``draft_cost_full``: a drafter round scoring 2 slots / the whole block, same unit;
    ``step_seconds``: the one-token forward itself; ``drafter_first``: the drafter runs on an accelerator, where rounds
    launch its whole block before the lookup decision (:func:`~hf_retrace.generation.candidate_generator.drafter_first`).
    """

    verify_costs: tuple[float, ...]
    draft_cost_chunk: float
    draft_cost_full: float
    step_seconds: float
    drafter_first: bool = False

    def draft_cost(self, confidence_cut: float | None) -> float:
        """A drafter round's cost under a cut (``None``: full blocks score every slot; else mostly the first chunk; in
        the accelerator order every round scores the whole block)."""
        return self.draft_cost_full if confidence_cut is None or self.drafter_first else self.draft_cost_chunk

    def arm(self, policy: RoundPolicy, **changes: Any) -> RoundPolicy:
        """``policy`` (with ``changes``) priced on this machine: the verify curve, the drafter round its cut pays, and a
        lookup round's cost (in the accelerator order it pays the drafter's whole block too). Sampled proposals run a
        processor per slot, so their rounds keep the CPU order on every device and are priced so."""
        policy = policy.replace(**changes)
        costs = self if policy.proposal_mode == "argmax" else replace(self, drafter_first=False)
        lookup = LOOKUP_COST + (costs.draft_cost_full if costs.drafter_first else 0.0)
        return policy.replace(verify_costs=costs.verify_costs, draft_cost=costs.draft_cost(policy.confidence_cut),
                              lookup_cost=lookup)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["verify_costs"] = [round(c, 4) for c in self.verify_costs]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MachineCosts":
        return cls(tuple(data["verify_costs"]), float(data["draft_cost_chunk"]), float(data["draft_cost_full"]),
                   float(data["step_seconds"]), bool(data.get("drafter_first", False)))


def _interpolate(points: dict[int, float], max_k: int) -> list[float]:
    ks = sorted(points)
    out = []
    for k in range(max_k + 1):
        if k in points:
            out.append(points[k])
            continue
        hi = next(p for p in ks if p > k)
        lo = max(p for p in ks if p < k)
        out.append(points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo))
    return out


@torch.inference_mode()
def measure_verify_costs(target: Any, max_drafts: int, context_length: int = 256, repeats: int = 5,
                         points: Sequence[int] = PROBE_POINTS) -> list[float]:
    """``costs[k]`` for k = 0..``max_drafts``: seconds of a target forward over ``k + 1`` new tokens on a cached
    context / that of one token. ``k`` on ``points`` is timed, the ``k`` between interpolated, the ``k`` past the
    longest point extended along its last step."""
    ratios, _ = _verify_ratios(target, max_drafts, context_length, repeats, points)
    return _relative(ratios, max_drafts)


def _relative(ratios: dict[int, float], max_drafts: int) -> list[float]:
    """Costs relative to the one-token forward for k = 0..``max_drafts``, never falling with ``k`` (a timing blip is
    not a cheaper verify); past the longest timed ``k``, extended along its last step (:func:`verify_cost`)."""
    costs, floor = [], 1.0
    for ratio in _interpolate({0: 1.0, **ratios}, min(max_drafts, max(ratios, default=0))):
        floor = max(floor, ratio)
        costs.append(floor)
    return [verify_cost(costs, k) for k in range(max_drafts + 1)]


def _context_cache(target: Any, ids: torch.Tensor, context_length: int) -> DynamicCache:
    """A cache holding ``context_length`` positions. Attention's cost does not depend on what the keys hold, so one
    real token is run and the rest filled with random keys and values, sparing a prefill that would take longer than
    the timing itself on a CPU; a cache that cannot be filled so is prefilled for real."""
    cache = DynamicCache()
    target(input_ids=ids[:, :1], **cache_kwargs(target, cache), use_cache=True, logits_to_keep=1)
    try:
        generator = torch.Generator().manual_seed(1)
        for index, layer in enumerate(cache.layers):
            shape = (*layer.keys.shape[:2], context_length - 1, layer.keys.shape[-1])
            noise = [0.1 * torch.randn(shape, generator=generator).to(layer.keys.device, layer.keys.dtype)
                     for _ in range(2)]
            cache.update(*noise, index)
        if cache.get_seq_length() == context_length:
            return cache
    except (AttributeError, TypeError, ValueError, RuntimeError):
        pass
    cache = DynamicCache()
    target(input_ids=ids[:, :context_length], **cache_kwargs(target, cache), use_cache=True, logits_to_keep=1)
    return cache


def _verify_ratios(target: Any, max_drafts: int, context_length: int, repeats: int, points: Sequence[int],
                   budget_seconds: float = 1.5) -> tuple[dict[int, float], float]:
    """Per timed ``k``: the fastest forward over ``k + 1`` tokens / the fastest one-token forward, both timed
    interleaved (timing noise on a busy machine only ever adds, so the fastest pass is the truest); and that one-token
    forward, in seconds. Verifies of up to :data:`SHORT_DRAFTS` drafts, the common case and the cheap one, are timed
    on every pass; the longer ones on the first pass only. Passes stop after ``repeats``, or after ``budget_seconds``
    once one pass counted (a slow machine waits less at first use)."""
    device = target.get_input_embeddings().weight.device
    vocab = target.config.get_text_config().vocab_size
    ks = sorted({k for k in points if 0 < k <= max_drafts} | {min(max_drafts, max(points))} - {0})
    ids = torch.randint(0, vocab, (1, context_length + max_drafts + 1), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    cache = _context_cache(target, ids, context_length)

    def forward(k: int) -> float:
        new = ids[:, context_length : context_length + k + 1]
        took = timed(lambda: target(input_ids=new, **cache_kwargs(target, cache), use_cache=True), device)
        cache.crop(-(k + 1))  # negative: drop the k + 1 new positions (transformers 4.57 and 5.x)
        return took

    forward(0)  # warm-up; a shape's first forward costs little more than its next ones, so all of them count
    times: dict[int, list[float]] = {0: [], **{k: [] for k in ks}}
    started = time.perf_counter()
    for repeat in range(max(repeats, 1)):
        if repeat and time.perf_counter() - started > budget_seconds:
            break
        for k in ks if not repeat else [k for k in ks if k <= SHORT_DRAFTS]:
            times[0].append(forward(0))
            times[k].append(forward(k))
    if not times[0]:
        times[0] = [forward(0) for _ in range(max(repeats, 1))]
    step = min(times[0])
    return {k: min(t) / step for k, t in times.items() if k}, step


@torch.inference_mode()
def measure_draft_cost(target: Any, drafter: Any, step_seconds: float, context_length: int = 256,
                       repeats: int = 3) -> tuple[float, float]:
    """(a drafter round scoring 2 slots, one scoring the whole block), each / ``step_seconds``: one forward over
    ``[anchor, MASK x (B-1)]`` reading one new context row on a cached context, then the draft head."""
    device = drafter.device
    block_size = drafter.config.block_size
    features = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    context = torch.randn(1, context_length + 1, features, generator=generator).to(device, drafter.dtype)
    embed = target.get_input_embeddings()
    head = drafter.draft_head(target.get_output_embeddings())  # scored in its own dtype, as in a round
    cache = DynamicCache()
    block = drafter.block_embeddings(torch.zeros(1, dtype=torch.long, device=device), embed)
    drafter(target_hidden=context[:, :context_length], noise_embedding=block,
            position_ids=torch.arange(context_length + block_size, device=device)[None], past_key_values=cache,
            use_cache=True)
    cache.crop(-block_size)
    positions = torch.arange(context_length, context_length + 1 + block_size, device=device)[None]

    def round_(rows: int) -> None:
        hidden = drafter(target_hidden=context[:, context_length:], noise_embedding=block, position_ids=positions,
                         past_key_values=cache, use_cache=True)
        cache.crop(-(block_size + 1))
        drafter.compute_logits(hidden[0, 1 : rows + 1], head).softmax(-1).amax(-1)

    chunk = min(2, block_size - 1)
    times = {chunk: [], block_size - 1: []}
    for repeat in range(repeats + 1):
        for rows in times:
            took = timed(lambda: round_(rows), device)
            if repeat:
                times[rows].append(took)
    return min(times[chunk]) / step_seconds, min(times[block_size - 1]) / step_seconds


def measure_costs(target: Any, drafter: Any, max_drafts: int = 16, context_length: int = 256,
                  repeats: int = 5) -> MachineCosts:
    """This machine's :class:`MachineCosts` for ``target`` and ``drafter`` (about 1-3 s for a 135M target on 2 CPU
    cores)."""
    max_drafts = max(max_drafts, drafter.config.block_size - 1)
    ratios, step = _verify_ratios(target, max_drafts, context_length, repeats, PROBE_POINTS)
    chunk, full = measure_draft_cost(target, drafter, step, context_length, repeats)
    return MachineCosts(tuple(_relative(ratios, max_drafts)), chunk, full, step, drafter_first(drafter.device))
