"""The target's tapped hidden states computed once, written to disk and memory-mapped for training.

:func:`precompute_features` runs one pass over a :class:`~hf_retrace.training.data.TokenizedDataset` and writes raw
row-major arrays (``features-00000.bin`` ..., ``[tokens, n*H]`` in the target's dtype, bf16 kept bit-exact) plus
``features.json`` (layer ids, dtype, per-shard sequence ranges and offsets). It resumes after the last complete
shard. :class:`PrecomputedFeatures` memory-maps them, for :class:`~hf_retrace.training.features.FeatureDataset`.

Example::

    precompute_features(target, TokenizedDataset("work_data/tok"), "work_data/feats", [1, 8, 14, 20, 27])
    dataset = FeatureDataset(TokenizedDataset("work_data/tok"), PrecomputedFeatures("work_data/feats"))
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .features import collate_sequences, tapped_hidden_states

__all__ = [
    "DEFAULT_MAX_BATCH_TOKENS",
    "PrecomputedFeatures",
    "covered_sequences",
    "features_manifest",
    "precompute_features",
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


def _dataset_fingerprint(dataset: Any) -> dict[str, Any]:
    lengths = dataset.sequence_lengths()
    return {"num_sequences": int(len(lengths)), "num_tokens": int(lengths.sum())}


def _write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    tmp = out_dir / (FEATURES_MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    tmp.replace(out_dir / FEATURES_MANIFEST)


def _feature_settings(target: nn.Module, dataset: Any, target_layer_ids: Sequence[int], storage_dtype: torch.dtype,
                      shard_sequences: int, total: int) -> dict[str, Any]:
    """What ``features.json`` records about how the features were made (a resume must match them)."""
    name = _dtype_name(storage_dtype)
    if name not in _STORAGE:
        raise ValueError(f"storage dtype must be one of {list(_STORAGE)}, got {name}.")
    hidden = target.config.get_text_config().hidden_size
    return {
        "target": str(getattr(target.config, "_name_or_path", "")),
        "target_layer_ids": list(target_layer_ids),
        "hidden_size": hidden,
        "feature_size": hidden * len(target_layer_ids),
        "dtype": name,
        "shard_sequences": shard_sequences,
        "dataset": {**_dataset_fingerprint(dataset), "directory": str(getattr(dataset, "directory", ""))},
        "num_sequences": total,
    }


def _resumed_manifest(out_dir: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """A fresh manifest, the existing one's shards still on disk, or the existing one when complete.

    Settings that differ from an existing ``features.json`` are a ``ValueError``."""
    manifest: dict[str, Any] = {**settings, "complete": False, "shards": []}
    if not (out_dir / FEATURES_MANIFEST).exists():
        return manifest
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
    return manifest


def _length_batches(shard_lengths: np.ndarray, max_batch_tokens: int) -> Iterator[np.ndarray]:
    """A shard's rows, longest first, in batches of at most ``max_batch_tokens`` padded tokens (at least one row)."""
    order = np.argsort(-shard_lengths, kind="stable")
    pos = 0
    while pos < len(order):
        longest = int(shard_lengths[order[pos]])
        rows = order[pos : pos + max(1, max_batch_tokens // max(longest, 1))]
        pos += len(rows)
        yield rows


def _write_feature_shard(target: nn.Module, dataset: Any, target_layer_ids: Sequence[int], storage_dtype: torch.dtype,
                         path: Path, start: int, shard_lengths: np.ndarray, max_batch_tokens: int,
                         report: Callable[[int], None]) -> np.ndarray:
    """Write the tapped states of sequences ``start ..`` to ``path`` (through a temporary file); return the offsets."""
    np_dtype, _ = _STORAGE[_dtype_name(storage_dtype)]
    device = next(target.parameters()).device
    offsets = np.concatenate([[0], np.cumsum(shard_lengths)]).astype(np.int64)
    feature_size = target.config.get_text_config().hidden_size * len(target_layer_ids)
    tmp = path.with_name(path.name + ".tmp")
    array = np.memmap(tmp, dtype=np_dtype, mode="w+", shape=(int(offsets[-1]), feature_size))
    for rows in _length_batches(shard_lengths, max_batch_tokens):
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
        report(int(sum(shard_lengths[r] for r in rows)))
    array.flush()
    del array
    tmp.replace(path)
    return offsets


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
    storage_dtype = storage_dtype or next(target.parameters()).dtype
    lengths = dataset.sequence_lengths()
    total = len(lengths) if limit is None else min(limit, len(lengths))
    settings = _feature_settings(target, dataset, target_layer_ids, storage_dtype, shard_sequences, total)
    manifest = _resumed_manifest(out_dir, settings)
    if manifest["complete"]:
        return manifest
    out_dir.mkdir(parents=True, exist_ok=True)
    done = {s["start"] for s in manifest["shards"]}
    starts = list(range(0, total, shard_sequences))
    todo_tokens = int(sum(lengths[s : min(s + shard_sequences, total)].sum() for s in starts if s not in done))
    bar = tqdm(total=todo_tokens, desc="features", unit="tok", unit_scale=True, disable=not progress, mininterval=5)
    begin = time.perf_counter()
    processed = 0

    def report(tokens: int) -> None:
        nonlocal processed
        processed += tokens
        bar.update(tokens)
        bar.set_postfix(tok_s=f"{processed / (time.perf_counter() - begin):.0f}")

    target.eval()
    for index, start in enumerate(starts):
        if start in done:
            continue
        end = min(start + shard_sequences, total)
        file = f"features-{index:05d}.bin"
        offsets = _write_feature_shard(target, dataset, target_layer_ids, storage_dtype, out_dir / file, start,
                                       lengths[start:end].astype(np.int64), max_batch_tokens, report)
        manifest["shards"].append({"file": file, "start": start, "end": end, "offsets": offsets.tolist()})
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


