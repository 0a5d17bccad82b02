"""Token sequences joined with what was precomputed for them: the target's tapped states and top-k distributions.

Example::

    dataset = FeatureDataset(TokenizedDataset("work_data/tok"), PrecomputedFeatures("work_data/feats"))
    batch = collate_sequences([dataset[0], dataset[1]])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .precomputed_features import PrecomputedFeatures

__all__ = ["FeatureDataset"]


class FeatureDataset(torch.utils.data.Dataset):
    """Items ``{input_ids, loss_mask, index[, target_hidden][, target_topk]}`` of a tokenized dataset, with the
    precomputed features and the target's top-k distributions (``topk``, a ``kind="topk"`` store) joined if given."""

    def __init__(self, sequences: Any, features: PrecomputedFeatures | None = None,
                 indices: Sequence[int] | None = None, topk: PrecomputedFeatures | None = None):
        self.sequences = sequences
        self.features = features
        self.topk = topk
        self.indices = list(range(len(sequences))) if indices is None else list(indices)
        needed = max(self.indices) + 1 if self.indices else 0
        for store, what in ((features, "features"), (topk, "top-k distributions")):
            if store is not None and len(store) < needed:
                raise ValueError(
                    f"The {what} cover {len(store)} sequences but training reads the first {needed}; "
                    f"precompute the {what} for them (no --limit), or train on fewer (--max-sequences)."
                )

    def __len__(self) -> int:
        return len(self.indices)

    def sequence_lengths(self) -> np.ndarray:
        return self.sequences.sequence_lengths()[self.indices]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        index = self.indices[i]
        item = dict(self.sequences[index])
        item["index"] = index
        for store, key in ((self.features, "target_hidden"), (self.topk, "target_topk")):
            if store is not None:
                rows = store[index]
                if rows.shape[0] != item["input_ids"].shape[0]:
                    raise ValueError(f"sequence {index}: {item['input_ids'].shape[0]} tokens but {rows.shape[0]} "
                                     f"rows in {store.directory}.")
                item[key] = rows
        return item
