"""A batch's KV cache with masked slots: the one compaction rule for the batch loop's target cache and its drafter's.

Rows of a batch commit different numbers of tokens, but a ``DynamicCache`` holds one length for all rows, so a slot a
row did not commit stays in the cache and a 2-D mask (1 = the row's own slot) keeps it out of every later attention
(:mod:`.batched`). Masked slots are still read; :func:`compact_when_worth_it` gathers each row's slots to the right of
the cache once what that removes outnumbers what the rows hold.

Example::

    mask = compact_when_worth_it(cache, mask)   # after appending a round's slots and their mask columns
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["COMPACT_WHEN_MASKED_OVER", "compact", "compact_when_worth_it", "compaction_gain"]

# compact once the masked slots a compaction would remove outnumber the slots the rows hold this many times
COMPACT_WHEN_MASKED_OVER = 1.0


def compaction_gain(mask: torch.Tensor) -> int:
    """How many masked cache slots a compaction would remove: the columns past the fullest row's slots, in every row
    (left padding that some row still needs stays).

    >>> compaction_gain(torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 1, 1]]))
    4
    """
    return mask.shape[0] * (mask.shape[1] - int(mask.sum(-1).max()))


def compact(cache: Any, mask: torch.Tensor) -> torch.Tensor:
    """Gather each row's slots to the right of the cache (RoPE is already in the keys, so a slot's position travels
    with it); returns the new mask. Left as is where the cache's layers do not expose their tensors."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        return mask
    width = int(mask.sum(-1).max())
    # per row: the indices of its slots, right-aligned; padding points at slot 0 and is masked
    order = torch.sort(mask.long() * torch.arange(1, mask.shape[1] + 1, device=mask.device), dim=-1,
                       stable=True).values[:, -width:]
    new_mask = (order > 0).to(mask.dtype)
    for layer in layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        index = (order - 1).clamp_min(0).to(layer.keys.device)[:, None, :, None]
        layer.keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1]))
        layer.values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1, layer.values.shape[-1]))
    return new_mask


def compact_when_worth_it(cache: Any, mask: torch.Tensor) -> torch.Tensor:
    """:func:`compact` when its gain exceeds ``COMPACT_WHEN_MASKED_OVER`` times the slots the rows hold; the mask."""
    if compaction_gain(mask) > COMPACT_WHEN_MASKED_OVER * int(mask.sum()):
        return compact(cache, mask)
    return mask
