"""The benchmark's decoding methods: how each calls ``generate`` and which drafter settings it needs."""

from __future__ import annotations

from dataclasses import dataclass

from ..configuration import RETRACE_ABLATIONS

__all__ = ["ALL_METHODS", "DEFAULT_METHODS", "MAIN_DRAFTER", "OWN_DRAFTER_NAMES", "PROMPT_LOOKUP_NUM_TOKENS", "Method"]

PROMPT_LOOKUP_NUM_TOKENS = 10
MAIN_DRAFTER = "default"  # the --drafter key of the drafter every drafting method uses unless given its own


@dataclass(frozen=True)
class Method:
    """One decoding method: how ``generate`` is called and which drafter settings it needs.

    Example::

        ALL_METHODS["retrace+lookup"]  # Method(name="retrace+lookup", kind="drafter", use_retrace=True, lookup=True)
    """

    name: str
    kind: str  # "plain" | "prompt-lookup" | "native" | "drafter"
    use_retrace: bool = False
    ablation: str = "full"
    description: str = ""
    lookup: bool = False  # the hybrid: context lookup rounds inside our generator
    full_block: bool = False  # the adaptive block cut off (every round drafts block_size - 1 slots)

    @property
    def needs_drafter(self) -> bool:
        return self.kind in ("native", "drafter")

    @property
    def drafter_names(self) -> tuple[str, ...]:
        """The ``--drafter NAME=PATH`` names this method reads, first match wins: its own name, then its ablation's."""
        return (self.name, self.ablation) if self.use_retrace and self.ablation != "full" else (self.name,)


ALL_METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("plain", "plain", description="plain generate (the reference and the speed-up baseline)"),
        Method("prompt-lookup", "prompt-lookup", description=f"prompt_lookup_num_tokens={PROMPT_LOOKUP_NUM_TOKENS}"),
        Method("dflash-native", "native", description='transformers speculation_type="dflash", same DFlash weights '
               "(at T>0 it samples its drafts and verifies by rejection sampling)"),
        Method("dflash", "drafter", description="our drafter, ReTrace off (at T>0 the drafter's proposal_mode "
               "decides: argmax = sample-and-match, the default; sample = rejection sampling)"),
        Method("retrace", "drafter", use_retrace=True, description="our drafter, ReTrace on"),
        Method("dflash-full-block", "drafter", full_block=True,
               description="our drafter, ReTrace off, adaptive block cut off (every round drafts the whole block)"),
        Method("retrace-full-block", "drafter", use_retrace=True, full_block=True,
               description="our drafter, ReTrace on, full blocks (where rejected suffixes are kept in most rounds)"),
        Method("dflash+lookup", "drafter", lookup=True,
               description="the hybrid: context lookup where the newest tokens occurred before, else the drafter"),
        Method("retrace+lookup", "drafter", use_retrace=True, lookup=True, description="the hybrid with ReTrace on"),
        *[
            Method(f"retrace-{a}", "drafter", use_retrace=True, ablation=a, description=f"ReTrace ablation {a}")
            for a in RETRACE_ABLATIONS
            if a != "full"
        ],
        # the ablations where the module has material: full blocks keep a rejected suffix in almost every round
        *[
            Method(f"retrace-{a}-full-block", "drafter", use_retrace=True, ablation=a, full_block=True,
                   description=f"ReTrace ablation {a}, full blocks")
            for a in RETRACE_ABLATIONS
            if a != "full"
        ],
    ]
}
DEFAULT_METHODS = ("plain", "prompt-lookup", "dflash-native", "dflash", "retrace")
# the NAMEs of --drafter NAME=PATH: a drafting method, or an ablation (its own drafter for retrace-ABLATION)
OWN_DRAFTER_NAMES = frozenset([*[n for n, m in ALL_METHODS.items() if m.needs_drafter],
                               *[a for a in RETRACE_ABLATIONS if a != "full"]])
