"""The target's tapped hidden states for training, and the batches the drafter trains on.

The drafter reads ``concat(hidden_states[i + 1] for i in target_layer_ids)`` (index 0 is the embeddings; as in
transformers, the last index is taken after the final norm), exactly what :class:`hf_retrace.generation.TargetTap`
feeds it during ``generate``.

* Online: :class:`OnlineFeatures` runs a no-grad target forward inside the training step.
* Precomputed: :mod:`~hf_retrace.training.precomputed_features` computes them once to disk and memory-maps them.
* :class:`FeatureDataset` joins token sequences and (precomputed) features; :func:`collate_sequences` pads them into
  a batch.

Example::

    dataset = FeatureDataset(TokenizedDataset("work_data/tok"))
    trainer = Trainer(objective, dataset, args, feature_fn=OnlineFeatures(target, [1, 8, 14, 20, 27]))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from .precomputed_features import PrecomputedFeatures

__all__ = ["FeatureDataset", "OnlineFeatures", "collate_sequences", "tapped_hidden_states"]


@torch.no_grad()
def tapped_hidden_states(
    target: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    target_layer_ids: Sequence[int],
) -> torch.Tensor:
    """``[b, T, n*H]``: the concatenated ``hidden_states[i + 1]`` of a no-grad target forward (lm_head skipped)."""
    num_layers = target.config.get_text_config().num_hidden_layers
    bad = [i for i in target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"target_layer_ids {list(target_layer_ids)} out of range for a {num_layers}-layer target.")
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    module = decoder if decoder is not None else target
    out = module(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    states = out.hidden_states
    return torch.cat([states[i + 1] for i in target_layer_ids], dim=-1)


class OnlineFeatures:
    """Callable ``batch -> batch`` that adds ``target_hidden`` from a no-grad forward of the (frozen) target."""

    def __init__(self, target: nn.Module, target_layer_ids: Sequence[int]):
        self.target = target.eval()
        for p in self.target.parameters():
            p.requires_grad_(False)
        self.target_layer_ids = list(target_layer_ids)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        device = next(self.target.parameters()).device
        batch = dict(batch)
        batch["target_hidden"] = tapped_hidden_states(
            self.target, batch["input_ids"].to(device), batch["attention_mask"].to(device), self.target_layer_ids
        )
        return batch


def collate_sequences(items: Sequence[dict[str, torch.Tensor]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad ``input_ids``/``loss_mask`` (and ``target_hidden`` when present) into a batch + ``attention_mask``."""
    lengths = [int(item["input_ids"].shape[0]) for item in items]
    b, t = len(items), max(lengths)
    input_ids = torch.full((b, t), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((b, t), dtype=torch.bool)
    attention_mask = torch.zeros((b, t), dtype=torch.long)
    for row, (item, length) in enumerate(zip(items, lengths)):
        input_ids[row, :length] = item["input_ids"]
        loss_mask[row, :length] = item["loss_mask"].bool()
        attention_mask[row, :length] = 1
    batch = {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}
    for key in ("target_hidden", "target_topk"):  # per-position rows, zero-padded
        if key in items[0]:
            first = items[0][key]
            padded = first.new_zeros((b, t, first.shape[-1]))
            for row, (item, length) in enumerate(zip(items, lengths)):
                padded[row, :length] = item[key]
            batch[key] = padded
    if "index" in items[0]:
        batch["index"] = torch.tensor([int(item["index"]) for item in items])
    return batch


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
