"""Benchmark prompt sets: the small subsets shipped in ``hf_retrace/bench/data`` or any JSONL file.

Pure data handling: no model or tokenizer imports here.

Prompt formats follow DFlash's ``benchmark.py`` so numbers stay comparable:

- ``gsm8k``: ``"{question}\\nPlease reason step by step, and put your final answer within \\\\boxed{}."``
- ``math500``: the same suffix after ``{problem}``
- ``humaneval``: :func:`hf_retrace.chat.humaneval_prompt` of the record's ``prompt``
- ``mtbench``: the record's ``turns``, one user message per turn (multi-turn)

A JSONL path whose file name is a known set (``.../gsm8k.jsonl``) gets that set's format, provided its
records carry that set's field. Any other JSONL uses, per record, the first field present among
``turns`` (a list of strings), ``prompt``, ``question``, ``problem``, as is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..chat import PROMPT_FIELDS, humaneval_prompt, record_id, user_turns
from ..jsonl import iter_jsonl

__all__ = [
    "DATASETS",
    "DATA_DIR",
    "PROMPT_FIELDS",
    "BenchPrompt",
    "load_prompts",
    "validate_dataset_arg",
]

DATASETS = ("gsm8k", "math500", "humaneval", "mtbench")
DATA_DIR = Path(__file__).parent / "data"

BOXED_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."

_ALIASES = {
    "gsm8k": "gsm8k",
    "math500": "math500",
    "humaneval": "humaneval",
    "mtbench": "mtbench",
}


@dataclass
class BenchPrompt:
    """One benchmark item: ``turns`` are the user messages, in order (one for single-turn sets)."""

    id: str
    dataset: str
    turns: list[str] = field(default_factory=list)

    @property
    def prompt(self) -> str:
        """The first user turn."""
        return self.turns[0]


# --------------------------------------------------------------------------- formatters


def _fmt_gsm8k(rec: dict) -> list[str]:
    return [rec["question"] + BOXED_SUFFIX]


def _fmt_math500(rec: dict) -> list[str]:
    return [rec["problem"] + BOXED_SUFFIX]


def _fmt_humaneval(rec: dict) -> list[str]:
    return [humaneval_prompt(rec["prompt"])]


def _fmt_mtbench(rec: dict) -> list[str]:
    return list(rec["turns"])


# dataset -> (field the record must have, formatter)
_FORMATS: dict[str, tuple[str, Callable[[dict], list[str]]]] = {
    "gsm8k": ("question", _fmt_gsm8k),
    "math500": ("problem", _fmt_math500),
    "humaneval": ("prompt", _fmt_humaneval),
    "mtbench": ("turns", _fmt_mtbench),
}


def _fmt_generic(rec: dict) -> list[str]:
    return user_turns(rec) or []


# --------------------------------------------------------------------------- reading and checking


def _normalise_name(name: str) -> str:
    return name.strip().lower().replace("-", "").replace("_", "")


def _looks_like_path(arg: str) -> bool:
    return arg.lower().endswith((".jsonl", ".json")) or os.sep in arg or "/" in arg or arg.startswith(".")


def _resolve(name_or_path: str | os.PathLike) -> tuple[Path, str | None]:
    """(file, known dataset name or None); raises ValueError with a helpful message."""
    arg = os.fspath(name_or_path)
    if not isinstance(arg, str) or not arg.strip():
        raise ValueError(
            f"empty dataset name; use one of {', '.join(DATASETS)} or the path of a .jsonl file"
        )
    known = _ALIASES.get(_normalise_name(arg))
    if known is not None:
        path = DATA_DIR / f"{known}.jsonl"
        if not path.is_file():  # pragma: no cover - broken installation
            raise ValueError(f"the shipped prompt file for {known!r} is missing ({path}); reinstall hf-retrace")
        return path, known
    path = Path(arg).expanduser()
    if path.is_dir():
        raise ValueError(f"dataset path {arg!r} is a folder; give a .jsonl file (one JSON record per line)")
    if path.is_file():
        return path, None
    if _looks_like_path(arg):
        raise ValueError(f"dataset file not found: {arg!r}")
    raise ValueError(
        f"unknown dataset {arg!r}; known names: {', '.join(DATASETS)} "
        "(a path to a .jsonl file with one prompt record per line is also accepted)"
    )


def _read_records(path: Path) -> list[tuple[int, dict]]:
    try:
        records = list(iter_jsonl(path, expected=f"with one of the fields {', '.join(PROMPT_FIELDS)}"))
    except OSError as exc:
        raise ValueError(f"cannot read dataset file {path}: {exc}") from exc
    if not records:
        raise ValueError(f"{path} holds no records; expected one JSON object per line")
    return records


def _choose_format(path: Path, known: str | None, first: dict) -> tuple[str, Callable[[dict], list[str]], str]:
    """(dataset label, formatter, the field every record needs)."""
    name = known or path.stem.lower()
    if name in _FORMATS:
        needed, fmt = _FORMATS[name]
        if needed in first:
            return name, fmt, needed
        if known is not None:  # pragma: no cover - shipped files always match
            raise ValueError(f"shipped file {path} lacks the field {needed!r}")
    if user_turns(first) is None:
        found = ", ".join(sorted(first)) or "none"
        raise ValueError(
            f"{path}: the first record has no usable prompt field (fields found: {found}); expected one of "
            f"{', '.join(PROMPT_FIELDS)} (the first present is used: 'turns' as a list of strings, 'messages' / "
            "'conversations' as chat messages, the others as a string)"
        )
    return path.stem, _fmt_generic, ""


def _parse(name_or_path) -> tuple[Path, str, list[tuple[int, dict]], Callable[[dict], list[str]], str]:
    path, known = _resolve(name_or_path)
    records = _read_records(path)
    label, fmt, needed = _choose_format(path, known, records[0][1])
    for lineno, rec in records:
        if fmt is _fmt_generic:
            ok = user_turns(rec) is not None
            wanted = f"one of {', '.join(PROMPT_FIELDS)}"
        else:
            ok = needed in rec and user_turns({needed: rec[needed]}) is not None
            wanted = f"the field {needed!r}"
        if not ok:
            raise ValueError(
                f"{path}: line {lineno} has no usable prompt field "
                f"(fields found: {', '.join(sorted(rec)) or 'none'}); expected {wanted}"
            )
    return path, label, records, fmt, needed


# --------------------------------------------------------------------------- public API


def validate_dataset_arg(name_or_path: str | os.PathLike) -> Path:
    """Check a ``--dataset`` argument before any model loads; returns the JSONL file it refers to.

    Raises ValueError for an unknown name, a missing file, invalid JSON (with its line number), or
    records with no usable prompt field.
    """
    path, *_ = _parse(name_or_path)
    return path


def load_prompts(name_or_path: str | os.PathLike, limit: int | None = None) -> list[BenchPrompt]:
    """Load a shipped prompt set by name (see ``DATASETS``) or any JSONL file; at most ``limit`` prompts."""
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
    _, label, records, fmt, _ = _parse(name_or_path)
    if limit is not None:
        records = records[:limit]
    return [BenchPrompt(id=record_id(rec, f"{label}-{i}"), dataset=label, turns=fmt(rec))
            for i, (_, rec) in enumerate(records)]
