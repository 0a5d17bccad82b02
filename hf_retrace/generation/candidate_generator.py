"""One speculative round, top to bottom: context in, block drafted, verdict read, rejected suffix kept.

transformers' assisted loop owns verification and the lossless acceptance rule; this generator only proposes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList
from transformers.generation import CandidateGenerator
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..retrace import PendingSuffix, first_kept_slot
from ..stats import GenerationStats, last_stats_slot
from .lookup import ContextLookup
from .policy import RoundPolicy
from .target_features import TargetTap

# warpers that never change which token has the largest logit: argmax proposals can skip them
_ARGMAX_PRESERVING = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


def drafter_first(device: Any) -> bool:
    """Whether rounds run in the accelerator order (the drafter's whole block launched before the lookup decision, one
    transfer to the host; see :class:`ReTraceCandidateGenerator`): on every device but the CPU. The tuner's cost model
    asks the same (a lookup round then pays the drafter's round too)."""
    return torch.device(device).type != "cpu"


@dataclass
class DraftRound:
    """What the drafter proposed this round, kept until the target's verdict arrives."""

    anchor_position: int
    tokens: torch.Tensor  # [k] drafted tokens for positions anchor+1 .. anchor+k
    drafter_hidden: torch.Tensor | None  # [k, H] the drafter's normed hidden states at those slots (None: lookup)
    fused: bool

    @property
    def from_lookup(self) -> bool:
        return self.drafter_hidden is None


class ReTraceCandidateGenerator(CandidateGenerator):
    """Drafts one DFlash block per round; with ReTrace, the previous round's rejected suffix is fused into it.

    Built fresh by ``target.generate(..., assistant_model=drafter)`` for every call: all state (the drafter's context
    cache, the rejected suffix, the stats) lives here and dies with the call.

    Two orders of the same round. On the CPU (where reading a tensor costs nothing) context lookup is tried first and
    the drafter runs only when it finds no match, its head chunk by chunk up to the first unconfident slot (compute is
    what costs there). On an accelerator every read waits for the device, so the drafter's whole block is launched
    first and the host reads, in one transfer, the tokens committed since the last round (for the lookup index), the
    drafter's proposals and their confidences; the round then uses the lookup's copy or the drafter's block. The
    verdict is read from the sequence's length, with no transfer: one host sync per round at T=0 (the draft length
    must reach the host to build the candidates). Proposals are the same in both orders.
    """

    one_transfer: bool | None = None  # the accelerator order; None: chosen by the drafter's device (tests force it)

    def __init__(
        self,
        drafter: Any,
        target: Any,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None,
        prompt_length: int,
        policy: RoundPolicy | None = None,
    ):
        policy = policy if policy is not None else RoundPolicy()
        self.policy = policy
        self.drafter, self.target = drafter, target
        self.prompt_length = prompt_length
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        # sliced once per call, not per round; kept in the head's dtype (rows are cast): a full head is never copied
        self.draft_head = drafter.draft_head(self.lm_head)
        self.vocab_size = self.lm_head.weight.shape[0]
        self.block_size = drafter.config.block_size
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.sampled_proposals = self.do_sample and policy.proposal_mode == "sample"
        processors = list(logits_processor or [])
        if not self.sampled_proposals:
            processors = [p for p in processors if not isinstance(p, _ARGMAX_PRESERVING)]
        self.logits_processor = LogitsProcessorList(processors)
        eos = generation_config.eos_token_id
        self.eos_token_ids = torch.tensor([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)))
        self.eos_ids = frozenset(self.eos_token_ids.tolist())  # the rule that cuts drafts runs on the host
        self.max_drafts = self.block_size - 1

        self.tap = TargetTap(target, drafter.config.target_layer_ids, bool(generation_config.output_hidden_states))
        self.requires_model_outputs = self.tap.uses_model_outputs
        self.model_kwargs_overrides = self.tap.model_kwargs_overrides
        self.retrace = drafter.retrace if policy.retrace else None  # the module this call fuses with (None: off)
        one_transfer = self.one_transfer if self.one_transfer is not None else drafter_first(drafter.device)
        # argmax proposals with no processor to run per slot: everything the host needs fits in one transfer
        self.one_transfer = one_transfer and len(self.logits_processor) == 0 and not self.sampled_proposals
        self.cache = DynamicCache()
        self.context_length = 0  # positions whose target states the generator has read (cached or pending)
        self.cache_length = 0  # positions whose context K/V the drafter cache holds
        self.pending_context: torch.Tensor | None = None  # rows read on lookup rounds, not yet in the cache
        self.lookup = ContextLookup(policy.lookup_max_ngram) if policy.lookup else None
        self.lookup_budget = policy.first_lookup_budget()
        self.guard = policy.guard()  # never slower than plain within the call (None: the costs are not known)
        self.draft_round: DraftRound | None = None
        self.rejected_suffix: PendingSuffix | None = None  # completed by the next call's verification window
        self.kept_pending: list[tuple[int, int]] = []  # (position, rejected token) awaiting the committed token
        self.stats = GenerationStats(policy=policy.describe())
        last_stats_slot(drafter).set(self.stats)
        self._verify_started = 0.0

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens one round can propose (a drafter block's or a lookup copy's): transformers >= 5.25 sizes the
        target cache's rollback record by it (``cache.activate_past_recording``)."""
        return max(self.max_drafts, self.policy.lookup_cap if self.lookup is not None else 0)

    def close(self) -> None:
        """Release what the call holds on the target (its layer hooks on transformers 4.57); idempotent."""
        self.tap.close()

    def get_candidates(self, input_ids: torch.LongTensor, model_outputs: Any = None, **kwargs: Any):
        """Return ``(prompt + committed + drafts, processed draft logits or None)``."""
        candidates, logits = self._candidates(input_ids, model_outputs)
        self.last_candidates = candidates  # the loop may run its stopping criteria on it (4.57): not committed yet
        return candidates, logits

    @torch.no_grad()
    def _candidates(self, input_ids: torch.LongTensor, model_outputs: Any):
        if not self.tap.has_window(model_outputs):  # the prefill has not run yet: let it run undrafted
            return self._undrafted_prefill(input_ids), None
        started = time.perf_counter()
        cur_len = input_ids.shape[1]
        anchor_position = cur_len - 1  # the newest committed token; the target has no states for it yet
        window = self.tap.window(model_outputs).to(self.drafter.device)
        fresh = window[:, : anchor_position - self.context_length]  # target states of the tokens committed since
        self.context_length = anchor_position
        aligned = self._read_rejected_rows(window, anchor_position)
        num_drafts = min(self.max_drafts, self.max_length - cur_len - 1)
        if num_drafts <= 0:
            return input_ids, None
        if self.guard is not None and not self.guard.drafts_at(anchor_position):  # backed off: the target steps alone
            self._hold_context(fresh)
            self.stats.guard_plain_steps += 1
            return input_ids, None
        lookup_budget = min(self.lookup_budget, self.max_length - cur_len - 1)
        if self.one_transfer:
            return self._one_transfer_round(input_ids, fresh, aligned, anchor_position, num_drafts, lookup_budget,
                                            started)
        if self.lookup is not None:
            self.lookup.extend(input_ids[0, len(self.lookup) :].tolist())
            candidates = self._lookup_round(input_ids, anchor_position, lookup_budget, started, hold=fresh)
            if candidates is not None:
                return candidates, None

        hidden = self._drafter_forward(input_ids, fresh, aligned, anchor_position)
        draft_logits = self._confident_logits(hidden[:, 1 : num_drafts + 1])
        drafter_hidden = hidden[:, 1 : draft_logits.shape[1] + 1]
        draft_tokens, draft_logits = self._propose(input_ids, draft_logits)
        k = self._eos_cut(draft_tokens[0].tolist())
        return self._drafter_round(input_ids, draft_tokens[:, :k], drafter_hidden, draft_logits, aligned,
                                   anchor_position, started)

    def _one_transfer_round(self, input_ids, fresh, aligned, anchor_position: int, num_drafts: int,
                            lookup_budget: int, started: float):
        """The accelerator order (see the class): the drafter's block first, then one transfer of what the host needs."""
        hidden = self._drafter_forward(input_ids, fresh, aligned, anchor_position)[:, 1 : num_drafts + 1]
        draft_tokens, draft_logits = self._propose(input_ids, self._draft_logits(hidden))
        tops = draft_logits[0].softmax(-1).amax(-1).to(input_ids.device)
        new = input_ids[0, len(self.lookup) :] if self.lookup is not None else input_ids[0, :0]
        host = torch.cat([new.double(), draft_tokens[0].double(), tops.double()]).tolist()  # the round's one transfer
        n, d = new.shape[0], draft_tokens.shape[1]
        if self.lookup is not None:
            self.lookup.extend(host[:n])
            candidates = self._lookup_round(input_ids, anchor_position, lookup_budget, started, hold=None)
            if candidates is not None:
                return candidates, None
        keep = d
        if self.policy.confidence_cut is not None and d > 1:
            keep = self.policy.cut(host[n + d :])
            self.stats.slot_confidences.append(host[n + d : n + d + keep])
        k = self._eos_cut(host[n : n + keep])
        return self._drafter_round(input_ids, draft_tokens[:, :k], hidden, None, aligned, anchor_position, started)

    def _drafter_forward(self, input_ids, fresh, aligned, anchor_position: int) -> torch.Tensor:
        """One non-causal drafter forward over ``[anchor, MASK x (B-1)]``, reading the context not yet in its cache;
        ``[1, B, H]`` hidden states (slot 0 is the anchor)."""
        if self.pending_context is not None:
            fresh, self.pending_context = torch.cat([self.pending_context, fresh], dim=1), None
        block = self.drafter.block_embeddings(input_ids[:, -1].to(self.drafter.device), self.embed_tokens, aligned,
                                              self.policy.retrace_ablation)
        positions = torch.arange(self.cache_length, anchor_position + self.block_size, device=block.device)
        hidden = self.drafter(
            target_hidden=fresh,
            noise_embedding=block,
            position_ids=positions[None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache.crop(-self.block_size)  # keep the context K/V, drop the block's (negative: 4.57 and 5.x)
        self.cache_length = anchor_position
        return hidden

    def _drafter_round(self, input_ids, draft_tokens, drafter_hidden, draft_logits, aligned, anchor_position: int,
                       started: float):
        """Candidates from the drafter's ``draft_tokens`` ([1, k]); the target steps alone when k is 0 (the
        processors allow no token of the draft vocabulary at slot 1)."""
        k = draft_tokens.shape[1]
        self.stats.draft_seconds += time.perf_counter() - started
        if k == 0:
            return input_ids, None
        self.draft_round = DraftRound(anchor_position, draft_tokens[0], drafter_hidden[0, :k], aligned is not None)
        self._verify_started = time.perf_counter()
        candidates = torch.cat([input_ids, draft_tokens], dim=-1)
        return candidates, (draft_logits[:, :k] if self.sampled_proposals else None)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: Any):
        """Read the verdict: record the round, and keep what the target rejected beyond its correction."""
        draft = self.draft_round
        self.draft_round, self.rejected_suffix = None, None
        self.stats.new_tokens = input_ids.shape[1] - self.prompt_length
        if draft is None:
            return
        # the loop commits the accepted drafts and one token of the target's: read without a transfer (== num_matches)
        accepted = input_ids.shape[1] - draft.anchor_position - 2
        try:
            self._read_verdict(draft, accepted, input_ids, scores)
        finally:  # the verify clock runs until the verdict is read, as for transformers' own generators
            self.stats.verify_seconds += time.perf_counter() - self._verify_started

    def _read_verdict(self, draft: DraftRound, accepted: int, input_ids: torch.Tensor, scores: torch.Tensor) -> None:
        k = draft.tokens.shape[0]
        self.stats.record_round(k, accepted, draft.fused, source="lookup" if draft.from_lookup else "drafter")
        if self.guard is not None:
            self.guard.record(draft.anchor_position, k, accepted, draft.from_lookup)
        if self.policy.kept_suffix_stats:
            self._score_kept_tokens(input_ids)
        if draft.from_lookup:
            self.lookup_budget = self.policy.next_lookup_budget(k, accepted)
            return  # ReTrace keeps the drafter's own trajectories only
        if first_kept_slot(accepted) > k:  # nothing beyond the first rejection (or all accepted): nothing to keep
            return
        slots = torch.arange(first_kept_slot(accepted), k + 1, device=draft.tokens.device)  # 1-based j = n+2..k
        rejected = draft.tokens[slots - 1]
        self.stats.rounds_with_kept_suffix += 1
        if self.policy.kept_suffix_stats:  # research statistics: host transfers, off the hot path unless asked for
            self.kept_pending += list(zip((draft.anchor_position + slots).tolist(), rejected.tolist()))
        if self.retrace is None:
            return
        target_p, target_t = scores[0, slots - 1].float().softmax(-1).max(-1)  # row j-1 predicts position s+j
        self.rejected_suffix = PendingSuffix(
            anchor_position=draft.anchor_position,
            positions=(draft.anchor_position + slots)[None],
            drafter_hidden=draft.drafter_hidden[slots - 1][None],
            rejected_tokens=rejected[None],
            target_tokens=target_t.to(rejected.device)[None],
            target_probs=target_p.to(rejected.device)[None],
        )

    # --- pieces of the round -------------------------------------------------------------------------------------
    def _lookup_round(self, input_ids, anchor_position: int, num_drafts: int, started: float,
                      hold: torch.Tensor | None):
        """Propose what followed the newest tokens earlier in the context (the index is up to date); None when no
        n-gram matches.

        The copy is sliced from ``input_ids`` on its device (no transfer). ``hold``: the new context rows to keep for
        the next drafter round, when this round runs no drafter forward (None: the drafter has read them already).
        No rejected suffix is kept (ReTrace conditions on the drafter's own trajectories only).
        """
        matched, start = self.lookup.match(self.policy.lookup_min_ngram)
        if not matched:
            return None
        k = self._eos_cut(self.lookup.continuation(start, num_drafts))
        source = input_ids[:, start:]
        draft_tokens = self._allowed_copy(input_ids, source.repeat(1, -(-k // source.shape[1]))[:, :k])
        if draft_tokens.shape[1] == 0:
            return None
        if hold is not None:
            self._hold_context(hold)
        self.rejected_suffix = None
        self.draft_round = DraftRound(anchor_position, draft_tokens[0], None, False)
        self.stats.draft_seconds += time.perf_counter() - started
        self._verify_started = time.perf_counter()
        return torch.cat([input_ids, draft_tokens], dim=-1)

    def _allowed_copy(self, input_ids: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
        """A lookup copy up to its first token that the call's rule-based processors forbid after its prefix (e.g.
        ``no_repeat_ngram_size`` bans exactly the repeats lookup copies): such a token can never be accepted."""
        rules = [p for p in self.logits_processor if not isinstance(p, _ARGMAX_PRESERVING)]
        if not rules:
            return draft_tokens
        ids = input_ids
        for i in range(draft_tokens.shape[1]):
            scores = torch.zeros((1, self.vocab_size), device=input_ids.device)
            for processor in rules:
                scores = processor(ids, scores)
            if not bool(scores[0, draft_tokens[0, i]] > float("-inf")):
                return draft_tokens[:, :i]
            ids = torch.cat([ids, draft_tokens[:, i : i + 1]], dim=-1)
        return draft_tokens

    def _hold_context(self, fresh: torch.Tensor) -> None:
        """Keep the new context rows for the next drafter round (this round runs no drafter forward); a rejected
        suffix is dropped (ReTrace conditions on the drafter's own consecutive trajectories only)."""
        if self.pending_context is not None:
            fresh = torch.cat([self.pending_context, fresh], dim=1)
        self.pending_context, self.rejected_suffix = fresh, None

    def _confident_logits(self, drafter_hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits of the slots to draft: all, or up to the first below the confidence threshold (>= 1 slot).

        With a threshold the head runs chunk by chunk (2, then 4 slots, ...) and stops at the first unconfident slot:
        a bf16 head costs in proportion to its rows on CPUs without bf16 units, and most rounds stop early.
        """
        total = drafter_hidden.shape[1]
        if self.policy.confidence_cut is None or total <= 1:
            return self._draft_logits(drafter_hidden)
        chunks, tops, done, size = [], [], 0, 2
        while done < total:
            logits = self._draft_logits(drafter_hidden[:, done : done + size])
            chunks.append(logits)
            tops += logits[0].softmax(-1).amax(-1).tolist()
            done += logits.shape[1]
            size *= 2
            keep = self.policy.cut(tops)
            if keep < len(tops):  # an unconfident slot among those scored: the rest of the head is not needed
                break
        self.stats.slot_confidences.append(tops[:keep])
        return torch.cat(chunks, dim=1)[:, :keep]

    def _read_rejected_rows(self, window: torch.Tensor, anchor_position: int):
        """Complete the kept suffix with the target's tapped states at its rows; align it with the new block."""
        pending = self.rejected_suffix
        if pending is None:
            return None
        suffix = pending.complete(self.drafter.project_context(window[:, pending.window_rows]))
        return suffix.align(anchor_position, self.block_size)

    def _draft_logits(self, drafter_hidden: torch.Tensor) -> torch.Tensor:
        """``[1, k, Vd]`` scores over the draft vocabulary (the whole vocabulary when the drafter has none)."""
        return self.drafter.compute_logits(drafter_hidden, self.draft_head)

    def _propose(self, input_ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Argmax (default) or sampled proposals from the processed draft logits, one slot after another.

        The block ends before a slot where the processors leave no token of the draft vocabulary (see ``_process``).
        """
        if len(self.logits_processor) == 0 and not self.sampled_proposals:
            best = self.drafter.draft_token_ids(logits.argmax(-1))  # on the head's device
            return best.to(input_ids.device), logits.to(input_ids.device)
        logits = self.drafter.full_vocab_logits(logits, self.vocab_size).to(input_ids.device)
        ids = input_ids
        for i in range(logits.shape[1]):
            processed = self._process(ids, logits[:, i])
            if processed is None:
                break
            logits[:, i] = processed
            if self.sampled_proposals:
                token = torch.multinomial(logits[:, i].softmax(-1), num_samples=1)
            else:
                token = logits[:, i].argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], dim=-1)
        return ids[:, input_ids.shape[1] :], logits

    def _process(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor | None:
        """The call's processors on one slot's draft scores; None as soon as they leave no token (all ``-inf``, e.g.
        ``suppress_tokens`` covering the draft vocabulary): no proposal exists there, and the warpers after that point
        (and sampling) would fail on it. Ending the block early only means fewer candidates."""
        for processor in self.logits_processor:
            scores = processor(ids, scores)
            if not bool((scores > float("-inf")).any()):
                return None
        return scores

    def _undrafted_prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prompt alone; or, when it ends in an EOS token, the prompt plus that EOS as a placeholder draft.

        transformers 4.57's loop runs the stopping criteria on the candidate before verifying it: a prompt ending in
        EOS with no draft looks finished, ``n_matches`` becomes -1, nothing is committed and generation stops with no
        new token. With one placeholder draft the same rule drops only the placeholder, so the loop commits exactly
        the target's own first token (greedy or sampled); 5.x drops it too (its EOS crop). No other effect.
        """
        if self.eos_token_ids.numel() and bool(torch.isin(input_ids[0, -1].cpu(), self.eos_token_ids)):
            return torch.cat([input_ids, input_ids[:, -1:]], dim=-1)
        return input_ids

    def _eos_cut(self, tokens: Sequence[float]) -> int:
        """How many of the drafted ``tokens`` (host values) to propose: drafts past an end-of-sequence token can
        never be committed, so the block stops at the first one."""
        for i, token in enumerate(tokens):
            if int(token) in self.eos_ids:
                return i + 1
        return len(tokens)

    def _score_kept_tokens(self, input_ids: torch.Tensor) -> None:
        committed = input_ids.shape[1]
        still_pending = []
        for position, token in self.kept_pending:
            if position < committed:
                self.stats.kept_tokens += 1
                self.stats.kept_tokens_committed += int(input_ids[0, position].item() == token)
            else:
                still_pending.append((position, token))
        self.kept_pending = still_pending
