"""JSONL reading tolerant of a torn last line (shards being written when a run was killed); the strict reader of
inputs is :func:`hf_retrace.jsonl.iter_jsonl`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def read_jsonl_tolerant(path: Path) -> list[dict[str, Any]]:
    """Records of a shard being written; a truncated last line (a kill mid-write) is dropped."""
    records: list[dict[str, Any]] = []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    for index, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if index != len(lines) - 1:
                raise ValueError(f"{path}:{index + 1}: corrupt line in the middle of a shard.") from None
            logger.warning("%s: dropping a truncated last line (interrupted write).", path)
    return records

