"""The rounds a drafter ships: its teacher-forced drafts on the target's own answers to held-out training prompts.

At T=0 the committed tokens are the target's greedy answer whatever was proposed (lossless), and both sources are
path-independent: the drafter at anchor ``p`` reads the target's states before ``p`` and the token at ``p``; the
lookup index reads the tokens up to ``p``. So one teacher-forced pass over an answer records, for every anchor, the
drafter's full block and its top probabilities, and any round policy is then a walk over the answer
(:mod:`.replay`). At T=1 the same holds in distribution for argmax and lookup proposals verified by sample-and-match:
a sampled answer is one draw of the target's samples, and a draft is accepted exactly when it matches them. Sampled
proposals (rejection sampling) are recorded as real rounds (slot confidences, accepted count) with full blocks;
cutting such a block keeps the law of its accepted prefix, so any confidence cut replays on them.

The file (``round_records.json.gz`` in the drafter's folder) is gzip JSON, confidences to 3 decimals: ~100-300 KB.

Example::

    records = RoundRecords.load("path/to/drafter")
    len(records.greedy), records.greedy[0].drafts[0]   # answers; the full block drafted at the first anchor
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import atomic_path
from ..modeling import ROUND_RECORDS_FILENAME

__all__ = ["AnswerRecord", "RECORDS_FILENAME", "RoundRecords"]

RECORDS_FILENAME = ROUND_RECORDS_FILENAME
FORMAT_VERSION = 1


@dataclass
class AnswerRecord:
    """One answer: ``tokens`` (prompt + answer), the first anchor ``start`` (the answer's first token, which the
    prefill commits), and per anchor ``start .. len(tokens) - 2`` the drafter's full block and top probabilities."""

    tokens: list[int]
    start: int
    drafts: list[list[int]]
    confidences: list[list[float]]

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "start": self.start, "drafts": self.drafts,
                "confidences": [[round(c, 3) for c in row] for row in self.confidences]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AnswerRecord":
        return cls(list(data["tokens"]), int(data["start"]), data["drafts"], data["confidences"])


@dataclass
class RoundRecords:
    """A drafter's recorded rounds: ``greedy`` answers (T=0), ``sampled`` answers (T=``temperature``, argmax
    drafts), and ``sample_rounds``: real rounds with sampled proposals and full blocks, ``(confidences, accepted)``."""

    block_size: int
    greedy: list[AnswerRecord] = field(default_factory=list)
    sampled: list[AnswerRecord] = field(default_factory=list)
    sample_rounds: list[tuple[list[float], int]] = field(default_factory=list)
    temperature: float = 1.0
    made_with: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "block_size": self.block_size, "temperature": self.temperature,
                "made_with": self.made_with, "greedy": [a.to_dict() for a in self.greedy],
                "sampled": [a.to_dict() for a in self.sampled],
                "sample_rounds": [[[round(c, 3) for c in conf], int(acc)] for conf, acc in self.sample_rounds]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RoundRecords":
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"round records of format {data.get('format')!r}; this version reads {FORMAT_VERSION}.")
        return cls(int(data["block_size"]), [AnswerRecord.from_dict(a) for a in data["greedy"]],
                   [AnswerRecord.from_dict(a) for a in data["sampled"]],
                   [(list(c), int(a)) for c, a in data["sample_rounds"]], float(data["temperature"]),
                   dict(data.get("made_with", {})))

    def save(self, folder: str | os.PathLike) -> Path:
        """Write ``round_records.json.gz`` into ``folder`` atomically; returns its path."""
        path = Path(folder) / RECORDS_FILENAME
        with atomic_path(path) as temporary, gzip.open(temporary, "wt", encoding="utf-8", compresslevel=9) as f:
            json.dump(self.to_dict(), f, separators=(",", ":"))
        return path

    @classmethod
    def load(cls, folder_or_file: str | os.PathLike) -> "RoundRecords":
        """Read a drafter folder's records (or the file itself); a ``ValueError`` names a file that does not parse."""
        path = Path(folder_or_file)
        path = path / RECORDS_FILENAME if path.is_dir() else path
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return cls.from_dict(json.load(f))
        except (OSError, EOFError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not readable round records ({e}); re-record them with "
                             "`hf-retrace calibrate --drafter FOLDER --write`.") from e


def replay_inputs(argv: Any, description: str) -> tuple[dict[str, Any], "RoundRecords"]:
    """What the replay examples (``examples/replay_by_kind.py``, ``examples/replay_width_cap.py``) read from their
    command line ``argv``: ``--policy`` (a policy cache entry or ``hf-retrace tune --json`` file, as a dict) and the
    recorded rounds of ``--drafter`` (default: the shipped drafter). A file that does not parse exits with its name."""
    import argparse

    from ..defaults import default_drafter_path

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--policy", required=True, help="a policy cache entry or `hf-retrace tune --json` file")
    parser.add_argument("--drafter", default=None, help="the drafter folder whose recorded rounds to replay "
                        "(default: the shipped one)")
    args = parser.parse_args(argv)
    try:
        entry = json.loads(Path(args.policy).read_text(encoding="utf-8"))
        return entry, RoundRecords.load(args.drafter or default_drafter_path())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{args.policy}: {e}") from e
