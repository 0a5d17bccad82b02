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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..configuration import PROPOSAL_MODES, RETRACE_ABLATIONS

__all__ = ["RoundGuard", "RoundPolicy", "confident_prefix", "resolve_policy", "set_policy_resolver", "shipped_policy",
           "verify_cost"]


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
    - ``verify_costs`` / ``draft_cost``: the machine's measured costs in one-token target steps (``verify_costs[k]``
      for ``k`` drafts); when present, a :class:`RoundGuard` backs off drafting while recent rounds commit fewer
      tokens per step-cost than plain decoding does.
    - ``source``: where the policy came from (``shipped``, ``tuned``, ``explicit``, ``env``, ``file``).
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
    verify_costs: tuple[float, ...] | None = None
    draft_cost: float | None = None
    lookup_cost: float = LOOKUP_COST
    source: str = "explicit"
    reason: str = ""
    expected_speedup: float | None = None  # the replay's tokens per step-cost (tuned policies only)
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("Invalid round policy: " + "; ".join(problems) + ".")
        if self.verify_costs is not None:
            object.__setattr__(self, "verify_costs", tuple(float(c) for c in self.verify_costs))

    def problems(self) -> list[str]:
        """What is wrong with this policy's values, one phrase each (empty when it is valid)."""
        found = []
        cut = self.confidence_cut
        if cut is not None and not 0.0 <= cut < 1.0:
            found.append(f"confidence_cut must be in [0, 1) or None for full blocks, got {cut!r}")
        if not 1 <= self.lookup_min_ngram <= self.lookup_max_ngram:
            found.append(f"lookup needs 1 <= lookup_min_ngram <= lookup_max_ngram, got {self.lookup_min_ngram} and "
                         f"{self.lookup_max_ngram}")
        if not 1 <= self.lookup_start or self.lookup_cap < 1:
            found.append(f"lookup_start and lookup_cap must be at least 1, got {self.lookup_start} and "
                         f"{self.lookup_cap}")
        if self.proposal_mode not in PROPOSAL_MODES:
            found.append(f"proposal_mode must be one of {PROPOSAL_MODES}, got {self.proposal_mode!r}")
        if self.retrace_ablation not in RETRACE_ABLATIONS:
            found.append(f"retrace_ablation must be one of {RETRACE_ABLATIONS}, got {self.retrace_ablation!r}")
        if self.verify_costs is not None and (len(self.verify_costs) < 2 or min(self.verify_costs) <= 0):
            found.append("verify_costs must hold at least two positive costs (k = 0 and 1 drafts)")
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

    def guard(self) -> "RoundGuard | None":
        """A fresh per-call guard when this policy knows the machine's costs (None otherwise)."""
        return RoundGuard(self) if self.verify_costs is not None else None

    # --- values ----------------------------------------------------------------------------------------------------
    def replace(self, **changes: Any) -> "RoundPolicy":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("extra")
        if data["verify_costs"] is not None:
            data["verify_costs"] = [round(c, 4) for c in data["verify_costs"]]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RoundPolicy":
        """A policy from :meth:`to_dict`'s output; unknown keys are an error that names them."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"Unknown round-policy fields {unknown}; known: {sorted(names)}.")
        return cls(**data)

    def describe(self) -> str:
        """One line a user can look up in the README: what rounds this policy runs, and why."""
        if not self.speculate:
            return f"plain decoding (no drafting){': ' + self.reason if self.reason else ''}"
        cut = "full blocks" if self.confidence_cut is None else f"confidence cut {self.confidence_cut:g}"
        lookup = (f"context lookup {self.lookup_min_ngram}-{self.lookup_max_ngram}-grams, budget "
                  f"{self.lookup_start}..{self.lookup_cap}") if self.lookup else "no context lookup"
        parts = [f"DFlash drafter, {cut}", lookup, f"ReTrace {'on' if self.retrace else 'off'}"]
        if self.proposal_mode != "argmax":
            parts.append(f"{self.proposal_mode} proposals")
        text = "; ".join(parts) + f" (policy: {self.source}"
        if self.expected_speedup is not None:
            text += f", replayed {self.expected_speedup:.2f} tokens per step-cost"
        return text + ")"


class RoundGuard:
    """Never slower than plain, within a call: backs off drafting while the recent rounds commit fewer tokens per
    step-cost (the policy's measured costs) than plain decoding's 1, and drafts again after a back-off period.

    Plain decoding commits one token per step. The guard keeps the last ``window`` drafting rounds; when they are
    full and their tokens per step-cost fall below ``1 - margin``, the next ``backoff`` positions decode plainly (no
    drafter forward); each back-off in a row doubles the period (up to ``max_backoff``), a good window resets it.
    """

    def __init__(self, policy: RoundPolicy, window: int = 8, margin: float = 0.0, first_backoff: int = 4,
                 max_backoff: int = 64):
        self.policy, self.window, self.margin = policy, window, margin
        self.first_backoff, self.max_backoff = first_backoff, max_backoff
        self.recent: list[tuple[int, float]] = []
        self.backoff = first_backoff
        self.plain_until = -1  # positions before this one decode plainly

    def drafts_at(self, position: int) -> bool:
        """Whether a round anchored at ``position`` may draft (False: the target steps alone)."""
        return position >= self.plain_until

    def record(self, position: int, drafted: int, accepted: int, from_lookup: bool) -> None:
        """Count a verified round anchored at ``position``; back off when the window falls below plain."""
        self.recent.append((accepted + 1, self.policy.round_cost(drafted, from_lookup)))
        if len(self.recent) < self.window:
            return
        self.recent = self.recent[-self.window:]
        tokens = sum(t for t, _ in self.recent)
        cost = sum(c for _, c in self.recent)
        if tokens < (1.0 - self.margin) * cost:
            self.plain_until = position + accepted + 1 + self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)
            self.recent = []
        else:
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
PolicyResolver = Callable[[Any, Any, Any], RoundPolicy]
_RESOLVER: list[PolicyResolver | None] = [None]


def set_policy_resolver(resolver: PolicyResolver | None) -> None:
    """Install the function that picks a call's policy when none is given (``import hf_retrace`` installs
    :func:`hf_retrace.tuning.auto.auto_policy`; without one, the drafter's shipped policy)."""
    _RESOLVER[0] = resolver


def resolve_policy(drafter: Any, target: Any, generation_config: Any) -> RoundPolicy:
    """The policy of one call, first match wins: the drafter view's own (``drafter.with_policy(policy)``); else the
    installed resolver's (``HF_RETRACE_POLICY``, then the policy tuned for this machine: :mod:`hf_retrace.tuning.auto`);
    else the drafter's shipped one. Changes given as ``drafter.with_policy(**changes)`` apply on top."""
    policy = getattr(drafter, "round_policy", None)
    if policy is None:
        resolver = _RESOLVER[0]
        policy = shipped_policy(drafter.config) if resolver is None else resolver(drafter, target, generation_config)
    changes = getattr(drafter, "policy_changes", None)
    return policy.replace(**changes) if changes else policy
