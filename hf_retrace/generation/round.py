"""One speculative round, top to bottom, over proposal sources: the generator and the tuner's replay both walk it.

Guard, then the policy's sources in order (context lookup first when the policy has it, then the drafter's block), the
first proposal wins, cut at an end-of-sequence token; on the verdict: the stats, the guard, and every source observes.
transformers' assisted loop (or the replay's greedy answer) does the verifying; the lossless acceptance rule is never
ours.

Example::

    round_ = Round(policy, [LookupSource(policy), drafts], GenerationStats())
    proposal = round_.propose(RoundInputs(anchor=p, room=room, host_sequence=tokens))
    round_.observe(proposal, Verdict(accepted=accepted_prefix(proposal.tokens, tokens, p)))
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from ..machine import onednn_matmuls
from ..stats import GenerationStats
from .policy import RoundPolicy
from .proposal import Proposal, ProposalSource, RoundInputs, Verdict, eos_cut

__all__ = ["Round"]


class Round:
    """The round rule of one call. ``launch_first``: in the accelerator order, the source whose device work starts
    before any source decides (it gets ``host_from``, where the host's copy of the committed tokens must start)."""

    def __init__(self, policy: RoundPolicy, sources: Sequence[ProposalSource], stats: GenerationStats,
                 eos_ids: Collection[int] = (), launch_first: Any = None, rows: int = 1):
        self.policy, self.sources, self.stats = policy, list(sources), stats
        self.eos_ids = frozenset(eos_ids)
        # never slower than plain within the call (None: the costs are not known, or a row of a batch of ``rows``)
        self.guard = policy.guard(rows)
        self.launch_first = launch_first

    def propose(self, inputs: RoundInputs, host_from: int | None = None) -> Proposal | None:
        """The round's proposal, or None when the target steps alone (no room, or the guard backs off)."""
        if inputs.room <= 0:
            return None
        if self.guard is not None and not self.guard.drafts_at(inputs.anchor):
            self.stats.guard_plain_steps += 1
            return None
        with onednn_matmuls(self.policy.drafter_onednn):  # the drafter's kernels, as the tuner priced its round
            if self.launch_first is not None:  # the accelerator order: the block is on its way before the decision
                self.launch_first.launch(inputs, host_from)
            for source in self.sources:
                proposal = source.propose(inputs)
                if proposal is not None:
                    return proposal.cut(eos_cut(proposal.host_tokens, self.eos_ids))
        return None

    def observe(self, proposal: Proposal, verdict: Verdict, seconds: float | None = None) -> None:
        """Record the verdict on a non-empty proposal (the round's wall time ``seconds`` where the caller clocks it):
        stats, guard, and what each source learns from it."""
        k, from_lookup = len(proposal), proposal.source == "lookup"
        self.stats.record_round(k, verdict.accepted, proposal.fused, source=proposal.source)
        if self.guard is not None:
            self.guard.record(proposal.anchor, k, verdict.accepted, from_lookup, seconds)
            self.stats.guard_clocked_rounds = self.guard.clocked_rounds
        for source in self.sources:
            source.observe(proposal, verdict)

    def observe_plain(self, seconds: float) -> None:
        """Count the wall time of one step the target took alone (the guard prices rounds against such steps)."""
        if self.guard is not None:
            self.guard.note_plain(seconds)
