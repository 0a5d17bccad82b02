"""What a round proposes and what its verdict says: the small interface every proposal source shares.

A source (:class:`~hf_retrace.generation.drafter_source.DrafterSource`, :class:`~hf_retrace.generation.lookup_source.
LookupSource`, the replay's recorded drafts) is asked to ``propose`` for the newest committed token and to ``observe``
each verdict; :class:`~hf_retrace.generation.round.Round` sequences them.

Example::

    proposal = Proposal(source="lookup", anchor=11, tokens=ids, host_tokens=[5, 6, 7])
    proposal.cut(2).host_tokens   # [5, 6]
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

__all__ = ["Proposal", "ProposalSource", "RoundInputs", "Verdict", "eos_cut", "on_accelerator", "one_transfer"]


def one_transfer(on_accelerator: bool, sampled_proposals: bool = False, slot_processors: bool = False) -> bool:
    """Whether rounds run in the accelerator order: the drafter's whole block launched before the lookup decision and
    everything the host needs read in one transfer. On an accelerator (where every read waits for the device), for
    argmax proposals with no logits processor to run per slot (sampled proposals and per-slot processors read the host
    slot by slot). The generator and the tuner's cost model (:meth:`~hf_retrace.tuning.costs.MachineCosts.arm`) both
    ask this one rule."""
    return on_accelerator and not sampled_proposals and not slot_processors


def on_accelerator(device: Any) -> bool:
    """Whether ``device`` is an accelerator (every device but the CPU)."""
    return torch.device(device).type != "cpu"


def eos_cut(tokens: Sequence[float], eos_ids: Collection[int]) -> int:
    """How many of the proposed ``tokens`` (host values) to keep: drafts past an end-of-sequence token can never be
    committed, so a proposal stops at the first one."""
    for i, token in enumerate(tokens):
        if int(token) in eos_ids:
            return i + 1
    return len(tokens)


@dataclass
class RoundInputs:
    """What one round starts from: the committed sequence (``[1, L]`` on the inputs' device; None in the replay, which
    walks host lists), the anchor (the newest committed position), the most drafts that still fit, and the committed
    tokens the host holds already (the accelerator order's one transfer fills them in)."""

    anchor: int
    room: int
    sequence: Any = None
    host_tail: tuple[int, list[int]] | None = None  # (from position, committed tokens from there on)
    host_sequence: Sequence[int] | None = None  # the replay's whole committed sequence on the host

    def committed_since(self, start: int) -> list[int]:
        """The committed tokens from position ``start`` on, as host ints (a transfer unless the host holds them)."""
        if self.host_tail is not None and self.host_tail[0] == start:
            return self.host_tail[1]
        if self.host_sequence is not None:
            return list(self.host_sequence[start : self.anchor + 1])
        return self.sequence[0, start:].tolist()


@dataclass(frozen=True)
class Proposal:
    """One round's drafts, kept until the verdict: ``tokens`` ``[1, k]`` on the inputs' device (a list in the replay),
    their host values, the draft logits the loop needs for sampled proposals, and the drafter's hidden states at the
    drafted slots (ReTrace's carry; None for other sources)."""

    source: str
    anchor: int
    tokens: Any
    host_tokens: list[int]
    logits: torch.Tensor | None = None
    drafter_hidden: torch.Tensor | None = None
    fused: bool = False

    def __len__(self) -> int:
        return len(self.host_tokens)

    def cut(self, k: int) -> "Proposal":
        """The first ``k`` drafts."""
        if k == len(self):
            return self
        hidden = None if self.drafter_hidden is None else self.drafter_hidden[:, :k]
        logits = None if self.logits is None else self.logits[:, :k]
        tokens = self.tokens[:, :k] if isinstance(self.tokens, torch.Tensor) else self.tokens[:k]
        return replace(self, tokens=tokens, host_tokens=self.host_tokens[:k], logits=logits, drafter_hidden=hidden)


@dataclass(frozen=True)
class Verdict:
    """The target's verdict on a proposal: ``accepted`` drafts committed (plus one token of the target's); the committed
    sequence and the verify scores (None in the replay)."""

    accepted: int
    sequence: Any = None
    scores: torch.Tensor | None = None


class ProposalSource(Protocol):
    """One proposal idea. ``propose`` returns None when it has nothing for this round (the next source is asked);
    every source observes every verdict (``proposal.source`` says whose it was)."""

    name: str

    def propose(self, inputs: RoundInputs) -> Proposal | None: ...

    def observe(self, proposal: Proposal, verdict: Verdict) -> None: ...
