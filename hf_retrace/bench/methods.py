"""The benchmark's decoding methods: how each calls ``generate`` and which drafter settings it needs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..configuration import RETRACE_ABLATIONS
from ..generation.policy import RoundPolicy, shipped_policy

__all__ = ["ALL_METHODS", "DEFAULT_METHODS", "MAIN_DRAFTER", "OWN_DRAFTER_NAMES", "PROMPT_LOOKUP_NUM_TOKENS", "Method",
           "drafts_nothing"]

PROMPT_LOOKUP_NUM_TOKENS = 10
STATIC_CUTS = (None, 0.3, 0.5, 0.65)  # the small static grid the tuned default is checked against
STATIC_CAPS = (4, 8, 16)
MAIN_DRAFTER = "default"  # the --drafter key of the drafter every drafting method uses unless given its own
KERNEL_FIELDS = ("onednn_from", "drafter_onednn")  # how the machine runs a forward, not a round's choice


def _fixed(drafter: Any, policy: RoundPolicy) -> Any:
    """A view that runs ``policy``'s rounds (no guard: it has no costs) on the kernels the call's own policy was priced
    with (the tuned one's :data:`KERNEL_FIELDS`), so a fixed policy is compared with the default on the same forwards:
    every other field replaces the call's."""
    fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)
              if f.name not in KERNEL_FIELDS and f.name != "origin"}
    return drafter.with_policy(**fields)


@dataclass(frozen=True)
class Method:
    """One decoding method: how ``generate`` is called and which drafter settings it needs.

    Example::

        ALL_METHODS["retrace+lookup"]  # Method(name="retrace+lookup", kind="drafter", retrace=True, lookup=True)
    """

    name: str
    kind: str  # "plain" | "plain-no-onednn" | "prompt-lookup" | "native" | "drafter"
    retrace: bool = False
    ablation: str = "full"
    description: str = ""
    lookup: bool = False  # the hybrid: context lookup rounds inside our generator
    full_block: bool = False  # the adaptive block cut off (every round drafts block_size - 1 slots)
    policy: str = "tuned"  # "as-user": the call's own resolution; "tuned": changes on top of it; "shipped"; "static"
    static: tuple[float | None, int, int] | None = None  # a static policy's (confidence cut, lookup start, cap)

    def drafter_view(self, drafter: Any) -> Any:
        """The drafter as this method runs it: a view with the method's round policy (nothing shared is changed).

        ``default`` is exactly what a user gets (the tuned policy, or ``HF_RETRACE_POLICY``); ``shipped`` the drafter's
        config constants; ``static-*`` a fixed policy without the guard; the others force drafting with their switches
        on top of the tuned policy (its cut, lookup budget and guard)."""
        if self.policy == "as-user":
            return drafter.with_policy()
        base = shipped_policy(drafter.config)
        if self.policy == "shipped":
            return _fixed(drafter, base)
        if self.policy == "static":
            cut, start, cap = self.static
            return _fixed(drafter, base.replace(confidence_cut=cut, lookup=True, lookup_start=start, lookup_cap=cap,
                                                retrace=False, source=f"static {self.name}"))
        changes = {"speculate": True, "lookup": self.lookup, "retrace": self.retrace,
                   "retrace_ablation": self.ablation, "kept_suffix_stats": self.retrace or self.full_block}
        if self.full_block:
            changes["confidence_cut"] = None
        return drafter.with_policy(**changes)

    @property
    def decodes_plainly(self) -> bool:
        """Plain ``generate`` (tau 1, no rounds): the reference, or plain decoding with oneDNN off."""
        return self.kind in ("plain", "plain-no-onednn")

    @property
    def onednn(self) -> bool:
        """Whether the call runs with torch's oneDNN matmuls as the process has them (False: switched off for it)."""
        return self.kind != "plain-no-onednn"

    @property
    def needs_drafter(self) -> bool:
        return self.kind in ("native", "drafter")

    @property
    def drafter_names(self) -> tuple[str, ...]:
        """The ``--drafter NAME=PATH`` names this method reads, first match wins: its own name, then its ablation's."""
        return (self.name, self.ablation) if self.retrace and self.ablation != "full" else (self.name,)


ALL_METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("plain", "plain", description="plain generate (the reference and the speed-up baseline)"),
        Method("plain-no-onednn", "plain-no-onednn", description="plain generate with torch's oneDNN matmuls off "
               "(hf_retrace.machine.onednn_matmuls): on a CPU whose oneDNN bf16 one-token forward is the slower, the faster "
               "plain baseline (docs/bench/2026-12-06-epyc-onednn/)"),
        Method("prompt-lookup", "prompt-lookup", description=f"prompt_lookup_num_tokens={PROMPT_LOOKUP_NUM_TOKENS}"),
        Method("default", "drafter", lookup=True, policy="as-user",
               description="what a user gets: the drafter with the round policy tuned for this machine and temperature "
               "(or HF_RETRACE_POLICY), plain decoding where drafting does not pay"),
        Method("shipped", "drafter", lookup=True, policy="shipped",
               description="the drafter with the static round policy its config ships (no tuning, no guard; the tuned kernels)"),
        *[
            Method(f"static-{'full' if cut is None else cut}-{cap}", "drafter", lookup=True, policy="static",
                   static=(cut, 2, cap), description=f"a static policy: confidence cut {cut}, lookup start 2 cap {cap} (the tuned kernels)")
            for cut in STATIC_CUTS
            for cap in STATIC_CAPS
        ],
        Method("dflash-native", "native", description='transformers speculation_type="dflash", same DFlash weights '
               "(at T>0 it samples its drafts and verifies by rejection sampling)"),
        Method("dflash", "drafter", description="our drafter alone (no lookup), ReTrace off, the tuned cut and proposal "
               "mode (argmax = sample-and-match; sample = rejection sampling)"),
        Method("retrace", "drafter", retrace=True, description="our drafter, ReTrace on"),
        Method("dflash-full-block", "drafter", full_block=True,
               description="our drafter, ReTrace off, adaptive block cut off (every round drafts the whole block)"),
        Method("retrace-full-block", "drafter", retrace=True, full_block=True,
               description="our drafter, ReTrace on, full blocks (where rejected suffixes are kept in most rounds)"),
        Method("dflash+lookup", "drafter", lookup=True,
               description="the hybrid: context lookup where the newest tokens occurred before, else the drafter"),
        Method("retrace+lookup", "drafter", retrace=True, lookup=True, description="the hybrid with ReTrace on"),
        *[
            Method(f"retrace-{a}", "drafter", retrace=True, ablation=a, description=f"ReTrace ablation {a}")
            for a in RETRACE_ABLATIONS
            if a != "full"
        ],
        # the ablations where the module has material: full blocks keep a rejected suffix in almost every round
        *[
            Method(f"retrace-{a}-full-block", "drafter", retrace=True, ablation=a, full_block=True,
                   description=f"ReTrace ablation {a}, full blocks")
            for a in RETRACE_ABLATIONS
            if a != "full"
        ],
    ]
}
DEFAULT_METHODS = ("plain", "prompt-lookup", "default", "shipped", "dflash")
# the NAMEs of --drafter NAME=PATH: a drafting method, or an ablation (its own drafter for retrace-ABLATION)
OWN_DRAFTER_NAMES = frozenset([*[n for n, m in ALL_METHODS.items() if m.needs_drafter],
                               *[a for a in RETRACE_ABLATIONS if a != "full"]])


def drafts_nothing(method_name: str) -> bool:
    """Whether a report row's method decodes plainly (the reference, or plain decoding on other kernels): its partings
    from plain are the kernels', never a losslessness bug."""
    method = ALL_METHODS.get(method_name)
    return method is not None and method.decodes_plainly
