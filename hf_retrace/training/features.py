"""The target's tapped hidden states for training: computed online, or once to disk and memory-mapped.

The drafter reads ``concat(hidden_states[i + 1] for i in target_layer_ids)`` (index 0 is the embeddings; as in
transformers, the last index is taken after the final norm), exactly what :class:`hf_retrace.generation.TargetTap`
feeds it during ``generate``.

* Online: :class:`OnlineFeatures` runs a no-grad target forward inside the training step.
* Precomputed: :func:`precompute_features` runs one pass over a :class:`~hf_retrace.training.data.TokenizedDataset`
  and writes raw row-major arrays (``features-00000.bin`` ..., ``[tokens, n*H]`` in the target's dtype, bf16 kept
  bit-exact) plus ``features.json`` (layer ids, dtype, per-shard sequence ranges and offsets). It resumes after the
  last complete shard. :class:`PrecomputedFeatures` memory-maps them; :class:`FeatureDataset` joins them to the
  token sequences for a DataLoader.

Example::

    precompute_features(target, TokenizedDataset("work_data/tok"), "work_data/feats", [1, 8, 14, 20, 27])
    dataset = FeatureDataset(TokenizedDataset("work_data/tok"), PrecomputedFeatures("work_data/feats"))
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "FeatureDataset",
    "OnlineFeatures",
    "PrecomputedFeatures",
    "collate_sequences",
    "covered_sequences",
    "precompute_features",
    "tapped_hidden_states",
]

FEATURES_MANIFEST = "features.json"
_STORAGE = {  # torch dtype name -> (numpy storage dtype, torch view dtype)
    "bfloat16": (np.uint16, torch.bfloat16),
    "float16": (np.float16, torch.float16),
    "float32": (np.float32, torch.float32),
}


DEFAULT_MAX_BATCH_TOKENS = 8192  # padded tokens per target forward when features are precomputed


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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
    if "target_hidden" in items[0]:
        first = items[0]["target_hidden"]
        hidden = first.new_zeros((b, t, first.shape[-1]))
        for row, (item, length) in enumerate(zip(items, lengths)):
            hidden[row, :length] = item["target_hidden"]
        batch["target_hidden"] = hidden
    if "index" in items[0]:
        batch["index"] = torch.tensor([int(item["index"]) for item in items])
    return batch


# ---------------------------------------------------------------------------------------------------------------
# Precomputed features on disk
# ---------------------------------------------------------------------------------------------------------------


def _dataset_fingerprint(dataset: Any) -> dict[str, Any]:
    lengths = dataset.sequence_lengths()
    return {"num_sequences": int(len(lengths)), "num_tokens": int(lengths.sum())}


def _write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    tmp = out_dir / (FEATURES_MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    tmp.replace(out_dir / FEATURES_MANIFEST)


def precompute_features(
    target: nn.Module,
    dataset: Any,
    out_dir: str | os.PathLike[str],
    target_layer_ids: Sequence[int],
    *,
    shard_sequences: int = 256,
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    storage_dtype: torch.dtype | None = None,
    limit: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Compute the tapped states of every sequence of ``dataset`` once; resumable; returns the manifest.

    ``dataset`` is a :class:`~hf_retrace.training.data.TokenizedDataset` (``sequence_lengths()`` and items with
    ``input_ids``). Shard ``k`` covers sequences ``k*shard_sequences ..``; inside a shard, sequences are batched by
    length (right padding, at most ``max_batch_tokens`` padded tokens per forward). ``storage_dtype`` defaults to
    the target's dtype (bf16 stays bit-exact). ``limit`` stores only the first ``limit`` sequences.
    Settings that differ from an existing ``features.json`` raise a ``ValueError``.
    """
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    device = next(target.parameters()).device
    storage_dtype = storage_dtype or next(target.parameters()).dtype
    name = _dtype_name(storage_dtype)
    if name not in _STORAGE:
        raise ValueError(f"storage dtype must be one of {list(_STORAGE)}, got {name}.")
    np_dtype, _ = _STORAGE[name]
    hidden = target.config.get_text_config().hidden_size
    lengths = dataset.sequence_lengths()
    total = len(lengths) if limit is None else min(limit, len(lengths))
    settings = {
        "target": str(getattr(target.config, "_name_or_path", "")),
        "target_layer_ids": list(target_layer_ids),
        "hidden_size": hidden,
        "feature_size": hidden * len(target_layer_ids),
        "dtype": name,
        "shard_sequences": shard_sequences,
        "dataset": {**_dataset_fingerprint(dataset), "directory": str(getattr(dataset, "directory", ""))},
        "num_sequences": total,
    }
    manifest: dict[str, Any] = {**settings, "complete": False, "shards": []}
    if (out_dir / FEATURES_MANIFEST).exists():
        existing = json.loads((out_dir / FEATURES_MANIFEST).read_text(encoding="utf-8"))
        keys = ("target_layer_ids", "hidden_size", "dtype", "shard_sequences", "num_sequences")
        changed = [k for k in keys if existing.get(k) != settings[k]]
        if existing.get("dataset", {}).get("num_tokens") != settings["dataset"]["num_tokens"]:
            changed.append("dataset")
        if changed:
            raise ValueError(
                f"{out_dir} holds features made with other settings ({changed} differ). Use a new --features-dir, "
                "or delete this one."
            )
        if existing.get("complete"):
            return existing
        manifest["shards"] = [s for s in existing["shards"] if (out_dir / s["file"]).exists()]
    out_dir.mkdir(parents=True, exist_ok=True)
    feature_size = settings["feature_size"]
    done = {s["start"] for s in manifest["shards"]}
    starts = list(range(0, total, shard_sequences))
    todo_tokens = int(sum(lengths[s : min(s + shard_sequences, total)].sum() for s in starts if s not in done))
    bar = tqdm(total=todo_tokens, desc="features", unit="tok", unit_scale=True, disable=not progress, mininterval=5)
    begin = time.perf_counter()
    processed = 0
    target.eval()
    for index, start in enumerate(starts):
        if start in done:
            continue
        end = min(start + shard_sequences, total)
        shard_lengths = lengths[start:end].astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(shard_lengths)]).astype(np.int64)
        file = f"features-{index:05d}.bin"
        tmp = out_dir / (file + ".tmp")
        array = np.memmap(tmp, dtype=np_dtype, mode="w+", shape=(int(offsets[-1]), feature_size))
        order = np.argsort(-shard_lengths, kind="stable")
        pos = 0
        while pos < len(order):
            longest = int(shard_lengths[order[pos]])
            count = max(1, max_batch_tokens // max(longest, 1))
            rows = order[pos : pos + count]
            pos += len(rows)
            batch = collate_sequences([dataset[start + int(r)] for r in rows])
            feats = tapped_hidden_states(
                target, batch["input_ids"].to(device), batch["attention_mask"].to(device), target_layer_ids
            ).to(storage_dtype).cpu()
            for j, r in enumerate(rows):
                length = int(shard_lengths[r])
                block = feats[j, :length].contiguous()
                if np_dtype is np.uint16:
                    block = block.view(torch.int16)
                array[offsets[r] : offsets[r] + length] = block.numpy().view(np_dtype)
            done_tokens = int(sum(shard_lengths[r] for r in rows))
            processed += done_tokens
            bar.update(done_tokens)
            bar.set_postfix(tok_s=f"{processed / (time.perf_counter() - begin):.0f}")
        array.flush()
        del array
        tmp.replace(out_dir / file)
        manifest["shards"].append(
            {"file": file, "start": start, "end": end, "offsets": offsets.tolist()}
        )
        manifest["shards"].sort(key=lambda s: s["start"])
        _write_manifest(out_dir, manifest)
    bar.close()
    manifest["complete"] = True
    manifest["seconds"] = time.perf_counter() - begin
    _write_manifest(out_dir, manifest)
    return manifest


def features_manifest(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``features.json`` of ``directory``, or None when there is none."""
    path = Path(directory) / FEATURES_MANIFEST
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def covered_sequences(manifest: dict[str, Any]) -> int:
    """How many sequences, counted from the first, have features on disk (all of them once ``complete``)."""
    covered = 0
    for shard in sorted(manifest.get("shards", []), key=lambda s: s["start"]):
        if shard["start"] != covered:
            break
        covered = shard["end"]
    return covered


class PrecomputedFeatures:
    """Memory-mapped features written by :func:`precompute_features`; ``features[i]`` is ``[T_i, n*H]``.

    ``allow_partial=True`` reads a folder whose computation is still under way (or was stopped): only the
    sequences covered from the first one on are available, ``len()`` says how many.
    """

    def __init__(self, directory: str | os.PathLike[str], allow_partial: bool = False):
        self.directory = Path(directory)
        manifest = features_manifest(self.directory)
        if manifest is None:
            raise FileNotFoundError(f"No {FEATURES_MANIFEST} in {self.directory}; run precompute_features first.")
        if not manifest.get("complete") and not allow_partial:
            raise ValueError(f"{self.directory} is only partly computed; run precompute_features again to finish it.")
        self.manifest = manifest
        self._covered = covered_sequences(manifest) if not manifest.get("complete") else manifest["num_sequences"]
        self.target_layer_ids = list(manifest["target_layer_ids"])
        np_dtype, self.torch_dtype = _STORAGE[manifest["dtype"]]
        size = manifest["feature_size"]
        self._shards = []
        for shard in sorted(manifest["shards"], key=lambda s: s["start"]):
            if shard["end"] > self._covered:
                break
            offsets = np.asarray(shard["offsets"], dtype=np.int64)
            array = np.memmap(self.directory / shard["file"], dtype=np_dtype, mode="r", shape=(int(offsets[-1]), size))
            self._shards.append((shard["start"], shard["end"], offsets, array))
        self._starts = np.array([s[0] for s in self._shards], dtype=np.int64)

    def __len__(self) -> int:
        return int(self._covered)

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} has no precomputed features (0..{len(self) - 1}).")
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        start, _, offsets, array = self._shards[k]
        row = index - start
        data = np.array(array[offsets[row] : offsets[row + 1]])
        tensor = torch.from_numpy(data)
        if self.torch_dtype is torch.bfloat16:
            tensor = tensor.view(torch.bfloat16)
        return tensor


class FeatureDataset(torch.utils.data.Dataset):
    """Items ``{input_ids, loss_mask, index[, target_hidden]}`` of a tokenized dataset, features joined if given."""

    def __init__(self, sequences: Any, features: PrecomputedFeatures | None = None, indices: Sequence[int] | None = None):
        self.sequences = sequences
        self.features = features
        self.indices = list(range(len(sequences))) if indices is None else list(indices)
        if features is not None:
            needed = max(self.indices) + 1 if self.indices else 0
            if len(features) < needed:
                raise ValueError(
                    f"The features cover {len(features)} sequences but training reads the first {needed}; "
                    "precompute the features for them (no --limit), or train on fewer (--max-sequences)."
                )

    def __len__(self) -> int:
        return len(self.indices)

    def sequence_lengths(self) -> np.ndarray:
        return self.sequences.sequence_lengths()[self.indices]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        index = self.indices[i]
        item = dict(self.sequences[index])
        item["index"] = index
        if self.features is not None:
            hidden = self.features[index]
            if hidden.shape[0] != item["input_ids"].shape[0]:
                raise ValueError(f"sequence {index}: {item['input_ids'].shape[0]} tokens but {hidden.shape[0]} feature rows.")
            item["target_hidden"] = hidden
        return item
