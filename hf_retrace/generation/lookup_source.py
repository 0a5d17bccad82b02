"""Context lookup as a proposal source: the n-gram index, its budget, and what the call's processors allow.

Example::

    lookup = LookupSource(RoundPolicy(lookup=True))
    lookup.propose(RoundInputs(anchor=5, room=4, host_sequence=[5, 6, 7, 8, 5, 6]))   # drafts [7, 8]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .lookup import ContextLookup
from .policy import RoundPolicy
from .proposal import Proposal, RoundInputs, Verdict

__all__ = ["LookupSource"]


class LookupSource:
    """Proposes what followed the newest tokens earlier in the context, within a budget the verdicts grow and shrink
    (:meth:`RoundPolicy.next_lookup_budget`). The copy is sliced from the sequence on its device (no transfer)."""

    name = "lookup"

    def __init__(self, policy: RoundPolicy, rules: Sequence[Any] = (), vocab_size: int = 0):
        self.policy = policy
        self.index = ContextLookup(policy.lookup_max_ngram)
        self.budget = policy.first_lookup_budget()
        self.rules = list(rules)  # rule-based processors (no warpers): a copy stops at a token they forbid
        self.vocab_size = vocab_size

    def propose(self, inputs: RoundInputs) -> Proposal | None:
        self.index.extend(inputs.committed_since(len(self.index)))
        matched, start = self.index.match(self.policy.lookup_min_ngram)
        if not matched:
            return None
        host = self.index.continuation(start, min(self.budget, inputs.room))
        if inputs.sequence is None:  # the replay: host lists only
            return Proposal(self.name, inputs.anchor, host, host)
        span = inputs.sequence[:, start:]
        tokens = self._allowed_copy(inputs.sequence, span.repeat(1, -(-len(host) // span.shape[1]))[:, : len(host)])
        k = tokens.shape[1]
        return Proposal(self.name, inputs.anchor, tokens, host[:k]) if k else None

    def observe(self, proposal: Proposal, verdict: Verdict) -> None:
        if proposal.source == self.name:
            self.budget = self.policy.next_lookup_budget(len(proposal), verdict.accepted)

    def _allowed_copy(self, sequence: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
        """The copy up to its first token that the rules forbid after its prefix (e.g. ``no_repeat_ngram_size`` bans
        exactly the repeats lookup copies): such a token can never be accepted."""
        if not self.rules:
            return draft_tokens
        ids = sequence
        for i in range(draft_tokens.shape[1]):
            scores = torch.zeros((1, self.vocab_size), device=sequence.device)
            for processor in self.rules:
                scores = processor(ids, scores)
            if not bool(scores[0, draft_tokens[0, i]] > float("-inf")):
                return draft_tokens[:, :i]
            ids = torch.cat([ids, draft_tokens[:, i : i + 1]], dim=-1)
        return draft_tokens
