"""The drafter's block as a proposal source: its context cache, the confidence cut, and ReTrace's carry.

One non-causal drafter forward over ``[anchor, MASK x (B-1)]`` per round reads the target's states of the tokens
committed since its last forward; with ReTrace the previous round's rejected suffix is fused into the block. The carry
is the drafter's own: it is completed from the verification window that follows its round, so a round of another
source (or a plain step) in between simply leaves nothing to complete.

Two orders of the same proposal (:func:`~hf_retrace.generation.proposal.one_transfer`). The CPU order (reading a
tensor costs nothing) runs the drafter only when asked, its head chunk by chunk up to the first unconfident slot. The
accelerator order launches the whole block (:meth:`DrafterSource.launch`) before any source decides and reads, in one
transfer, the committed tokens the lookup index needs, the drafts and their confidences. The drafts are the same.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, LogitsProcessorList

from ..retrace import AlignedSuffix, PendingSuffix, first_kept_slot
from ..stats import GenerationStats
from .policy import RoundPolicy
from .proposal import Proposal, RoundInputs, Verdict

__all__ = ["DraftChooser", "DrafterSource"]


class DraftChooser:
    """Argmax (default) or sampled proposals from the processed draft logits, one slot after another; the block ends
    before a slot where the call's processors leave no token of the draft vocabulary."""

    def __init__(self, drafter: Any, logits_processor: LogitsProcessorList, sampled: bool, vocab_size: int):
        self.drafter, self.logits_processor = drafter, logits_processor
        self.sampled, self.vocab_size = sampled, vocab_size

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [1, k], processed logits)`` on the inputs' device."""
        if len(self.logits_processor) == 0 and not self.sampled:
            best = self.drafter.draft_token_ids(logits.argmax(-1))  # on the head's device
            return best.to(input_ids.device), logits.to(input_ids.device)
        logits = self.drafter.full_vocab_logits(logits, self.vocab_size).to(input_ids.device)
        ids = input_ids
        for i in range(logits.shape[1]):
            processed = self.process(ids, logits[:, i])
            if processed is None:
                break
            logits[:, i] = processed
            if self.sampled:
                token = torch.multinomial(logits[:, i].softmax(-1), num_samples=1)
            else:
                token = logits[:, i].argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], dim=-1)
        return ids[:, input_ids.shape[1] :], logits

    def process(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor | None:
        """The processors on one slot's draft scores; None as soon as they leave no token (all ``-inf``, e.g.
        ``suppress_tokens`` covering the draft vocabulary): the warpers after that point (and sampling) would fail."""
        for processor in self.logits_processor:
            scores = processor(ids, scores)
            if not bool((scores > float("-inf")).any()):
                return None
        return scores


class DrafterSource:
    """The DFlash block (with ReTrace's carry when the call's policy fuses). See the module for the two orders."""

    name = "drafter"

    def __init__(self, drafter: Any, target: Any, policy: RoundPolicy, stats: GenerationStats, choose: DraftChooser):
        self.drafter, self.policy, self.stats, self.choose = drafter, policy, stats, choose
        self.embed_tokens = target.get_input_embeddings()
        # sliced once per call, not per round; kept in the head's dtype (rows are cast): a full head is never copied
        self.draft_head = drafter.draft_head(target.get_output_embeddings())
        self.block_size = drafter.config.block_size
        self.retrace = drafter.retrace if policy.retrace else None  # the module this call fuses with (None: off)
        self.cache = DynamicCache()
        self.context_length = 0  # positions whose target states have been read (cached or pending)
        self.cache_length = 0  # positions whose context K/V the cache holds
        self.pending_context: torch.Tensor | None = None  # rows read but not yet through a forward
        self.carry: PendingSuffix | None = None  # this round's kept suffix, completed by the next window
        self.aligned: AlignedSuffix | None = None  # the carry laid on this round's block
        self.launched: Proposal | None = None  # the accelerator order's block, drafted before the decision
        self.kept_pending: list[tuple[int, int]] = []  # (position, rejected token) awaiting the committed token

    def read(self, window: torch.Tensor, anchor: int) -> None:
        """Take the verification window (target states from the previous anchor on): the rows of the tokens committed
        since, and the target's states at the carried suffix, aligned with the block anchored at ``anchor``."""
        window = window.to(self.drafter.device)
        fresh = window[:, : anchor - self.context_length]
        self.pending_context = fresh if self.pending_context is None else torch.cat([self.pending_context, fresh], 1)
        self.context_length, carry, self.carry, self.launched = anchor, self.carry, None, None
        self.aligned = None
        if carry is not None:  # the carry's own round was the previous one: the window starts at its anchor
            suffix = carry.complete(self.drafter.project_context(window[:, carry.window_rows]))
            self.aligned = suffix.align(anchor, self.block_size)

    def launch(self, inputs: RoundInputs, host_from: int | None) -> None:
        """The accelerator order: draft the whole block now and read, in one transfer, the committed tokens from
        ``host_from`` on (None: none), the drafts and their confidences."""
        hidden = self._forward(inputs)[:, 1 : min(self.block_size - 1, inputs.room) + 1]
        tokens, logits = self.choose(inputs.sequence, self.draft_logits(hidden))
        tops = logits[0].softmax(-1).amax(-1).to(inputs.sequence.device)
        new = inputs.sequence[0, host_from:] if host_from is not None else inputs.sequence[0, :0]
        host = torch.cat([new.double(), tokens[0].double(), tops.double()]).tolist()  # the round's one transfer
        n, d = new.shape[0], tokens.shape[1]
        if host_from is not None:
            inputs.host_tail = (host_from, [int(t) for t in host[:n]])
        keep = d
        if self.policy.confidence_cut is not None and d > 1:
            keep = self.policy.cut(host[n + d :])
            self.stats.slot_confidences.append(host[n + d : n + d + keep])
        drafts = [int(t) for t in host[n : n + keep]]
        self.launched = Proposal(self.name, inputs.anchor, tokens[:, :keep], drafts, None, hidden[:, :keep],
                                 self.aligned is not None)

    def propose(self, inputs: RoundInputs) -> Proposal:
        """The block (launched already in the accelerator order); empty when the processors allow no first token."""
        if self.launched is not None:
            return self.launched
        hidden = self._forward(inputs)
        logits = self.confident_logits(hidden[:, 1 : min(self.block_size - 1, inputs.room) + 1])
        tokens, logits = self.choose(inputs.sequence, logits)
        k = tokens.shape[1]
        sampled = logits[:, :k] if self.choose.sampled else None
        return Proposal(self.name, inputs.anchor, tokens, tokens[0].tolist(), sampled, hidden[:, 1 : k + 1],
                        self.aligned is not None)

    def observe(self, proposal: Proposal, verdict: Verdict) -> None:
        """Score kept tokens (research statistics, when asked); keep this round's rejected suffix for ReTrace."""
        if self.policy.kept_suffix_stats:
            self._score_kept_tokens(verdict.sequence)
        first, k = first_kept_slot(verdict.accepted), len(proposal)
        if proposal.source != self.name or first > k:  # nothing beyond the first rejection (or all accepted)
            return
        self.stats.rounds_with_kept_suffix += 1
        if self.policy.kept_suffix_stats:
            self.kept_pending += [(proposal.anchor + j, proposal.host_tokens[j - 1]) for j in range(first, k + 1)]
        if self.retrace is None:
            return
        device = proposal.drafter_hidden.device  # the carry lives where the drafter runs
        target_p, target_t = verdict.scores[0, first - 1 : k].float().softmax(-1).max(-1)  # row j-1 predicts s+j
        self.carry = PendingSuffix(
            anchor_position=proposal.anchor,
            positions=torch.arange(proposal.anchor + first, proposal.anchor + k + 1, device=device)[None],
            drafter_hidden=proposal.drafter_hidden[:, first - 1 : k],
            rejected_tokens=proposal.tokens[:, first - 1 : k].to(device),
            target_tokens=target_t.to(device)[None],
            target_probs=target_p.to(device)[None],
        )

    def draft_logits(self, drafter_hidden: torch.Tensor) -> torch.Tensor:
        """``[1, k, Vd]`` scores over the draft vocabulary (the whole vocabulary when the drafter has none)."""
        return self.drafter.compute_logits(drafter_hidden, self.draft_head)

    def _forward(self, inputs: RoundInputs) -> torch.Tensor:
        """One forward over ``[anchor, MASK x (B-1)]`` reading the context rows not yet in the cache; ``[1, B, H]``
        hidden states (slot 0 is the anchor)."""
        fresh, self.pending_context = self.pending_context, None
        block = self.drafter.block_embeddings(inputs.sequence[:, -1].to(self.drafter.device), self.embed_tokens,
                                              self.aligned, self.policy.retrace_ablation)
        positions = torch.arange(self.cache_length, inputs.anchor + self.block_size, device=block.device)
        hidden = self.drafter(target_hidden=fresh, noise_embedding=block, position_ids=positions[None],
                              past_key_values=self.cache, use_cache=True)
        self.cache.crop(-self.block_size)  # keep the context K/V, drop the block's (negative: 4.57 and 5.x)
        self.cache_length = inputs.anchor
        return hidden

    def confident_logits(self, drafter_hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits of the slots to draft: all, or up to the first below the confidence threshold (>= 1 slot).

        With a threshold the head runs chunk by chunk (2, then 4 slots, ...) and stops at the first unconfident slot:
        a bf16 head costs in proportion to its rows on CPUs without bf16 units, and most rounds stop early.
        """
        total = drafter_hidden.shape[1]
        if self.policy.confidence_cut is None or total <= 1:
            return self.draft_logits(drafter_hidden)
        chunks, tops, done, size = [], [], 0, 2
        while done < total:
            logits = self.draft_logits(drafter_hidden[:, done : done + size])
            chunks.append(logits)
            tops += logits[0].softmax(-1).amax(-1).tolist()
            done += logits.shape[1]
            size *= 2
            keep = self.policy.cut(tops)
            if keep < len(tops):  # an unconfident slot among those scored: the rest of the head is not needed
                break
        self.stats.slot_confidences.append(tops[:keep])
        return torch.cat(chunks, dim=1)[:, :keep]

    def _score_kept_tokens(self, sequence: torch.Tensor) -> None:
        committed, still_pending = sequence.shape[1], []
        for position, token in self.kept_pending:
            if position < committed:
                self.stats.kept_tokens += 1
                self.stats.kept_tokens_committed += int(sequence[0, position].item() == token)
            else:
                still_pending.append((position, token))
        self.kept_pending = still_pending
