"""ReTrace: what a round drafted and the target rejected, kept, aligned with the next block and fused through a gate.

After round r (anchor at position ``s``, ``k`` drafted slots, ``n`` accepted), slot ``j = n+2 .. k`` of the old block
sits at absolute position ``s + j`` which is slot ``i = j - n - 1`` of the next block (anchor ``s' = s + n + 1``).
Slot ``n+1`` holds the target's correction, the next anchor, so nothing is kept for it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from .configuration import RETRACE_ABLATIONS, ReTraceConfig


def first_kept_slot(accepted: Any) -> Any:
    """The first slot of a block that a round keeps: ``n + 2`` after ``n`` accepted drafts (slot ``n + 1`` holds the
    target's correction). An int, or a tensor of accepted counts (the training stage's blocks)."""
    return accepted + 2


@dataclass(frozen=True)
class PendingSuffix:
    """The rejected suffix of one round as its verification leaves it: everything but the target's tapped states.

    The target computed those states in the same verification forward, but they reach the drafter only with the next
    call's window; :meth:`complete` then makes the immutable :class:`RejectedSuffix`. Nothing is ever half-filled.
    """

    anchor_position: int  # s: the anchor of the round that drafted the suffix
    positions: torch.Tensor  # [1, m] absolute positions s+j of the kept slots j = n+2 .. k
    drafter_hidden: torch.Tensor  # [1, m, H]
    rejected_tokens: torch.Tensor  # [1, m]
    target_tokens: torch.Tensor  # [1, m]
    target_probs: torch.Tensor  # [1, m]

    def __len__(self) -> int:
        return self.positions.shape[-1]

    @property
    def window_rows(self) -> torch.Tensor:
        """Rows of the verification window (which starts at the anchor) that hold the target's view of each slot."""
        return self.positions[0] - self.anchor_position

    def complete(self, target_features: torch.Tensor) -> "RejectedSuffix":
        """The immutable suffix, given the target's (projected) states at :attr:`window_rows`, ``[1, m, H]``."""
        verdict = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "anchor_position"}
        return RejectedSuffix(**verdict, target_features=target_features)


@dataclass(frozen=True)
class RejectedSuffix:
    """The rejected suffix of one round, in its own coordinates (``[b, m]`` rows; ``b = 1`` inside ``generate``).

    Every field comes from passes that already ran: the drafter's block forward and the target's verification.
    Rows after the first rejection were computed by the target on a prefix holding a wrong token: they are signals,
    never truths, and nothing here is ever committed. A position below 0 marks a row that holds no kept slot
    (batched training keeps fixed shapes); :meth:`align` leaves it out.
    """

    positions: torch.Tensor  # [b, m] absolute positions s+j of the kept slots (-1: none)
    drafter_hidden: torch.Tensor  # [b, m, H] the drafter's normed last hidden state at those slots
    rejected_tokens: torch.Tensor  # [b, m] d[j]
    target_tokens: torch.Tensor  # [b, m] t[j]: the target's own choice for position s+j
    target_probs: torch.Tensor  # [b, m] p[j]: the target's probability of t[j]
    target_features: torch.Tensor  # [b, m, H] f[j]: tapped target states at row j via the drafter's fc/hidden_norm

    @property
    def agree(self) -> torch.Tensor:
        """``1[d[j] == t[j]]``: where the rejected draft matched the target's own (conditional) choice."""
        return self.rejected_tokens == self.target_tokens

    def __len__(self) -> int:
        return self.positions.shape[-1]

    def align(self, anchor_position: torch.Tensor | int, block_size: int) -> "AlignedSuffix":
        """Place the kept slots on the next block by absolute position; unaligned slots stay MASK (``valid`` False)."""
        b, m = self.rejected_tokens.shape
        device = self.rejected_tokens.device
        anchor = torch.as_tensor(anchor_position, device=device).reshape(-1, 1)
        slot = self.positions - anchor  # new slot index of each kept row
        valid_row = (slot >= 1) & (slot <= block_size - 1) & (self.positions >= 0)
        rows = torch.arange(b, device=device)[:, None].expand(b, m)
        slot = slot.clamp(1, block_size - 1) - 1  # index among the B-1 masked slots

        def scatter(src: torch.Tensor) -> torch.Tensor:
            out = src.new_zeros((b, block_size - 1) + tuple(src.shape[2:]))
            out[rows[valid_row], slot[valid_row]] = src[valid_row]
            return out

        valid = torch.zeros(b, block_size - 1, dtype=torch.bool, device=device)
        valid[rows[valid_row], slot[valid_row]] = True
        return AlignedSuffix(
            valid=valid,
            drafter_hidden=scatter(self.drafter_hidden),
            rejected_tokens=scatter(self.rejected_tokens),
            target_tokens=scatter(self.target_tokens),
            target_probs=scatter(self.target_probs),
            target_features=scatter(self.target_features),
        )


@dataclass(frozen=True)
class AlignedSuffix:
    """A rejected suffix laid onto the ``B-1`` masked slots of a block (``[N, B-1, ...]``); ``valid`` marks kept slots."""

    valid: torch.Tensor
    drafter_hidden: torch.Tensor
    rejected_tokens: torch.Tensor
    target_tokens: torch.Tensor
    target_probs: torch.Tensor
    target_features: torch.Tensor

    def to(self, device: torch.device | str) -> "AlignedSuffix":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})


class ReTraceFusion(nn.Module):
    """Refiner + gated residual fusion into the masked slots' input embeddings.

    ``r[i] = Refine(norm(h[j]), E[d[j]], E[t[j]], f[j], p[j], agree[j]) + E[d[j]]`` (a 2-layer MLP with a skip of the
    rejected draft token, ours: it makes ``r`` informative from the first step, so the zero-initialised ``W_o`` learns
    fast; why ``d`` and not ``t``: docs/retrace/kept-suffix-premise.md) and ``e[i] = E[MASK] + g[i] * W_o r[i]`` with
    ``g[i] = sigmoid(W_g [E[MASK]; r[i]] + b_g)``. ``W_o`` starts at zero, so an untrained module drafts exactly what
    its DFlash backbone drafts.
    """

    def __init__(self, config: ReTraceConfig):
        super().__init__()
        hidden = config.hidden_size
        self.refine = nn.Sequential(
            nn.Linear(4 * hidden + 2, config.retrace_hidden_size),
            nn.SiLU(),
            nn.Linear(config.retrace_hidden_size, hidden),
        )
        self.gate = nn.Linear(2 * hidden, hidden)
        self.output_projection = nn.Linear(hidden, hidden, bias=False)
        self.output_projection.zero_init = True  # read by the drafter's _init_weights
        nn.init.zeros_(self.output_projection.weight)

    def forward(
        self,
        mask_embeds: torch.Tensor,
        suffix: RejectedSuffix | AlignedSuffix,
        input_embeddings: nn.Module,
        ablation: str = "full",
    ) -> torch.Tensor:
        """Fuse ``suffix`` into ``mask_embeds`` (``[N, B-1, H]``); rows without a kept slot are returned unchanged.

        ``ablation`` (one of ``RETRACE_ABLATIONS``) is the caller's choice for this forward, never read from a config.
        """
        if isinstance(suffix, RejectedSuffix):
            raise TypeError("align the RejectedSuffix with the next block first: `suffix.align(anchor_position, B)`")
        if ablation not in RETRACE_ABLATIONS:
            raise ValueError(f"ablation must be one of {RETRACE_ABLATIONS}, got {ablation!r}.")
        aligned = suffix.to(mask_embeds.device)
        dtype = mask_embeds.dtype
        h = aligned.drafter_hidden.to(dtype)
        e_draft = input_embeddings(aligned.rejected_tokens).to(dtype)
        e_target = input_embeddings(aligned.target_tokens).to(dtype)
        f = aligned.target_features.to(dtype)
        p = aligned.target_probs.to(dtype)[..., None]
        agree = (aligned.rejected_tokens == aligned.target_tokens).to(dtype)[..., None]
        if ablation == "no_correction":
            e_target, f, p, agree = (torch.zeros_like(x) for x in (e_target, f, p, agree))
        elif ablation == "tokens_only":
            h, f = torch.zeros_like(h), torch.zeros_like(f)
        correction = self.refine(torch.cat([h, e_draft, e_target, f, p, agree], dim=-1)) + e_draft
        update = self.output_projection(correction)
        if ablation != "no_gate":
            update = torch.sigmoid(self.gate(torch.cat([mask_embeds, correction], dim=-1))) * update
        return torch.where(aligned.valid[..., None], mask_embeds + update, mask_embeds)
