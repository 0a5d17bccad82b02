"""Strict JSONL reading, one place for the benchmark's prompt files and the training pipeline's inputs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def iter_jsonl(path: Path, expected: str = "") -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for each non-blank line of ``path``.

    A line that is not a JSON object, or a file that is not UTF-8, is a ``ValueError`` naming the line; ``expected``
    (e.g. "with one of the fields prompt, question") finishes the message of a record that is not an object.
    """
    with Path(path).open(encoding="utf-8") as handle:
        try:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}: line {line_number} is not valid JSON ({error.msg})") from None
                if not isinstance(record, dict):
                    raise ValueError(
                        f"{path}: line {line_number} is a JSON {type(record).__name__}, expected an object"
                        + (f" {expected}" if expected else "")
                    )
                yield line_number, record
        except UnicodeDecodeError as error:
            raise ValueError(f"{path} is not UTF-8 text ({error.reason}); expected a JSONL file") from None
