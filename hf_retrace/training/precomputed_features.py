"""The target's tapped hidden states computed once, written to disk and memory-mapped for training.

:func:`precompute_features` runs one pass over a :class:`~hf_retrace.training.data.TokenizedDataset` and writes raw
row-major arrays (``features-00000.bin`` ..., ``[tokens, n*H]`` in the target's dtype, bf16 kept bit-exact) plus
``features.json`` (layer ids, dtype, per-shard sequence ranges and offsets). It resumes after the last complete
shard. :class:`PrecomputedFeatures` memory-maps them, for :class:`~hf_retrace.training.feature_dataset.FeatureDataset`.

The same store holds, in a folder of its own, the target's top-k next-token distribution at every position
(:func:`precompute_topk`: ``[tokens, 2k]`` float32, the k token ids then their log-probabilities), read by
:class:`PrecomputedFeatures` too, for the distillation term of the objective (``hf-retrace train --topk-dir``).

Example::

    precompute_features(target, TokenizedDataset("work_data/tok"), "work_data/feats", [1, 8, 14, 20, 27])
    precompute_topk(target, TokenizedDataset("work_data/tok"), "work_data/topk16", k=16)
    dataset = FeatureDataset(TokenizedDataset("work_data/tok"), PrecomputedFeatures("work_data/feats"),
                             topk=PrecomputedFeatures("work_data/topk16", kind="topk"))
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..atomic import atomic_path, stale_temporaries, write_text_atomically
from ..configuration import layer_columns
from .features import collate_sequences, tapped_hidden_states

__all__ = [
    "DEFAULT_MAX_BATCH_TOKENS",
    "PrecomputedFeatures",
    "covered_sequences",
    "features_manifest",
    "precompute_features",
    "precompute_topk",
    "STORE_MAKERS",
    "store_fits",
    "store_kind",
    "target_topk",
]

FEATURES_MANIFEST = "features.json"
STORE_MAKERS = {"hidden": "hf-retrace data features", "topk": "hf-retrace data topk"}  # store kind -> its command
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
    write_text_atomically(out_dir / FEATURES_MANIFEST, json.dumps(manifest, indent=2))


def _feature_settings(target: nn.Module, dataset: Any, target_layer_ids: Sequence[int], storage_dtype: torch.dtype,
                      shard_sequences: int, total: int, topk: int = 0) -> dict[str, Any]:
    """What ``features.json`` records about how the features were made (a resume must match them)."""
    name = _dtype_name(storage_dtype)
    if name not in _STORAGE:
        raise ValueError(f"storage dtype must be one of {list(_STORAGE)}, got {name}.")
    hidden = target.config.get_text_config().hidden_size
    return {
        "target": str(getattr(target.config, "_name_or_path", "")),
        "kind": "topk" if topk else "hidden",
        **({"k": topk} if topk else {}),
        "target_layer_ids": list(target_layer_ids),
        "hidden_size": hidden,
        "feature_size": 2 * topk if topk else hidden * len(target_layer_ids),
        "dtype": name,
        "shard_sequences": shard_sequences,
        "dataset": {**_dataset_fingerprint(dataset), "directory": str(getattr(dataset, "directory", ""))},
        "num_sequences": total,
    }


def _tokens_digest(dataset: Any, start: int, end: int) -> str:
    """A digest of the token ids of sequences ``start .. end - 1``: which sequences a shard's features belong to."""
    digest = hashlib.sha1()
    for index in range(start, end):
        digest.update(np.asarray(dataset[index]["input_ids"], dtype=np.int64).tobytes())
        digest.update(b"|")
    return digest.hexdigest()


def store_fits(store: dict[str, Any], dataset: Any) -> str | None:
    """None when ``store`` (a ``features.json``) was computed for ``dataset``, or for its first sequences before it
    grew (:func:`~hf_retrace.training.data.tokenize_responses` appends new sequences after the old ones); otherwise
    what does not fit. Each shard's token ids are compared (stores written before shards kept a digest: their
    sequence lengths)."""
    lengths = dataset.sequence_lengths()
    made_for = store.get("dataset", {})
    n, tokens = made_for.get("num_sequences"), made_for.get("num_tokens")
    if n is None or n > len(lengths) or int(lengths[:n].sum()) != tokens:
        return (f"it was computed for {n} sequences of {tokens} tokens, which are not this dataset "
                f"({len(lengths)} sequences, {int(lengths.sum())} tokens) nor its first sequences")
    for shard in store.get("shards", []):
        start, end = shard["start"], shard["end"]
        same = (shard["digest"] == _tokens_digest(dataset, start, end) if "digest" in shard
                else np.array_equal(np.diff(shard["offsets"]), lengths[start:end]))
        if not same:
            return f"its {shard['file']} holds other sequences than this dataset's {start}..{end - 1}"
    return None


def _resumed_manifest(out_dir: Path, settings: dict[str, Any], dataset: Any) -> dict[str, Any]:
    """A fresh manifest, the existing one's shards still on disk (those of the same sequences: a dataset that grew
    keeps them), or the existing one when complete for the same sequences.

    Other settings, fewer sequences, or features of other data are a ``ValueError``."""
    manifest: dict[str, Any] = {**settings, "complete": False, "shards": []}
    if not (out_dir / FEATURES_MANIFEST).exists():
        return manifest
    existing = json.loads((out_dir / FEATURES_MANIFEST).read_text(encoding="utf-8"))
    keys = ("target_layer_ids", "hidden_size", "feature_size", "dtype", "shard_sequences")
    changed = [k for k in keys if existing.get(k) != settings[k]]
    if store_kind(existing) != settings["kind"]:
        changed.append("kind")
    if existing.get("num_sequences", 0) > settings["num_sequences"]:
        changed.append("num_sequences")
    if changed:
        raise ValueError(
            f"{out_dir} holds data made with other settings ({changed} differ). Use a new folder, "
            "or delete this one."
        )
    misfit = store_fits(existing, dataset)
    if misfit:
        raise ValueError(f"{out_dir} holds features of other data: {misfit}. Use a new folder, or delete this one.")
    same = existing.get("num_sequences") == settings["num_sequences"] and all(
        existing["dataset"].get(k) == settings["dataset"][k] for k in ("num_sequences", "num_tokens"))
    if existing.get("complete") and same:
        return existing
    total, step = settings["num_sequences"], settings["shard_sequences"]
    manifest["shards"] = [s for s in existing["shards"]  # a last, shorter shard of fewer sequences is made again
                          if s["end"] == min(s["start"] + step, total) and (out_dir / s["file"]).exists()]
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


Compute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, attention_mask) -> [b, T, size]


def _write_feature_shard(compute: Compute, device: torch.device, feature_size: int, dataset: Any,
                         storage_dtype: torch.dtype, path: Path, start: int, shard_lengths: np.ndarray,
                         max_batch_tokens: int, report: Callable[[int], None]) -> np.ndarray:
    """Write ``compute`` of sequences ``start ..`` to ``path`` (through a temporary file); return the offsets."""
    np_dtype, _ = _STORAGE[_dtype_name(storage_dtype)]
    offsets = np.concatenate([[0], np.cumsum(shard_lengths)]).astype(np.int64)
    for stale in stale_temporaries(path):  # a killed writer's half shard (as large as the shard): never read, removed
        stale.unlink(missing_ok=True)
    with atomic_path(path) as tmp:
        array = np.memmap(tmp, dtype=np_dtype, mode="w+", shape=(int(offsets[-1]), feature_size))
        for rows in _length_batches(shard_lengths, max_batch_tokens):
            batch = collate_sequences([dataset[start + int(r)] for r in rows])
            feats = compute(batch["input_ids"].to(device), batch["attention_mask"].to(device)).to(storage_dtype).cpu()
            for j, r in enumerate(rows):
                length = int(shard_lengths[r])
                block = feats[j, :length].contiguous()
                if np_dtype is np.uint16:
                    block = block.view(torch.int16)
                array[offsets[r] : offsets[r] + length] = block.numpy().view(np_dtype)
            report(int(sum(shard_lengths[r] for r in rows)))
        array.flush()
        del array
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
    Settings that differ from an existing ``features.json`` raise a ``ValueError``. A folder made for a dataset
    that has grown since (new sequences after the old ones, as ``tokenize_responses`` appends them), or with a
    smaller ``limit`` than this call's, keeps its shards and computes the rest (never fewer sequences).
    """
    storage_dtype = storage_dtype or next(target.parameters()).dtype
    total = _total(dataset, limit)
    settings = _feature_settings(target, dataset, target_layer_ids, storage_dtype, shard_sequences, total)

    def compute(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return tapped_hidden_states(target, input_ids, attention_mask, target_layer_ids)

    return _precompute(target, dataset, Path(out_dir), settings, compute, storage_dtype, max_batch_tokens,
                       progress, "features")


@torch.no_grad()
def target_topk(target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                k: int) -> torch.Tensor:
    """``[b, T, 2k]`` float32: at every position the ids of the target's k likeliest next tokens (as floats, exact
    below 2**24), then their log-probabilities (from a float32 log-softmax over the whole vocabulary)."""
    logits = target(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    top = logits.float().log_softmax(-1).topk(k, dim=-1)
    return torch.cat([top.indices.float(), top.values], dim=-1)


def precompute_topk(
    target: nn.Module,
    dataset: Any,
    out_dir: str | os.PathLike[str],
    k: int,
    *,
    shard_sequences: int = 256,
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    limit: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The target's top-``k`` next-token distribution at every position of ``dataset`` (a whole forward with the
    head), stored like :func:`precompute_features` in a folder of its own; resumable; returns the manifest."""
    vocab = target.config.get_text_config().vocab_size
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be between 1 and the target's vocabulary size {vocab}, got {k}.")
    if vocab > 2**24:
        raise ValueError(f"token ids are stored as float32, exact below 2**24; this target has {vocab} tokens.")
    total = _total(dataset, limit)
    settings = _feature_settings(target, dataset, [], torch.float32, shard_sequences, total, topk=k)
    return _precompute(target, dataset, Path(out_dir), settings,
                       lambda input_ids, attention_mask: target_topk(target, input_ids, attention_mask, k),
                       torch.float32, max_batch_tokens, progress, f"top-{k}")


def _total(dataset: Any, limit: int | None) -> int:
    lengths = dataset.sequence_lengths()
    return len(lengths) if limit is None else min(limit, len(lengths))


def _precompute(target: nn.Module, dataset: Any, out_dir: Path, settings: dict[str, Any], compute: Compute,
                storage_dtype: torch.dtype, max_batch_tokens: int, progress: bool, desc: str) -> dict[str, Any]:
    """One resumable pass of ``compute`` over the first ``settings["num_sequences"]`` sequences, shard by shard."""
    from tqdm.auto import tqdm

    lengths = dataset.sequence_lengths()
    total, shard_sequences = settings["num_sequences"], settings["shard_sequences"]
    manifest = _resumed_manifest(out_dir, settings, dataset)
    if manifest["complete"]:
        return manifest
    out_dir.mkdir(parents=True, exist_ok=True)
    done = {s["start"] for s in manifest["shards"]}
    starts = list(range(0, total, shard_sequences))
    todo_tokens = int(sum(lengths[s : min(s + shard_sequences, total)].sum() for s in starts if s not in done))
    bar = tqdm(total=todo_tokens, desc=desc, unit="tok", unit_scale=True, disable=not progress, mininterval=5)
    begin = time.perf_counter()
    processed = 0

    def report(tokens: int) -> None:
        nonlocal processed
        processed += tokens
        bar.update(tokens)
        bar.set_postfix(tok_s=f"{processed / (time.perf_counter() - begin):.0f}")

    target.eval()
    device = next(target.parameters()).device
    for index, start in enumerate(starts):
        if start in done:
            continue
        end = min(start + shard_sequences, total)
        file = f"features-{index:05d}.bin"
        offsets = _write_feature_shard(compute, device, settings["feature_size"], dataset, storage_dtype,
                                       out_dir / file, start, lengths[start:end].astype(np.int64), max_batch_tokens,
                                       report)
        manifest["shards"].append({"file": file, "start": start, "end": end, "offsets": offsets.tolist(),
                                   "digest": _tokens_digest(dataset, start, end)})
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


def store_kind(manifest: dict[str, Any]) -> str:
    """``"hidden"`` (tapped states; folders written before top-k stores existed say nothing) or ``"topk"``."""
    return manifest.get("kind", "hidden")


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
    sequences covered from the first one on are available, ``len()`` says how many. ``kind`` is the store expected:
    ``"hidden"`` (:func:`precompute_features`) or ``"topk"`` (:func:`precompute_topk`; ``features[i]`` is
    ``[T_i, 2k]``).

    ``layers`` reads some of a hidden store's tapped layers, in the order given (a drafter's ``target_layer_ids``),
    so one pass over the data serves drafters that tap different layers: ``features[i]`` is then
    ``[T_i, len(layers)*H]``, exactly what a store made for those layers alone would hold.
    """

    def __init__(self, directory: str | os.PathLike[str], allow_partial: bool = False, kind: str = "hidden",
                 layers: Sequence[int] | None = None):
        self.directory = Path(directory)
        manifest = features_manifest(self.directory)
        maker = f"`{STORE_MAKERS[kind]}`"
        if manifest is None:
            raise FileNotFoundError(f"No {FEATURES_MANIFEST} in {self.directory}; run {maker} first.")
        if store_kind(manifest) != kind:
            raise ValueError(f"{self.directory} holds {store_kind(manifest)!r} data, not {kind!r}: it was made by the "
                             f"other pass; give the folder {maker} wrote.")
        if not manifest.get("complete") and not allow_partial:
            raise ValueError(f"{self.directory} is only partly computed; run {maker} again to finish it.")
        self.manifest = manifest
        self._covered = covered_sequences(manifest) if not manifest.get("complete") else manifest["num_sequences"]
        self.target_layer_ids = list(manifest["target_layer_ids"])
        self._column_slices = None  # None: each row as stored
        if layers is not None:
            self._column_slices = self._layer_columns(list(layers))
            self.target_layer_ids = list(layers)
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

    def _layer_columns(self, layers: list[int]) -> list[slice] | None:
        """The column slices of ``layers`` in this store (None: the store holds exactly those, in that order)."""
        stored = self.target_layer_ids
        if store_kind(self.manifest) != "hidden":
            raise ValueError(f"{self.directory} holds top-k distributions, which have no layers to select.")
        missing = [i for i in layers if i not in stored]
        if missing or not layers:
            raise ValueError(f"{self.directory} holds target layers {stored}, so it cannot give layers {layers} "
                             f"({missing or 'none asked'}): compute a store that taps them "
                             f"(`{STORE_MAKERS['hidden']} --target-layer-ids ...`).")
        if layers == stored:
            return None
        return layer_columns(stored, layers, int(self.manifest["hidden_size"]))

    def __len__(self) -> int:
        return int(self._covered)

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} has no precomputed features (0..{len(self) - 1}).")
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        start, _, offsets, array = self._shards[k]
        row = index - start
        rows = array[offsets[row] : offsets[row + 1]]
        if self._column_slices is None:
            data = np.array(rows)
        else:
            data = np.concatenate([rows[:, columns] for columns in self._column_slices], axis=1)
        tensor = torch.from_numpy(data)
        if self.torch_dtype is torch.bfloat16:
            tensor = tensor.view(torch.bfloat16)
        return tensor


