"""The round policy: every choice a speculative round makes, as one frozen value, with the pure rules it implies.

A call's choices (where to cut the drafter's block, when context lookup proposes instead and how much, sampled or
argmax proposals, ReTrace on or off, whether to speculate at all) are a property of the machine and the temperature,
not of the drafter's weights. They live here, once: the generator asks a :class:`RoundPolicy` each round, and the
replay that tunes the policy (:mod:`hf_retrace.tuning`) walks the very same methods. A call never changes a policy;
it is handed one (``drafter.with_policy(policy)``, or resolved per call, see :func:`resolve_policy`).

Example::

    policy = RoundPolicy(confidence_cut=0.3, lookup=True, lookup_cap=16)
    out = target.generate(**inputs, assistant_model=drafter.with_policy(policy))
    policy.cut([0.9, 0.8, 0.2, 0.9])   # 2: slot 1 always, slot 2 is confident, slot 3 is not
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..configuration import PROPOSAL_MODES, RETRACE_ABLATIONS

__all__ = ["FIELD_RULES", "GUARD_NOISE_Z", "CacheOrigin", "CallObserver", "PolicyResolver", "RoundGuard", "RoundPolicy",
           "check_view", "confident_prefix", "field_problem", "resolve_policy", "shipped_policy", "verify_cost",
           "view_policy"]


LOOKUP_COST = 0.01  # a lookup round's own work (the n-gram index), in one-token target steps


def confident_prefix(confidences: Sequence[float], threshold: float | None) -> int:
    """How many slots a round drafts (the adaptive block): slot 1 always, then each next slot while its top
    probability stays at or above ``threshold`` (``None``: the whole block)."""
    if threshold is None:
        return len(confidences)
    k = 1
    while k < len(confidences) and confidences[k] >= threshold:
        k += 1
    return k


def verify_cost(verify_costs: Sequence[float], k: int) -> float:
    """``verify_costs[k]`` (the target's forward over ``k`` drafts + 1, in one-token steps), extended past its end
    along its last step (a lookup round may propose more than a block)."""
    last = len(verify_costs) - 1
    if k <= last or last == 0:
        return verify_costs[min(k, last)]
    return verify_costs[last] + (verify_costs[last] - verify_costs[last - 1]) * (k - last)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


_BOOL = (lambda v: isinstance(v, bool), "must be true or false")
_COUNT = (lambda v: _is_int(v) and v >= 1, "must be a whole number >= 1 (not a fraction, not 2.0)")
_TEXT = (lambda v: isinstance(v, str), "must be a string")
# every field a policy can arrive with (a view's changes, a file, a cache entry), with what it expects: one rule each
FIELD_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "speculate": _BOOL,
    "confidence_cut": (lambda v: v is None or (_is_real(v) and 0.0 <= v < 1.0),
                       "must be a number in [0, 1), or null / None for full blocks"),
    "lookup": _BOOL,
    "lookup_min_ngram": _COUNT,
    "lookup_max_ngram": _COUNT,
    "lookup_start": _COUNT,
    "lookup_cap": _COUNT,
    "proposal_mode": (lambda v: v in PROPOSAL_MODES, f"must be one of {', '.join(PROPOSAL_MODES)}"),
    "retrace": _BOOL,
    "retrace_ablation": (lambda v: v in RETRACE_ABLATIONS, f"must be one of {', '.join(RETRACE_ABLATIONS)}"),
    "kept_suffix_stats": _BOOL,
    "one_transfer": (lambda v: v is None or isinstance(v, bool), "must be true, false or null / None"),
    "verify_costs": (lambda v: v is None or (isinstance(v, (list, tuple)) and len(v) >= 2
                                             and all(_is_real(c) and c > 0 for c in v)),
                     "must be null / None or a list of at least two positive numbers (k = 0 and 1 drafts)"),
    "draft_cost": (lambda v: v is None or (_is_real(v) and v >= 0), "must be null / None or a number >= 0"),
    "lookup_cost": (lambda v: _is_real(v) and v >= 0, "must be a number >= 0"),
    "onednn_from": (lambda v: _is_int(v) and v >= 0,
                    "must be a whole number >= 0 (the narrowest target forward, in new tokens, that keeps torch's "
                    "oneDNN; 0: every forward as the process runs it)"),
    "drafter_onednn": _BOOL,
    "source": _TEXT,
    "reason": _TEXT,
    "expected_speedup": (lambda v: v is None or (_is_real(v) and v > 0), "must be null / None or a number > 0"),
    "price": (lambda v: v is None or (_is_real(v) and v > 0), "must be null / None or a number > 0"),
}


def field_problem(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` for the round-policy field ``name`` ("must be ..., got ..."), or None when it fits:
    the one check every way a policy arrives goes through (a view's changes, ``HF_RETRACE_POLICY``'s file, a cache
    entry, ``hf-retrace tune --json``'s file)."""
    if name not in FIELD_RULES:
        return f"is not a round-policy field (known: {', '.join(FIELD_RULES)})"
    fits, expected = FIELD_RULES[name]
    try:
        ok = bool(fits(value))
    except TypeError:  # e.g. an unhashable value for a choice
        ok = False
    return None if ok else f"{expected}, got {value!r}"


def check_view(policy: Any, changes: dict[str, Any], where: str = "drafter.with_policy") -> None:
    """Refuse a view's arguments before any target forward: ``policy`` must be a :class:`RoundPolicy` (or None) and
    each change a known field with a value of the right type and range. Raises a ``ValueError`` that names them."""
    if policy is not None and not isinstance(policy, RoundPolicy):
        hint = " (RoundPolicy.from_dict(...) reads a dict)" if isinstance(policy, dict) else ""
        raise ValueError(f"{where}: the first argument must be a hf_retrace.RoundPolicy or None, got "
                         f"{type(policy).__name__} {policy!r}{hint}; for single fields pass keywords, e.g. "
                         f"{where}(lookup_cap=16).")
    found = [f"{name} {problem}" for name, value in changes.items()
             if (problem := field_problem(name, value)) is not None]
    if found:
        raise ValueError(f"{where}: " + "; ".join(found) + ".")


@dataclass(frozen=True)
class CacheOrigin:
    """Where a tuned policy was read from, for the checks its calls feed (``tuning.auto``): the cache entry's
    ``digest`` and ``temperature`` name ("greedy" or "sampled"), the one-token step its figures are counted in, the
    batch size it was tuned at, how often it was measured again, whether this call drafts to check a cached
    choice of plain decoding (``probe``), and the real speed-up per unit of that figure measured at tuning
    (``clock_price``, :attr:`hf_retrace.tuning.costs.MachineCosts.clock_price`; None where not measured). Not part of
    the policy's value: equal policies compare equal whatever their origin."""

    digest: str
    temperature: str
    step_seconds: float | None = None
    rows: int = 1
    revisits: int = 0
    probe: bool = False
    clock_price: float | None = None


@dataclass(frozen=True)
class RoundPolicy:
    """What every round of one ``generate`` call does. Frozen: a call is handed one and never changes it.

    - ``speculate``: False decodes plainly (no drafter forward at all); ``reason`` says why.
    - ``confidence_cut``: a drafter round drafts slot 1, then each next slot while the drafter's own top probability
      stays at or above it (:func:`confident_prefix`); ``None``: the whole block.
    - ``lookup``: context lookup proposes first where the newest ``lookup_min_ngram..lookup_max_ngram`` tokens occurred
      earlier; its budget starts at ``lookup_start``, doubles after a fully accepted lookup block and falls back after
      a rejection, never above ``lookup_cap`` (:meth:`next_lookup_budget`).
    - ``proposal_mode`` (under sampling), ``retrace`` / ``retrace_ablation`` (use the drafter's ReTrace module);
      ``kept_suffix_stats``: score how often a kept rejected token is later committed (ReTrace's premise; research
      statistics that cost host transfers every round, so off unless asked for).
    - ``one_transfer``: True asks for the accelerator's transfer order, False for the CPU's; None: by the drafter's
      device. Sampled proposals and per-slot processors keep the CPU order (:func:`~hf_retrace.generation.proposal.
      one_transfer`, the rule the generator and the cost model share).
    - ``verify_costs`` / ``draft_cost``: the machine's measured costs in one-token target steps (``verify_costs[k]``
      for ``k`` drafts); when present, a :class:`RoundGuard` backs off drafting while recent rounds commit fewer
      tokens per step-cost than plain decoding does.
    - ``onednn_from`` / ``drafter_onednn``: the matmul kernels each forward runs on a CPU where torch's oneDNN is the
      slower for narrow forwards (measured by the tuner, :func:`hf_retrace.tuning.costs.measure_costs`): the target's
      forwards over fewer than ``onednn_from`` new tokens (rows times positions; plain decoding's step, the guard's,
      short verifies) run with oneDNN off, wider ones as the process runs them (0: all of them); the drafter's round
      runs with oneDNN off where ``drafter_onednn`` is False. The costs above are priced so.
    - ``source``: where the policy came from (``shipped``, ``tuned``, ``explicit``, ``env``, ``file``).
    - ``expected_speedup`` / ``price`` (tuned policies): the replay's tokens per step-cost, and this machine's measured
      price of its real rounds (real calls' speed-up over plain ``generate`` / the replay's figure for the same rounds,
      :func:`hf_retrace.tuning.verify.measure_price`); the speed-up a call can expect is their product.
    """

    speculate: bool = True
    confidence_cut: float | None = None
    lookup: bool = False
    lookup_min_ngram: int = 2
    lookup_max_ngram: int = 4
    lookup_start: int = 2
    lookup_cap: int = 10
    proposal_mode: str = "argmax"
    retrace: bool = False
    retrace_ablation: str = "full"
    kept_suffix_stats: bool = False
    one_transfer: bool | None = None
    verify_costs: tuple[float, ...] | None = None
    draft_cost: float | None = None
    lookup_cost: float = LOOKUP_COST
    onednn_from: int = 0
    drafter_onednn: bool = True
    source: str = "explicit"
    reason: str = ""
    expected_speedup: float | None = None  # the replay's tokens per step-cost (tuned policies only)
    price: float | None = None  # real calls' speed-up over plain generate / the replay's figure on the same rounds
    origin: CacheOrigin | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid round policy: " + "; ".join(problems) + ".")
        if self.verify_costs is not None:
            object.__setattr__(self, "verify_costs", tuple(float(c) for c in self.verify_costs))

    def problems(self) -> list[str]:
        """What is wrong with this policy's values, one phrase each naming the field and what it expects (empty when
        it is valid): types first (a JSON ``2.0`` is not a lookup budget), then ranges, then fields read together."""
        found = [f"{name} {problem}" for name in FIELD_RULES
                 if (problem := field_problem(name, getattr(self, name))) is not None]
        if found:
            return found
        if self.lookup_min_ngram > self.lookup_max_ngram:
            found.append(f"lookup needs lookup_min_ngram <= lookup_max_ngram, got {self.lookup_min_ngram} and "
                         f"{self.lookup_max_ngram}")
        return found

    # --- the pure rules the generator asks each round ------------------------------------------------------------
    def cut(self, confidences: Sequence[float]) -> int:
        """How many of a drafter block's slots to draft, given the drafter's top probability at each slot."""
        return confident_prefix(confidences, self.confidence_cut)

    def first_lookup_budget(self) -> int:
        """A call's first lookup budget."""
        return min(self.lookup_start, self.lookup_cap)

    def next_lookup_budget(self, drafted: int, accepted: int) -> int:
        """The next lookup round's budget after one that proposed ``drafted`` tokens and had ``accepted`` taken.

        A fully accepted block doubles it (the context is looping: longer proposals pay); a rejection drops it back to
        ``max(lookup_start, accepted + 1)``. Never above ``lookup_cap``.
        """
        grown = 2 * drafted if accepted >= drafted else max(self.lookup_start, accepted + 1)
        return min(grown, self.lookup_cap)

    def round_cost(self, drafted: int, from_lookup: bool) -> float:
        """A round's cost in one-token target steps under this policy's measured costs (1 + drafted when unknown)."""
        if self.verify_costs is None:
            return 1.0 + drafted
        return (self.lookup_cost if from_lookup else (self.draft_cost or 0.0)) + verify_cost(self.verify_costs, drafted)

    def guard(self, rows: int = 1) -> "RoundGuard | None":
        """A fresh per-call guard when this policy knows the machine's costs (None otherwise), at batch 1 only: in a
        batch of ``rows`` > 1 a row that backs off saves nothing (the drafter runs for every row, and the verify is as
        wide as the widest row), it only forgoes its drafts; there the tuner's real A/B decides (docs/design/batching.md).
        """
        return RoundGuard(self) if self.verify_costs is not None and rows == 1 else None

    # --- values ----------------------------------------------------------------------------------------------------
    def replace(self, **changes: Any) -> "RoundPolicy":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("origin")
        if data["verify_costs"] is not None:
            data["verify_costs"] = [round(c, 4) for c in data["verify_costs"]]
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str = "round policy") -> "RoundPolicy":
        """A policy from :meth:`to_dict`'s output, checked field by field (:func:`field_problem`); anything else is a
        ``ValueError`` that starts with ``where`` (the file or argument it came from) and names the field and what it
        expects."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object of round-policy fields (RoundPolicy.to_dict()), got "
                             f"{type(data).__name__}.")
        names = [name for name in FIELD_RULES]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"{where}: unknown round-policy fields {unknown}; known: {sorted(names)}.")
        try:
            return cls(**data)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    def kernels(self) -> str:
        """The forwards this policy runs without torch's oneDNN, in words ("" where none)."""
        parts = []
        if self.onednn_from > 1:
            parts.append(f"target forwards under {self.onednn_from} new tokens without oneDNN")
        if not self.drafter_onednn and self.speculate:
            parts.append("the drafter without oneDNN")
        return "; ".join(parts)

    def describe(self) -> str:
        """One line a user can look up in the README: what rounds this policy runs, and why."""
        if not self.speculate:
            kernels = f" [{self.kernels()}]" if self.kernels() else ""
            return f"plain decoding (no drafting){kernels}{': ' + self.reason if self.reason else ''}"
        cut = "full blocks" if self.confidence_cut is None else f"confidence cut {self.confidence_cut:g}"
        lookup = (f"context lookup {self.lookup_min_ngram}-{self.lookup_max_ngram}-grams, budget "
                  f"{self.lookup_start}..{self.lookup_cap}") if self.lookup else "no context lookup"
        parts = [f"DFlash drafter, {cut}", lookup, f"ReTrace {'on' if self.retrace else 'off'}"]
        if self.proposal_mode != "argmax":
            parts.append(f"{self.proposal_mode} proposals")
        if self.kernels():
            parts.append(self.kernels())
        text = "; ".join(parts) + f" (policy: {self.source}"
        if self.expected_speedup is not None:
            text += f", replayed {self.expected_speedup:.2f} tokens per step-cost"
            if self.price is not None:
                text += f", about {self.predicted_speedup:.2f}x plain at this machine's measured price"
        return text + ")"

    @property
    def predicted_speedup(self) -> float | None:
        """The speed-up over plain ``generate`` a tuned policy predicts: its replayed tokens per step-cost times this
        machine's measured price of real rounds, where measured (None without a replayed figure)."""
        if self.expected_speedup is None:
            return None
        return self.expected_speedup * (self.price if self.price is not None else 1.0)


GUARD_NOISE_Z = 1.0  # the guard backs off a window below plain by more than this many of its standard deviations


class RoundGuard:
    """Never slower than plain, within a call: backs off drafting while the recent rounds commit fewer tokens per
    step-cost than plain decoding's 1, and drafts again after a back-off period.

    Plain decoding commits one token per step. The guard keeps the last ``window`` drafting rounds; when they are
    full and their tokens fall short of ``1 - margin`` per step-cost by more than their own noise, the next
    ``backoff`` positions decode plainly (no drafter forward); each back-off in a row doubles the period (up to
    ``max_backoff``), a window that pays resets it. The noise: ``noise_z`` standard deviations of a round's excess
    (its tokens minus its step-cost, over the call so far) times ``sqrt(window)``. Acceptance comes in bursts, so
    on text where drafting pays a window of 8 rounds often reads below plain by chance (0: any shortfall backs off,
    as before issue 41's replication; it backed off 8-32 % of the dev sets' positions at T=0); where every draft
    fails the rounds hardly spread, the allowance is near 0 and the guard backs off at the first window.

    A round's step-cost is the policy's measured cost (:meth:`RoundPolicy.round_cost`) until the call has timed
    ``clock_after`` of its own plain steps (:meth:`note_plain`, the first back-off's); from then on, where the caller
    gives a round's wall time, it is that time over the median of the call's latest plain steps: a back-off is then
    decided by what drafting and plain decoding cost in this call, at the machine's speed of the moment, never by a
    cost model that is off on this text or this minute (the generator gives both times; the replay, which has no
    clock, prices every round by the model).

    Example::

        guard = policy.guard()
        if guard.drafts_at(position): ...; guard.record(position, drafted, accepted, from_lookup, seconds)
        else: ...; guard.note_plain(seconds)
    """

    def __init__(self, policy: RoundPolicy, window: int = 8, margin: float = 0.0, first_backoff: int = 4,
                 max_backoff: int = 64, clock_after: int = 3, plain_kept: int = 16, noise_z: float = GUARD_NOISE_Z):
        self.policy, self.window, self.margin, self.noise_z = policy, window, margin, noise_z
        self.first_backoff, self.max_backoff = first_backoff, max_backoff
        self.clock_after, self.plain_kept = clock_after, plain_kept
        self.excess = (0, 0.0, 0.0)  # the call's rounds' tokens minus step-cost: count, mean, sum of squared deviations
        self.recent: list[tuple[int, float]] = []
        self.backoff = first_backoff
        self.plain_until = -1  # positions before this one decode plainly
        self.plain_seconds: list[float] = []  # the call's latest plain steps, timed
        self.clocked_rounds = 0  # rounds priced by their wall time

    def drafts_at(self, position: int) -> bool:
        """Whether a round anchored at ``position`` may draft (False: the target steps alone)."""
        return position >= self.plain_until

    def note_plain(self, seconds: float) -> None:
        """Count the wall time of one plain step of this call (the guard's or one with no room to draft)."""
        if seconds > 0:
            self.plain_seconds = [*self.plain_seconds, seconds][-self.plain_kept:]

    @property
    def step_seconds(self) -> float | None:
        """The median of the call's latest plain steps, once ``clock_after`` are timed (else None)."""
        return statistics.median(self.plain_seconds) if len(self.plain_seconds) >= self.clock_after else None

    @property
    def excess_sd(self) -> float:
        """The standard deviation of a round's excess (tokens committed minus its step-cost) over the call so far (0
        before two rounds)."""
        n, _, squares = self.excess
        return math.sqrt(squares / (n - 1)) if n > 1 else 0.0

    def record(self, position: int, drafted: int, accepted: int, from_lookup: bool,
               seconds: float | None = None) -> None:
        """Count a verified round anchored at ``position`` (its wall time ``seconds`` where timed); back off when the
        window falls below plain."""
        step = self.step_seconds
        if seconds is not None and step is not None:
            cost = seconds / step
            self.clocked_rounds += 1
        else:
            cost = self.policy.round_cost(drafted, from_lookup)
        self.recent.append((accepted + 1, cost))
        n, mean, squares = self.excess  # Welford's running mean and variance of a round's excess
        excess = accepted + 1 - cost
        moved = mean + (excess - mean) / (n + 1)
        self.excess = (n + 1, moved, squares + (excess - mean) * (excess - moved))
        if len(self.recent) < self.window:
            return
        self.recent = self.recent[-self.window:]
        tokens = sum(t for t, _ in self.recent)
        cost = sum(c for _, c in self.recent)
        plain = (1.0 - self.margin) * cost  # what plain decoding commits in the window's step-cost
        if tokens < plain - self.noise_z * self.excess_sd * math.sqrt(self.window):
            self.plain_until = position + accepted + 1 + self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)
            self.recent = []
        elif tokens >= plain:  # a window that pays resets the period; one below plain within the noise keeps it
            self.backoff = self.first_backoff


def shipped_policy(config: Any) -> RoundPolicy:
    """The drafter's own static policy, as its :class:`~hf_retrace.ReTraceConfig` stores it (the constants a drafter
    was published with)."""
    return RoundPolicy(
        confidence_cut=config.draft_confidence_threshold,
        lookup=config.lookup,
        lookup_min_ngram=config.lookup_min_ngram,
        lookup_max_ngram=config.lookup_max_ngram,
        lookup_start=config.lookup_start_tokens,
        lookup_cap=config.lookup_num_tokens,
        proposal_mode=config.proposal_mode,
        retrace=config.retrace == "trained",  # an untrained module drafts as the backbone: off unless asked for
        retrace_ablation=config.retrace_ablation,
        source="shipped",
    )


# --- which policy a call gets ---------------------------------------------------------------------------------------
# the function that picks a call's policy when its drafter view gives none: (drafter, target, generation_config[,
# rows=B for a batch]); ``import hf_retrace`` hands :func:`hf_retrace.tuning.auto.auto_policy` to the dispatch
PolicyResolver = Callable[..., RoundPolicy]
# the function told, after each drafted call, its policy and its generators' stats (``import hf_retrace`` hands the
# dispatch :func:`hf_retrace.tuning.realized.note_realized`: a tuned prediction checked against real calls)
CallObserver = Callable[[RoundPolicy, Sequence[Any]], None]


def resolve_policy(drafter: Any, target: Any, generation_config: Any, rows: int = 1,
                   resolver: PolicyResolver | None = None) -> RoundPolicy:
    """The policy of one call, first match wins: the drafter view's own (``drafter.with_policy(policy)``); else
    ``resolver``'s (the dispatch's: ``HF_RETRACE_POLICY``, then the policy tuned for this machine,
    :func:`hf_retrace.tuning.auto.auto_policy`; a batch of ``rows`` > 1 rows is passed to it as ``rows=``, as each batch
    size is tuned apart); else (no resolver) the drafter's shipped one. Changes given as
    ``drafter.with_policy(**changes)`` apply on top (:func:`view_policy`: a drafting knob drafts even over a plain
    policy).

    Example: ``resolve_policy(drafter, target, target.generation_config, resolver=auto_policy)``.
    """
    policy = getattr(drafter, "round_policy", None)
    changes = getattr(drafter, "policy_changes", None) or {}
    check_view(policy, changes)  # a bad view is refused before tuning and before any target forward
    if policy is None:
        if resolver is None:
            policy = shipped_policy(drafter.config)
        else:
            policy = resolver(drafter, target, generation_config, **({"rows": rows} if rows > 1 else {}))
    if not changes:
        return policy
    try:
        return view_policy(policy, changes)
    except ValueError as error:  # the changes fit alone but not together with the policy under them
        given = ", ".join(f"{name}={value!r}" for name, value in changes.items())
        raise ValueError(f"drafter.with_policy({given}) on top of the {policy.source} policy: {error}") from None


# the knobs that shape drafting: a view that sets one asks for drafting (switching ReTrace off asks for nothing)
DRAFTING_FIELDS = ("confidence_cut", "lookup", "lookup_min_ngram", "lookup_max_ngram", "lookup_start", "lookup_cap",
                   "proposal_mode", "retrace", "retrace_ablation")


def view_policy(policy: RoundPolicy, changes: dict[str, Any]) -> RoundPolicy:
    """``changes`` (a view's ``with_policy(**changes)``) on top of ``policy``. Precedence (docs/round-policy.md): an
    explicit ``speculate`` in the changes wins; else a change to a drafting knob (:data:`DRAFTING_FIELDS`, ReTrace
    off excepted) drafts even where ``policy`` decodes plainly (a tuned plain policy keeps the machine's costs, so the
    guard still backs off inside the call); else ``policy``'s own ``speculate`` stands."""
    asks_drafting = any(name in DRAFTING_FIELDS and not (name == "retrace" and value is False)
                        for name, value in changes.items())
    if asks_drafting and not policy.speculate and "speculate" not in changes:
        changes = {"speculate": True, "source": "explicit", "reason": "", "expected_speedup": None, **changes}
    return policy.replace(**changes)
