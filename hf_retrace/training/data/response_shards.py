"""The target's answers on disk: resumable JSONL shards ``responses-00000.jsonl`` ..., written and read back.

A shard being written is ``responses-NNNNN.jsonl.partial`` (flushed per batch); it becomes a complete shard only by an
atomic rename, so a killed run loses at most the batch being written. :func:`read_answered` also reads that shard, for
work that runs beside a generation (what is left to ask, which first answers a second turn can follow).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ...atomic import atomic_path
from ...jsonl import iter_jsonl
from .jsonl import read_jsonl_tolerant

RESPONSE_FIELDS: tuple[str, ...] = ("id", "prompt", "response", "finish", "response_tokens")
RESPONSE_SHARD_GLOB = "responses-*.jsonl"
_PARTIAL_SUFFIX = ".partial"


def response_shards(out_dir: str | os.PathLike[str]) -> list[Path]:
    """The complete response shards in ``out_dir``, in order (the ``.partial`` shard being written is excluded)."""
    return sorted(Path(out_dir).glob(RESPONSE_SHARD_GLOB))


class ResponseShardWriter:
    """Appends records to ``responses-NNNNN.jsonl.partial`` (flushed per batch), renamed when complete.

    A kill loses at most the batch being written: complete lines of the partial shard are kept on resume, a
    truncated last line is dropped, and complete shards are only ever produced by an atomic rename.
    """

    def __init__(self, out_dir: Path, shard_size: int) -> None:
        self.out_dir = out_dir
        self.shard_size = shard_size
        out_dir.mkdir(parents=True, exist_ok=True)
        self.done_ids: set[str] = set()
        for shard in response_shards(out_dir):
            self.done_ids.update(str(record["id"]) for _, record in iter_jsonl(shard))
        partials = sorted(out_dir.glob(RESPONSE_SHARD_GLOB + _PARTIAL_SUFFIX))
        if len(partials) > 1:
            raise ValueError(f"{out_dir}: several partial shards {partials}; expected at most one.")
        self.partial_records = read_jsonl_tolerant(partials[0]) if partials else []
        self.done_ids.update(str(record["id"]) for record in self.partial_records)
        self.index = self._next_index()
        if partials:
            partials[0].rename(self._partial_path)  # keep its records under the next free index
            self._rewrite_partial()  # without the truncated line, so appends start on a clean line

    def _next_index(self) -> int:
        shards = response_shards(self.out_dir)
        return int(shards[-1].name[len("responses-") : -len(".jsonl")]) + 1 if shards else 0

    @property
    def _partial_path(self) -> Path:
        return self.out_dir / f"responses-{self.index:05d}.jsonl{_PARTIAL_SUFFIX}"

    def _rewrite_partial(self) -> None:
        with atomic_path(self._partial_path) as temporary, temporary.open("w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in self.partial_records)

    def append(self, records: Sequence[dict[str, Any]]) -> None:
        """Append one batch (one write, flushed and fsynced), promoting the shard whenever it fills up."""
        remaining = list(records)
        while remaining:
            room = self.shard_size - len(self.partial_records)
            chunk, remaining = remaining[:room], remaining[room:]
            with self._partial_path.open("a", encoding="utf-8") as handle:
                handle.write("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in chunk))
                handle.flush()
                os.fsync(handle.fileno())
            self.partial_records += chunk
            self.done_ids.update(str(record["id"]) for record in chunk)
            if len(self.partial_records) >= self.shard_size:
                self.close()

    def close(self) -> None:
        """Promote the partial shard to a complete one (atomic rename); an empty one is removed."""
        if self.partial_records:
            self._partial_path.replace(self.out_dir / f"responses-{self.index:05d}.jsonl")
            self.index += 1
            self.partial_records = []
        else:
            self._partial_path.unlink(missing_ok=True)


def read_responses(paths: Iterable[str | os.PathLike[str]]) -> Iterator[dict[str, Any]]:
    """Response records from JSONL files and/or directories of complete ``responses-*.jsonl`` shards, in order."""
    for path in map(Path, paths):
        files = response_shards(path) if path.is_dir() else [path]
        for file in files:
            for line_number, record in iter_jsonl(file):
                missing = [field for field in ("prompt", "response", "finish") if field not in record]
                if missing:
                    raise ValueError(
                        f"{file}:{line_number}: response record lacks {missing}; fields found: {sorted(record)}; "
                        f"expected {list(RESPONSE_FIELDS)} (the output format of generate_responses)."
                    )
                yield record




def read_answered(paths: Iterable[str | os.PathLike[str]]) -> Iterator[dict[str, Any]]:
    """Response records answered so far: :func:`read_responses` plus the complete lines of a shard folder's
    ``.partial`` shard (a run in progress or killed). A record may come twice when its shard was promoted while
    being read; key them by ``id``."""
    for path in map(Path, paths):
        if path.is_dir():
            for partial in sorted(path.glob(RESPONSE_SHARD_GLOB + _PARTIAL_SUFFIX)):
                try:
                    yield from read_jsonl_tolerant(partial)
                except FileNotFoundError:  # promoted to a complete shard meanwhile: read below
                    pass
        yield from read_responses([path])
