"""The ReTrace stage: teach the fusion module to use what the previous round drafted and the target rejected.

Two passes per anchor ``s``, all blocks of a sequence batched:

1. no grad: the backbone drafts ``[y_s, MASK...]`` -> drafts ``d`` and hidden states ``h``; the verification signals
   come from a target forward over ``[y_<=s, d_1..d_{B-1}]`` ("exact": one extra target forward per sequence,
   every block batched through a block-causal 4D mask on the sequence's KV cache) or from the teacher-forced
   target outputs on the true sequence ("teacher-forced": cheaper, but its target tokens are the labels themselves
   on target-generated data, so it overstates what the target's verdict says at inference); ``n`` = leading
   drafts equal to the data.
2. grad: the next block at ``s' = s+n+1`` with slot 0 = ``y_s'`` and the kept slots ``j = n+2..B-1`` fused into
   slots ``i = j-n-1``; loss = the DFlash decayed cross-entropy against ``y_{s'+i}``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..generation.target_features import cache_kwargs, decoder_of, extract_context_feature
from ..retrace import AlignedSuffix, RejectedSuffix, first_kept_slot
from .objective import DEFAULT_GAMMA, DFlashObjective, sample_anchors

VERIFICATION_MODES = ("exact", "teacher-forced")


class ReTraceObjective(DFlashObjective):
    """``forward(batch) -> (loss, metrics)`` for the ReTrace stage; ``batch`` as for :class:`DFlashObjective`
    without ``target_hidden`` (the target runs here: its cache is needed for exact verification)."""

    def __init__(self, drafter, target, num_anchors: int = 16, gamma: float | None = DEFAULT_GAMMA,
                 verification: str = "exact"):
        if verification not in VERIFICATION_MODES:
            raise ValueError(f"verification must be one of {VERIFICATION_MODES}, got {verification!r}.")
        if drafter.retrace is None:
            drafter.add_retrace()
        super().__init__(drafter, target.get_input_embeddings(), target.get_output_embeddings(), num_anchors, gamma)
        self.frozen.target = target.eval()
        for p in target.parameters():
            p.requires_grad_(False)
        self.verification = verification
        self.retrace_ablation = drafter.config.retrace_ablation  # the variant this run trains, fixed for the run
        drafter.config.retrace = "trained"  # this stage trains it: on in the shipped policy of its evaluations

    @torch.no_grad()
    def _first_pass(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Context features, anchors, the backbone's drafts at them, and the target's verdict on those drafts."""
        target, drafter = self.frozen.target, self.drafter
        input_ids, loss_mask, attention_mask = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
        lengths = attention_mask.long().sum(1)
        decoder = decoder_of(target)
        if self.verification == "exact":
            from transformers import DynamicCache

            cache = DynamicCache()
            out = decoder(input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(decoder, cache),
                          use_cache=True, output_hidden_states=True)
        else:
            out = decoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        features = extract_context_feature(out.hidden_states, drafter.config.target_layer_ids)
        anchors, anchor_valid = sample_anchors(loss_mask, lengths, self.num_anchors, batch.get("anchor_generator"))
        drafts, hidden, _ = self.backbone_drafts(input_ids, features, anchors, anchor_valid)
        # the target's verdict at slots 1..B-1: its own token/probability for position s+j, and its states at row j
        if self.verification == "exact":
            logits, verify_features = self._exact_verdict(input_ids, anchors, drafts, cache)
        else:
            logits, verify_features = self._teacher_forced_verdict(out.last_hidden_state, features, anchors)
        target_p, target_t = logits.float().softmax(-1).max(-1)

        labels, label_valid = self.labels(input_ids, loss_mask, lengths, anchors, anchor_valid)
        matches = (drafts == labels) & label_valid
        accepted = matches.long().cumprod(-1).sum(-1)  # n per block
        return dict(
            features=features, anchors=anchors, anchor_valid=anchor_valid, accepted=accepted, drafts=drafts,
            drafter_hidden=hidden, target_tokens=target_t, target_probs=target_p,
            target_features=drafter.project_context(verify_features), lengths=lengths,
        )

    def _exact_verdict(self, input_ids: torch.Tensor, anchors: torch.Tensor, drafts: torch.Tensor,
                       cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over ``[y_s, d_1..d_{B-1}]`` of every block on the sequence's cache (block-causal)."""
        target, block = self.frozen.target, self.block_size
        b, t = input_ids.shape
        n_blocks = anchors.shape[1]
        verify_ids = torch.cat([torch.gather(input_ids, 1, anchors)[..., None], drafts], dim=-1)  # [b, N, B]
        verify_pos = anchors[..., None] + torch.arange(block, device=anchors.device)
        key_pos = torch.arange(t, device=anchors.device)
        prefix = (key_pos[None, None, :] < anchors[..., None]).repeat_interleave(block, 1)  # [b, N*B, T]
        own = torch.arange(n_blocks, device=anchors.device).repeat_interleave(block)
        causal = torch.tril(torch.ones(block, block, dtype=torch.bool, device=anchors.device)).repeat(
            n_blocks, n_blocks
        )
        inner = (own[:, None] == own[None, :]) & causal
        verify_mask = torch.cat([prefix, inner[None].expand(b, -1, -1)], dim=-1)[:, None]
        verified = target(input_ids=verify_ids.reshape(b, -1), position_ids=verify_pos.reshape(b, -1),
                          attention_mask=verify_mask, **cache_kwargs(target, cache), use_cache=True,
                          output_hidden_states=True)
        logits = verified.logits.reshape(b, n_blocks, block, -1)[:, :, :-1]  # row j-1 -> position s+j
        verify_features = extract_context_feature(verified.hidden_states, self.drafter.config.target_layer_ids)
        verify_features = verify_features.reshape(b, n_blocks, block, -1)[:, :, 1:]  # row j: slot j's token
        return logits, verify_features

    def _teacher_forced_verdict(self, last_hidden_state: torch.Tensor, features: torch.Tensor,
                                anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's outputs on the true sequence at the block's positions (no extra forward)."""
        block = self.block_size
        b, t = last_hidden_state.shape[:2]
        n_blocks = anchors.shape[1]
        rows = (anchors[..., None] + torch.arange(block - 1, device=anchors.device)).clamp(max=t - 1)
        seq_logits = self.frozen.target.get_output_embeddings()(last_hidden_state)
        logits = torch.gather(seq_logits, 1, rows.reshape(b, -1, 1).expand(-1, -1, seq_logits.shape[-1]))
        logits = logits.reshape(b, n_blocks, block - 1, -1)
        feat_rows = (rows + 1).clamp(max=t - 1).reshape(b, -1, 1).expand(-1, -1, features.shape[-1])
        verify_features = torch.gather(features, 1, feat_rows).reshape(b, n_blocks, block - 1, -1)
        return logits, verify_features

    @staticmethod
    def align_next_block(first: dict[str, torch.Tensor], block_size: int) -> tuple[torch.Tensor, AlignedSuffix]:
        """Next anchors ``s' = s+n+1`` and each block's kept slots ``j = n+2..B-1`` on the next block, aligned by
        the same :meth:`RejectedSuffix.align` as inside ``generate`` (one row per block; unkept slots at -1)."""
        n = first["accepted"]  # [b, N]
        b, n_blocks = n.shape
        slot = torch.arange(1, block_size, device=n.device)  # j = 1..B-1
        kept = slot >= first_kept_slot(n[..., None])
        positions = torch.where(kept, first["anchors"][..., None] + slot, -1)

        def rows(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(b * n_blocks, *x.shape[2:])

        suffix = RejectedSuffix(
            positions=rows(positions),
            drafter_hidden=rows(first["drafter_hidden"]),
            rejected_tokens=rows(first["drafts"]),
            target_tokens=rows(first["target_tokens"]),
            target_probs=rows(first["target_probs"]),
            target_features=rows(first["target_features"]),
        )
        next_anchors = first["anchors"] + n + 1
        return next_anchors, suffix.align(next_anchors.reshape(-1), block_size)

    def forward(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        first = self._first_pass(batch)
        next_anchors, aligned = self.align_next_block(first, self.block_size)
        lengths = first["lengths"]
        # keep blocks that left a suffix to fuse and whose next anchor still has a label at slot 1
        kept = aligned.valid.any(-1).reshape(next_anchors.shape)
        inside = next_anchors + 1 < lengths[:, None]
        response = torch.gather(batch["loss_mask"].bool(), 1, next_anchors.clamp(max=batch["input_ids"].shape[1] - 1))
        next_valid = first["anchor_valid"] & kept & inside & response
        second = dict(batch, target_hidden=first["features"], anchors=next_anchors.masked_fill(~next_valid, 0),
                      anchor_valid=next_valid, aligned_suffix=aligned)
        loss, metrics = super().forward(second)
        with torch.no_grad():
            metrics["kept_fraction"] = kept.float().mean()
            metrics["first_pass_accepted"] = first["accepted"].float().mean()
            metrics["kept_agree"] = (aligned.rejected_tokens == aligned.target_tokens)[aligned.valid].float().mean()
        return loss, metrics
