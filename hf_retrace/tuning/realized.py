"""A cached choice checked against real calls (issue 41, items 2 and 3).

The first calls with this machine's cached drafting choice add up their realized tokens per step-cost, clocked
(:func:`note_realized`), and record the figure once in the cache entry beside the prediction: :mod:`.auto` measures
again where they are more than :data:`REALIZED_TOLERANCE` apart. A cached plain choice is checked by calls that draft
now and then (:func:`probe_or`), priced as the choice was (:func:`.search.pays` at the entry's clock price);
:data:`PROBES` that pay write themselves to the entry, whose next read measures again.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from ..generation.policy import RoundPolicy
from .entries import _LOCK, _MEMO, policy_cache_dir, write_atomically
from .search import pays
from .verify import clocked_cost

__all__ = ["note_realized", "probe_or", "probes_found_drafting", "realized_figure"]

REALIZED_TOKENS = 256  # committed in drafting rounds before the first calls' realized figure is recorded
REALIZED_TOLERANCE = 0.15  # realized vs predicted tokens per step-cost: a wider gap is measured again
PROBE_AFTER = 3  # plain calls (per process and temperature) before the first that drafts to check a plain choice
PROBE_EVERY = 16  # plain calls between two such checks
PROBES = 2  # checks per process; a plain choice is measured again where this many all pay (search.pays, priced)
PROBE_TOKENS = 32  # a check counts once its drafting rounds committed this many tokens (a shorter call: the next)


# --- the first real calls against the prediction --------------------------------------------------------------------
_REALIZED: dict[str, dict[str, list[float] | None]] = {}  # digest -> temperature -> [tokens, step-costs]; None: written


def realized_figure(stats: Any, step_seconds: float) -> tuple[float, float]:
    """``(tokens, step-costs)`` one call committed and paid in its drafting rounds: the tokens of every round plus
    the guard's plain positions, over the rounds' wall time (drafter and verify, as the generator clocks them) in
    one-token steps of ``step_seconds`` plus one step per plain position (:func:`.verify.clocked_cost`)."""
    return float(stats.round_tokens), float(clocked_cost(stats, step_seconds))


def note_realized(policy: RoundPolicy, all_stats: Any) -> None:
    """The call observer ``import hf_retrace`` installs: while this process's first calls with the machine's cached
    choice (unchanged by a view) commit :data:`REALIZED_TOKENS`, add up their realized tokens per step-cost; then
    record it once in the cache entry beside the prediction (the next process start measures again when they are
    more than :data:`REALIZED_TOLERANCE` apart)."""
    origin = policy.origin
    if origin is None or not policy.speculate or origin.rows != 1:
        return  # (a batch's figure is counted per batch step: batch-1 calls check the prediction)
    digest, name = origin.digest, origin.temperature
    if origin.probe:
        _note_probe(policy, digest, name, all_stats)
        return
    with _LOCK:
        memo = _MEMO.get(digest)
        if memo is None or memo[name] != policy:  # a view changed it: not the cached choice's figure
            return
        totals = _REALIZED.setdefault(digest, {}).setdefault(name, [0.0, 0.0])
        if totals is None:  # already recorded in this process
            return
        step = origin.step_seconds
        if not isinstance(step, (int, float)) or step <= 0:
            return
        for stats in all_stats:
            tokens, cost = realized_figure(stats, step)
            totals[0] += tokens
            totals[1] += cost
        if totals[0] < REALIZED_TOKENS or totals[1] <= 0:
            return
        _REALIZED[digest][name] = None  # recorded once per process
        path = policy_cache_dir() / f"{digest}.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            data.setdefault("realized", {})[name] = {"tokens_per_cost": round(totals[0] / totals[1], 3),
                                                     "tokens": int(totals[0]),
                                                     "predicted": policy.expected_speedup}
            write_atomically(path, data)
        except (OSError, ValueError, AttributeError):
            return  # the entry went away or cannot be written: nothing to compare next time


# --- a plain choice checked by real calls that draft (issue 41, item 3) -----------------------------------------------
_PROBES: dict[tuple[str, str], dict[str, Any]] = {}  # (digest, temperature) -> plain calls seen, next check, figures


def probe_or(policy: RoundPolicy) -> RoundPolicy:
    """``policy``, or, where it is this machine's cached choice of plain decoding at batch size 1 and a check is due
    (the call after :data:`PROBE_AFTER` plain ones, then every :data:`PROBE_EVERY`, :data:`PROBES` per process), the
    drafting policy it turned down (its knobs, armed: the guard backs off where drafting loses): the call drafts,
    losslessly, and its realized tokens per step-cost say whether plain was right (:func:`note_realized`). A plain
    choice made in a busy moment, or on a tuner's wrong prediction, so corrects itself; a right one costs one call in
    :data:`PROBE_EVERY` drafting at a small loss, twice per process at most."""
    origin = policy.origin
    if policy.speculate or origin is None or origin.rows != 1 or origin.revisits:
        return policy
    digest, name = origin.digest, origin.temperature
    with _LOCK:
        state = _PROBES.setdefault((digest, name), {"calls": 0, "next": PROBE_AFTER + 1, "figures": []})
        state["calls"] += 1
        if state.get("done") or state["calls"] < state["next"]:
            return policy
        state["next"] = state["calls"] + PROBE_EVERY
    return policy.replace(speculate=True, source="tuned, checking plain", origin=replace(origin, probe=True),
                          reason="a call that drafts to check this machine's cached choice of plain decoding ("
                                 + policy.reason + ")")


def probes_found_drafting(figures: Any, clock_price: float | None) -> bool:
    """:data:`PROBES` checking calls' clocked figures each of which pays at the measured ``clock_price``."""
    return (isinstance(figures, list) and len(figures) >= PROBES
            and all(isinstance(f, (int, float)) and pays(f, clock_price) for f in figures))


def _note_probe(policy: RoundPolicy, digest: str, name: str, all_stats: Any) -> None:
    """Count a checking call's realized tokens per step-cost; a figure that does not pay (:func:`.search.pays` at the
    entry's measured ``clock_price``: the same line the tuner drew at the price of real rounds) confirms plain for this
    process (no more checks), :data:`PROBES` figures that pay are written to the cache entry, whose next read then
    measures again (at once: the next call in this process tunes)."""
    step = policy.origin.step_seconds
    if not isinstance(step, (int, float)) or step <= 0:
        return
    figures = [realized_figure(stats, step) for stats in all_stats]
    tokens, cost = sum(f[0] for f in figures), sum(f[1] for f in figures)
    with _LOCK:
        state = _PROBES.get((digest, name))
        if state is None or state.get("done"):
            return
        if tokens < PROBE_TOKENS or cost <= 0:  # too short to tell: the next plain call checks instead
            state["next"] = state["calls"] + 1
            return
        state["figures"].append(round(tokens / cost, 3))
        if not pays(state["figures"][-1], policy.origin.clock_price) or len(state["figures"]) >= PROBES:
            state["done"] = True
        if not probes_found_drafting(state["figures"], policy.origin.clock_price):
            return
        path = policy_cache_dir() / f"{digest}.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            data.setdefault("probes", {})[name] = state["figures"]
            write_atomically(path, data)
        except (OSError, ValueError, AttributeError):
            return  # the entry went away or cannot be written: the next process tunes or checks again
        _MEMO.pop(digest, None)  # the next call reads the entry, which now says: measure again
