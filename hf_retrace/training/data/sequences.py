"""Training sequences: response records in, ``input_ids`` + ``loss_mask`` (1 on response tokens) out, stored as
memory-mappable ``.npy`` shards plus a ``manifest.json``; :class:`TokenizedDataset` reads them back.

Example::

    tokenize_responses(tokenizer, ["work_data/responses"], "work_data/tokenized", max_length=1024)
    dataset = TokenizedDataset("work_data/tokenized")
    dataset[0]["input_ids"], dataset[0]["loss_mask"]
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...atomic import atomic_path, write_text_atomically
from .chat_template import end_of_turn_token_id, prompt_token_ids
from .conversations import first_turn_id
from .response_shards import read_responses, response_shards

_MANIFEST = "manifest.json"
_SHARD_ARRAYS = ("input_ids", "loss_mask", "offsets")


def build_sequence(
    tokenizer: Any,
    prompt: str,
    response: str,
    finish: str,
    *,
    max_length: int,
    end_of_turn_id: int | None = None,
    response_ids: Sequence[int] | None = None,
    history: Sequence[str] = (),
) -> tuple[list[int], list[int]] | None:
    """``(input_ids, loss_mask)`` for one answer: the chat prompt (mask 0), then the response (+ end of turn) (mask 1).

    The prompt (after ``history``'s earlier turns, all mask 0) is rendered with the chat template and the response
    tokenized on its own with
    ``add_special_tokens=False`` (or taken from ``response_ids``, the exact generated tokens, when given); the
    end-of-turn token is appended when ``finish == "eos"``. The sequence is cut at
    ``max_length``; ``None`` when nothing of the response fits (or the response is empty and was cut by length).
    """
    prompt_ids = prompt_token_ids(tokenizer, [prompt], [history])[0]
    if response_ids is None:
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    response_ids = list(response_ids)
    if finish == "eos":
        response_ids.append(end_of_turn_token_id(tokenizer) if end_of_turn_id is None else end_of_turn_id)
    input_ids = (prompt_ids + response_ids)[:max_length]
    loss_mask = ([0] * len(prompt_ids) + [1] * len(response_ids))[:max_length]
    if not any(loss_mask):
        return None
    return input_ids, loss_mask


def _shard_stem(out_dir: Path, index: int) -> Path:
    return out_dir / f"shard-{index:05d}"


def _write_shard(
    stem: Path, sequences: Sequence[tuple[list[int], list[int]]], ids: Sequence[str], num_skipped: int
) -> dict[str, Any]:
    """Write one shard's flat arrays (each via a temp file + rename); return its manifest entry."""
    lengths = np.array([len(input_ids) for input_ids, _ in sequences], dtype=np.int64)
    arrays = {
        "input_ids": np.fromiter((t for s, _ in sequences for t in s), dtype=np.int32, count=int(lengths.sum())),
        "loss_mask": np.fromiter((m for _, s in sequences for m in s), dtype=np.uint8, count=int(lengths.sum())),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    }
    for name, array in arrays.items():
        with atomic_path(stem.with_name(f"{stem.name}.{name}.npy")) as temporary:
            np.save(temporary, array)
    write_text_atomically(stem.with_name(f"{stem.name}.ids.json"), json.dumps(list(ids)))
    return {
        "name": stem.name,
        "num_sequences": len(sequences),
        "num_tokens": int(lengths.sum()),
        "num_response_tokens": int(arrays["loss_mask"].sum()),
        "num_skipped": num_skipped,
    }


def _tokenization_settings(
    tokenizer: Any, paths: Sequence[Path], max_length: int, shard_size: int, exclude_ids: Iterable[str] = ()
) -> dict[str, Any]:
    sources = []
    for path in paths:
        files = response_shards(path) if path.is_dir() else [path]
        sources += [{"path": str(file.resolve()), "bytes": file.stat().st_size} for file in files]
    settings = {
        "tokenizer": str(getattr(tokenizer, "name_or_path", type(tokenizer).__name__)),
        "vocab_size": len(tokenizer),
        "end_of_turn_token_id": end_of_turn_token_id(tokenizer),
        "max_length": max_length,
        "shard_size": shard_size,
        "sources": sources,
    }
    excluded = sorted(set(map(str, exclude_ids)))
    return {**settings, "exclude_ids": excluded} if excluded else settings  # folders made before the key still match


def _write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    write_text_atomically(out_dir / _MANIFEST, json.dumps(manifest, indent=2))


def _chunks(records: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for record in records:
        chunk.append(record)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _resumed_manifest(out_dir: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The manifest to continue: a fresh one, the existing one's complete shards, the existing one when complete, or
    the existing one grown by a new part when ``settings`` lists all of its sources, unchanged, and new ones.

    Other settings, or a source of the folder missing or changed, are a ``ValueError``."""
    manifest: dict[str, Any] = {**settings, "complete": False, "shards": [], "parts": [0]}
    if not (out_dir / _MANIFEST).exists():
        return manifest
    existing = json.loads((out_dir / _MANIFEST).read_text(encoding="utf-8"))
    changed = [key for key in settings if key != "sources" and existing.get(key) != settings[key]]
    changed += [key for key in ("exclude_ids",) if key in existing and key not in settings]
    if changed:
        raise ValueError(
            f"{out_dir} already holds sequences made with other settings ({changed} differ). "
            "Use a new output folder, or delete this one to re-tokenize."
        )
    old = existing.get("sources", [])
    gone = [f"{source['path']} ({source['bytes']} bytes)" for source in old if source not in settings["sources"]]
    if gone:
        raise ValueError(
            f"{out_dir} was tokenized from sources that are not all among these, unchanged: {gone}. A folder grows "
            "only by new sources beside its own (those still there, not rewritten); use a new output folder."
        )
    added = [source for source in settings["sources"] if source not in old]
    parts = existing.get("parts", [0])  # the first source of each call that brought new sources
    shards = existing["shards"]
    if not existing.get("complete"):
        shards = [s for s in shards if all((out_dir / f"{s['name']}.{a}.npy").exists() for a in _SHARD_ARRAYS)]
    elif not added:
        return existing
    # the folder's own sources keep their order and their sequences; new ones follow, in the order given
    return {**existing, **settings, "sources": old + added, "complete": False, "shards": shards,
            "parts": parts + ([len(old)] if added else [])}


def _part_files(manifest: dict[str, Any]) -> Iterator[tuple[int, list[Path]]]:
    """``(part, source files)`` of each part, in order."""
    files = [Path(source["path"]) for source in manifest["sources"]]
    bounds = list(manifest["parts"]) + [len(files)]
    for part in range(len(manifest["parts"])):
        yield part, files[bounds[part] : bounds[part + 1]]


def _excluded(record: dict[str, Any], exclude_ids: set[str]) -> bool:
    """A record whose id, or whose conversation's first turn, is in ``exclude_ids`` (an excluded prompt takes its
    later turns with it)."""
    record_id = str(record.get("id", ""))
    return record_id in exclude_ids or first_turn_id(record_id) in exclude_ids


def _tokenize_chunk(
    tokenizer: Any, chunk: Sequence[dict[str, Any]], max_length: int, end_of_turn_id: int, exclude_ids: set[str]
) -> tuple[list[tuple[list[int], list[int]]], list[str], int, int]:
    """The sequences of one shard's records, their ids, how many records left nothing to train on, and how many
    were excluded."""
    sequences, ids, num_skipped, num_excluded = [], [], 0, 0
    for record in chunk:
        if _excluded(record, exclude_ids):
            num_excluded += 1
            continue
        sequence = build_sequence(
            tokenizer, record["prompt"], record["response"], record["finish"],
            max_length=max_length, end_of_turn_id=end_of_turn_id, response_ids=record.get("response_ids"),
            history=record.get("history", ()),
        )
        if sequence is None:
            num_skipped += 1
            continue
        sequences.append(sequence)
        ids.append(str(record.get("id", "")))
    return sequences, ids, num_skipped, num_excluded


def tokenize_responses(
    tokenizer: Any,
    responses_jsonl_paths: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    max_length: int = 1024,
    shard_size: int = 8192,
    exclude_ids: Iterable[str] = (),
) -> dict[str, Any]:
    """Turn response records into training sequences stored as memory-mappable shards; return the manifest.

    Inputs are JSONL files or directories written by :func:`generate_responses` (records ``{id, prompt, response,
    finish}``; a record's ``response_ids``, when present, are used instead of re-tokenizing ``response``, and its
    ``history`` is rendered before ``prompt``, masked like it). Records whose id is in ``exclude_ids`` (prompts kept
    for evaluation), or whose conversation's first turn is, are left out and counted (``num_excluded``). Shard
    ``k`` holds the sequences of ``shard_size`` consecutive source records: ``shard-0000k.input_ids.npy`` (int32,
    flat), ``.loss_mask.npy`` (uint8, flat), ``.offsets.npy`` (int64, ``num_sequences + 1``) and ``.ids.json``.
    ``manifest.json`` holds the settings, the per-shard counts and the totals; it is rewritten after each shard, so a
    second call resumes after the last complete shard, and returns at once when ``complete`` is true.

    A folder grows: a later call whose sources include all of this folder's sources, unchanged, and new ones (e.g.
    shard folders where generation runs have finished more shards since) tokenizes only the new ones, in the order
    given, into new shards after the existing ones (a new *part*, recorded in ``parts``; ``sources`` lists the
    files in the order their sequences stand), so sequence ``i`` stays sequence ``i`` and features computed for the
    first sequences stay valid. Other settings are a ``ValueError``.

    Example::

        manifest = tokenize_responses(tokenizer, ["responses.jsonl"], "work_data/tokenized", max_length=1024)
    """
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    paths = [Path(path) for path in responses_jsonl_paths]
    settings = _tokenization_settings(tokenizer, paths, max_length, shard_size, exclude_ids)
    manifest = _resumed_manifest(out_dir, settings)
    if manifest["complete"]:
        return manifest
    out_dir.mkdir(parents=True, exist_ok=True)
    excluded = set(settings.get("exclude_ids", ()))
    for part, files in _part_files(manifest):
        done = sum(1 for shard in manifest["shards"] if shard.get("part", 0) == part)
        chunks = _chunks(read_responses(files), shard_size)
        for local, chunk in enumerate(tqdm(chunks, desc=f"tokenize (part {part})", unit="shard")):
            if local < done:
                continue
            sequences, ids, num_skipped, num_excluded = _tokenize_chunk(
                tokenizer, chunk, max_length, settings["end_of_turn_token_id"], excluded)
            stem = _shard_stem(out_dir, len(manifest["shards"]))
            shard = _write_shard(stem, sequences, ids, num_skipped)
            manifest["shards"].append({**shard, "num_excluded": num_excluded, "part": part})
            _write_manifest(out_dir, manifest)
    for total in ("num_sequences", "num_tokens", "num_response_tokens", "num_skipped", "num_excluded"):
        manifest[total] = sum(shard.get(total, 0) for shard in manifest["shards"])
    manifest["complete"] = True
    _write_manifest(out_dir, manifest)
    return manifest


class TokenizedDataset(torch.utils.data.Dataset):
    """Training sequences written by :func:`tokenize_responses`, read from memory-mapped shards.

    Example::

        dataset = TokenizedDataset("work_data/smollm2-tokenized")
        item = dataset[0]  # {"input_ids": LongTensor[T], "loss_mask": BoolTensor[T]}
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        manifest_path = self.directory / _MANIFEST
        if not manifest_path.exists():
            raise FileNotFoundError(f"No {_MANIFEST} in {self.directory}; run tokenize_responses first.")
        self.manifest: dict[str, Any] = json.loads(manifest_path.read_text(encoding="utf-8"))
        if not self.manifest.get("complete"):
            raise ValueError(f"{self.directory} is only partly tokenized; run tokenize_responses again to finish it.")
        self._shards = [
            {name: np.load(self.directory / f"{shard['name']}.{name}.npy", mmap_mode="r") for name in _SHARD_ARRAYS}
            for shard in self.manifest["shards"]
        ]
        counts = [len(shard["offsets"]) - 1 for shard in self._shards]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def sequence_lengths(self) -> np.ndarray:
        """Token count of every sequence (for length-grouped batching)."""
        if not self._shards:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.diff(shard["offsets"]) for shard in self._shards])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} sequences")
        shard_index = int(np.searchsorted(self._starts, index, side="right")) - 1
        shard = self._shards[shard_index]
        row = index - int(self._starts[shard_index])
        begin, end = int(shard["offsets"][row]), int(shard["offsets"][row + 1])
        return {
            "input_ids": torch.from_numpy(np.array(shard["input_ids"][begin:end], dtype=np.int64)),
            "loss_mask": torch.from_numpy(np.array(shard["loss_mask"][begin:end], dtype=np.bool_)),
        }
