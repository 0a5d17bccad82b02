"""Timings a busy moment cannot move: each ratio of a many-token forward to the one-token forwards just around it
(a slowdown that lasts cancels), every point timed at least :data:`MIN_PASSES` times in interleaved passes, the
median kept per point, the curve fitted monotone by isotonic regression (one high point is pooled with its
neighbours, not carried to every longer one), and a spread that says when the repeats disagree. The cost model
(:mod:`.costs`) times the forwards; this module says what the timings mean.

Example::

    ratios, steps = sample_verify_ratios(probe, [1, 2, 4, 8])
    fit = fit_verify_costs(ratios, max_drafts=16)
    fit.costs[3], fit.settled
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..generation.policy import verify_cost

__all__ = ["MIN_PASSES", "SPREAD_LIMIT", "VerifyFit", "fit_verify_costs", "robust_spread", "sample_verify_ratios"]

SHORT_DRAFTS = 4  # verifies this short get the passes past MIN_PASSES (the common case, and the cheap one)
MIN_PASSES = 3  # every timed k at least this often: a median that one blip cannot move
SPREAD_LIMIT = 0.2  # a k's repeats disagree when their robust spread (1.4826 MAD / median) is above this
PLAUSIBLE_SLACK = 0.25  # a verify of k + 1 tokens costs at most (k + 1) one-token steps, plus this share
STEADY_TRIES = 3  # a sample whose two one-token steps disagree (by SPREAD_LIMIT) is timed again, this often at most


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


def sample_verify_ratios(probe: Callable[[int], float], ks: Sequence[int], repeats: int = 5,
                         budget_seconds: float = 1.5, passes: int = MIN_PASSES,
                         deadline: float | None = None) -> tuple[dict[int, list[float]], list[float]]:
    """Per ``k`` in ``ks``: the seconds of ``probe(k)`` (a forward over ``k + 1`` tokens) over the mean of the
    one-token forwards timed just before and just after it, once per pass (timed again, up to :data:`STEADY_TRIES`,
    while those two disagree: the load changed inside the sample); and every one-token forward's seconds.
    Every ``k`` gets ``passes`` passes (odd ones in reverse order, so no ``k`` always follows the same one); the
    verifies of up to :data:`SHORT_DRAFTS` drafts get more, up to ``repeats``, while ``budget_seconds`` last. Past
    ``deadline`` (a ``time.perf_counter()`` value) no sample starts: some ``k`` may then have fewer passes."""
    ratios: dict[int, list[float]] = {k: [] for k in ks}
    phase = random.Random(0)
    steps = [probe(0)]
    started = time.perf_counter()
    for index in range(max(repeats, passes)):
        if index >= passes and time.perf_counter() - started > budget_seconds:
            break
        order = list(ks) if index % 2 == 0 else list(reversed(ks))
        for k in order if index < passes else [k for k in order if k <= SHORT_DRAFTS]:
            if deadline is not None and time.perf_counter() > deadline:
                return ratios, steps
            if phase.random() < 0.5:  # no k always lands on the same beat of a load that comes and goes
                steps.append(probe(0))
            for _ in range(STEADY_TRIES):  # a load that came or went inside the sandwich: time this k again
                took = probe(k)
                steps.append(probe(0))
                if abs(steps[-1] / steps[-2] - 1) <= SPREAD_LIMIT:
                    break
            ratios[k].append(took / ((steps[-2] + steps[-1]) / 2))
    return ratios, steps


@dataclass(frozen=True)
class VerifyFit:
    """The verify curve fitted to paired timings: ``costs[k]`` for k = 0..max (monotone, in one-token steps);
    ``medians`` per timed ``k``; ``spread``: the largest robust spread of a ``k``'s repeats (1.4826 MAD / median);
    ``implausible``: the ``k`` whose median costs more than ``k + 1`` separate steps (plus :data:`PLAUSIBLE_SLACK`)."""

    costs: list[float]
    medians: dict[int, float]
    spread: float
    implausible: tuple[int, ...]

    @property
    def settled(self) -> bool:
        """The timings agree with themselves and with the one-token step: a curve to decide on."""
        return self.spread <= SPREAD_LIMIT and not self.implausible


def _isotonic(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in weighted least squares (pool adjacent violators): a high
    value is averaged with the ones after it until the run is monotone, never copied forward as a running max is."""
    blocks: list[list[float]] = []  # [weighted mean, weight, count]
    for value, weight in zip(values, weights):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (v1, w1, n1), (v2, w2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return [value for value, _, count in blocks for _ in range(count)]


def robust_spread(values: Sequence[float]) -> float:
    """The robust spread of repeats: 1.4826 median absolute deviation over the median."""
    middle = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - middle) for v in values) / middle


def fit_verify_costs(ratios: dict[int, list[float]], max_drafts: int) -> VerifyFit:
    """:class:`VerifyFit` from :func:`sample_verify_ratios`' ratios: the median per ``k``, isotonic over ``k`` (the
    one-token forward, ``k = 0``, pinned at 1), interpolated between timed ``k`` and extended past the longest along
    its last step (:func:`~hf_retrace.generation.policy.verify_cost`)."""
    timed_ks = sorted(k for k, values in ratios.items() if values)
    medians = {k: statistics.median(ratios[k]) for k in timed_ks}
    spread = max((robust_spread(ratios[k]) for k in timed_ks), default=0.0)
    implausible = tuple(k for k in timed_ks if medians[k] > (k + 1) * (1 + PLAUSIBLE_SLACK))
    fitted = _isotonic([1.0] + [medians[k] for k in timed_ks], [1e6] + [len(ratios[k]) for k in timed_ks])
    points = {k: max(1.0, value) for k, value in zip(timed_ks, fitted[1:])}
    costs = _interpolate({0: 1.0, **points}, min(max_drafts, max(timed_ks, default=0)))
    return VerifyFit([verify_cost(costs, k) for k in range(max_drafts + 1)], medians, spread, implausible)
