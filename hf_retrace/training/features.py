"""The target's tapped hidden states for training: a no-grad target forward read by the one tap.

The drafter reads :func:`~hf_retrace.generation.target_features.extract_context_feature` of the target's hidden
states, the same function :class:`~hf_retrace.generation.target_features.TargetTap` applies during ``generate``.

* Online: :class:`OnlineFeatures` runs the forward inside the training step.
* Precomputed: :mod:`~hf_retrace.training.precomputed_features` runs it once to disk and memory-maps the result;
  :class:`~hf_retrace.training.feature_dataset.FeatureDataset` joins it to the token sequences.
* :func:`collate_sequences` pads sequences (and their features) into a batch.

Example::

    dataset = FeatureDataset(TokenizedDataset("work_data/tok"))
    trainer = Trainer(objective, dataset, args, feature_fn=OnlineFeatures(target, [1, 8, 14, 20, 27]))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..configuration import layers_out_of_range
from ..generation.target_features import decoder_of, extract_context_feature

__all__ = ["OnlineFeatures", "collate_sequences", "tapped_hidden_states"]


@torch.no_grad()
def tapped_hidden_states(
    target: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    target_layer_ids: Sequence[int],
) -> torch.Tensor:
    """``[b, T, n*H]``: :func:`extract_context_feature` of a no-grad forward of the target's decoder (lm_head
    skipped)."""
    num_layers = target.config.get_text_config().num_hidden_layers
    bad = layers_out_of_range(target_layer_ids, num_layers)
    if bad:
        raise ValueError(f"target_layer_ids {list(target_layer_ids)} out of range for a {num_layers}-layer target.")
    out = decoder_of(target)(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                             use_cache=False)
    return extract_context_feature(out.hidden_states, target_layer_ids)


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
