"""One drafter forward for every running row of a batch (the batch loop's drafting, :mod:`.batched`).

Each row keeps its own :class:`~.drafter_source.DrafterSource` (what it read from the target, ReTrace's carry, the
confidence cut, the choice of drafts); only the forward is shared. The rows' drafter context caches become one
cache with a row per running row: each forward appends every row's new context rows, right-padded to the longest, and
a key mask (True = a row's own context slot) keeps the padding out of every later attention, as the target's cache
does in the batch loop. Each row's block then attends to exactly the keys it would attend to alone, at its own
positions: its drafts are the ones a batch-1 call makes (up to the rounding of a batched forward).

Every running row's block is drafted each round, before the rows' rounds decide (as the accelerator order does at
batch 1): a row whose round then takes a lookup copy, or steps plainly, leaves its block unused. Its context is in the
cache either way. Drafters with sliding-window layers, and sources that are no ``DrafterSource``, draft row by row
(:func:`batches_drafts`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from .batched_cache import compact_when_worth_it
from .drafter_source import DrafterSource

__all__ = ["BatchedDrafterForward", "batches_drafts"]


def batches_drafts(drafter: Any, sources: list[Any]) -> bool:
    """Whether one forward can draft for these rows' sources (else each source runs its own forward)."""
    sliding = "sliding_attention" in (getattr(drafter.config, "layer_types", None) or [])
    return not sliding and all(isinstance(source, DrafterSource) for source in sources)


class BatchedDrafterForward:
    """The shared drafter cache of a batch; :meth:`draft` runs one forward for the given rows' sources and hands each
    source its row's block states (its ``_forward`` then returns them instead of running the drafter).

    Example::

        shared = BatchedDrafterForward(drafter)
        shared.draft(sources, anchor_tokens)    # before the rows' rounds propose
        shared.keep([0, 2])                     # row 1 finished: its cache row goes
    """

    def __init__(self, drafter: Any):
        self.drafter = drafter
        self.cache = DynamicCache()
        self.mask: torch.Tensor | None = None  # [rows, cached slots]: 1 where a row's own context sits

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order), as the batch loop's target cache does."""
        index = torch.tensor(rows, device=self.drafter.device)
        if self.mask is not None:
            self.cache.batch_select_indices(index)
            self.mask = self.mask[index]

    @torch.no_grad()
    def draft(self, sources: list[DrafterSource], anchor_tokens: torch.Tensor) -> None:
        """One forward over every row's ``[new context rows ; anchor, MASK x (B-1)]``; ``anchor_tokens`` ``[rows]`` are
        the rows' newest committed tokens (their anchors sit at each source's ``context_length``)."""
        drafter, device = self.drafter, self.drafter.device
        block_size = drafter.config.block_size
        fresh = [source.pending_context for source in sources]
        counts = [0 if rows is None else rows.shape[1] for rows in fresh]
        width = max(counts)
        features = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
        context = torch.zeros((len(sources), width, features), dtype=drafter.dtype, device=device)
        positions = torch.zeros((len(sources), width + block_size), dtype=torch.long, device=device)
        valid = torch.zeros((len(sources), width), dtype=torch.long, device=device)
        blocks = []
        for r, (source, rows, count) in enumerate(zip(sources, fresh, counts)):
            if count:
                context[r, :count] = rows[0].to(device, drafter.dtype)
                valid[r, :count] = 1
            positions[r, :count] = torch.arange(source.cache_length, source.cache_length + count, device=device)
            anchor = source.context_length
            positions[r, width:] = torch.arange(anchor, anchor + block_size, device=device)
            blocks.append(drafter.block_embeddings(anchor_tokens[r : r + 1].to(device), source.embed_tokens,
                                                   source.aligned, source.policy.retrace_ablation))
        cached = self.mask if self.mask is not None else valid[:, :0]
        keys = torch.cat([cached, valid, torch.ones((len(sources), block_size), dtype=torch.long, device=device)], 1)
        attention_mask = keys.bool()[:, None, None, :].expand(-1, 1, block_size, -1)
        hidden = drafter(context=drafter.project_context(context), noise_embedding=torch.cat(blocks),
                         position_ids=positions, past_key_values=self.cache, use_cache=True,
                         attention_mask=attention_mask)
        self.cache.crop(-block_size)  # keep the context K/V, drop the blocks' (negative: 4.57 and 5.x)
        self.mask = torch.cat([cached, valid], 1)
        self.mask = compact_when_worth_it(self.cache, self.mask)
        for r, source in enumerate(sources):
            source.pending_context, source.cache_length = None, source.context_length
            source._forward = _block_states(hidden[r : r + 1])


def _block_states(hidden: torch.Tensor) -> Any:
    """A source's ``_forward`` for this round: its row of the shared forward (slot 0 is the anchor)."""
    return lambda inputs: hidden
