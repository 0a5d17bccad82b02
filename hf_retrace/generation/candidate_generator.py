"""transformers' side of a round: the verification window in, candidates out, the verdict read back.

The round itself (:class:`~hf_retrace.generation.round.Round`) and its proposal sources (:mod:`.drafter_source`,
:mod:`.lookup_source`) live beside this adapter; transformers' assisted loop owns verification and the lossless
acceptance rule.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation import CandidateGenerator
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..stats import GenerationStats, last_stats_slot
from .drafter_source import DraftChooser, DrafterSource
from .lookup_source import LookupSource
from .policy import RoundPolicy
from .proposal import Proposal, RoundInputs, Verdict, on_accelerator, one_transfer
from .round import Round
from .target_features import TargetTap

# warpers that never change which token has the largest logit: argmax proposals can skip them
_ARGMAX_PRESERVING = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


class ReTraceCandidateGenerator(CandidateGenerator):
    """Drafts one round per ``get_candidates`` through a :class:`Round` over the policy's sources; reads the verdict
    from the committed length (no transfer: one host sync per round at T=0 in the accelerator order).

    Built fresh by ``target.generate(..., assistant_model=drafter)`` for every call: all state (the drafter's cache,
    the lookup index, ReTrace's carry, the stats) lives in its sources and dies with the call. A drafter view's own
    ``drafter_source`` (``drafter.with_drafter_source(cls)``) replaces :class:`DrafterSource` (tests' fixed proposals).
    ``rows``: the call's batch size (a row of a batch runs without the round guard: :meth:`RoundPolicy.guard`).
    """

    def __init__(
        self,
        drafter: Any,
        target: Any,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None,
        prompt_length: int,
        policy: RoundPolicy | None = None,
        rows: int = 1,
    ):
        self.policy = policy = policy if policy is not None else RoundPolicy()
        self.drafter, self.prompt_length = drafter, prompt_length
        self.max_length = generation_config.max_length
        sampled = bool(generation_config.do_sample) and policy.proposal_mode == "sample"
        processors = [p for p in (logits_processor or []) if sampled or not isinstance(p, _ARGMAX_PRESERVING)]
        eos = generation_config.eos_token_id
        self.eos_token_ids = torch.tensor([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)))
        self.tap = TargetTap(target, drafter.config.target_layer_ids, bool(generation_config.output_hidden_states))
        self.requires_model_outputs = self.tap.uses_model_outputs
        self.model_kwargs_overrides = self.tap.model_kwargs_overrides
        self.stats = GenerationStats(policy=policy.describe())
        last_stats_slot(drafter).set(self.stats)
        vocab_size = target.get_output_embeddings().weight.shape[0]
        choose = DraftChooser(drafter, LogitsProcessorList(processors), sampled, vocab_size)
        source_class = getattr(drafter, "drafter_source", None) or DrafterSource
        self.drafter_source = source_class(drafter, target, policy, self.stats, choose)
        rules = [p for p in processors if not isinstance(p, _ARGMAX_PRESERVING)]  # what a lookup copy must obey
        self.lookup = LookupSource(policy, rules, vocab_size) if policy.lookup else None
        accelerator = on_accelerator(drafter.device) if policy.one_transfer is None else policy.one_transfer
        in_one = one_transfer(accelerator, sampled, slot_processors=bool(processors))
        sources = [s for s in (self.lookup, self.drafter_source) if s is not None]
        self.round = Round(policy, sources, self.stats, self.eos_token_ids.tolist(),
                           launch_first=self.drafter_source if in_one else None, rows=rows)
        self.proposal: Proposal | None = None  # the round awaiting its verdict
        self._verify_started = 0.0
        self._step_started: float | None = None  # when the step awaiting its verdict began (a round or a plain step)

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens one round can propose (a drafter block's or a lookup copy's): transformers >= 5.25 sizes the
        target cache's rollback record by it (``cache.activate_past_recording``)."""
        return max(self.drafter.config.block_size - 1, self.policy.lookup_cap if self.lookup is not None else 0)

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
        started = self._step_started = time.perf_counter()
        anchor = input_ids.shape[1] - 1  # the newest committed token; the target has no states for it yet
        self.drafter_source.read(self.tap.window(model_outputs), anchor)
        inputs = RoundInputs(anchor, self.max_length - input_ids.shape[1] - 1, input_ids)
        proposal = self.round.propose(inputs, len(self.lookup.index) if self.lookup is not None else None)
        if proposal is None:
            return input_ids, None
        self.stats.draft_seconds += time.perf_counter() - started
        if len(proposal) == 0:  # the processors allow no token of the draft vocabulary at slot 1
            return input_ids, None
        self.proposal, self._verify_started = proposal, time.perf_counter()
        return torch.cat([input_ids, proposal.tokens], dim=-1), proposal.logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: Any):
        """Read the verdict and hand it to the round (stats, guard, sources)."""
        proposal, self.proposal = self.proposal, None
        self.stats.new_tokens = input_ids.shape[1] - self.prompt_length
        # the step's wall time, the drafter's window read to the verdict (None after the prefill: not a step)
        started, self._step_started = self._step_started, None
        seconds = None if started is None else time.perf_counter() - started
        if proposal is None:
            if seconds is not None:  # the target stepped alone: what a round is priced against
                self.round.observe_plain(seconds)
            return
        # the loop commits the accepted drafts and one token of the target's: read without a transfer (== num_matches)
        accepted = input_ids.shape[1] - proposal.anchor - 2
        try:
            self.round.observe(proposal, Verdict(accepted, input_ids, scores), seconds)
        finally:  # the verify clock runs until the verdict is read, as for transformers' own generators
            self.stats.verify_seconds += time.perf_counter() - self._verify_started

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
