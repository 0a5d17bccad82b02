"""Prompts in: JSONL files, ``datasets.Dataset`` rows or dicts, with the prompt and id fields found by name.

:func:`validate_prompt_file` checks a file cheaply before any model is loaded; :func:`read_prompts` reads it.

Example::

    prompts = read_prompts("gsm8k-train.jsonl", limit=64, suffix="\\nPlease reason step by step.")
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...chat import ID_FIELDS, PROMPT_FIELDS, prompt_field, prompt_token_ids, record_id, user_turns
from ...jsonl import iter_jsonl

ANSWERS_FIELD = "answers"
"""With ``turns`` (user turns), the assistant's earlier answers, fed back between turns as MT-Bench does."""

__all__ = ["ANSWERS_FIELD", "ID_FIELDS", "PROMPT_FIELDS", "PromptRecord", "read_prompts", "records_token_ids",
           "validate_prompt_file"]  # the record schema itself (PROMPT_FIELDS, ID_FIELDS) is hf_retrace.chat's


@dataclass(frozen=True)
class PromptRecord:
    """One prompt to send to the target: a stable ``id`` (for resuming) and the user-turn text.

    ``history`` holds the earlier turns of a multi-turn prompt, user and assistant alternating from the first user
    turn (empty for a single turn): ``PromptRecord("q1-turn2", "Now in French.", ("Say hi.", "Hi!"))``.
    """

    id: str
    prompt: str
    history: tuple[str, ...] = ()


def _prompt_text(record: Mapping[str, Any]) -> str | None:
    """The prompt text of one record: its first user turn (:func:`~hf_retrace.chat.user_turns`)."""
    turns = user_turns(record)
    return turns[0] if turns else None


def _answered_turns(record: Mapping[str, Any], where: str) -> tuple[str, tuple[str, ...]] | None:
    """``(prompt, history)`` of a ``turns`` + ``answers`` record; ``None`` when the record has no ``answers``."""
    if record.get(ANSWERS_FIELD) is None or "turns" not in record:
        return None
    turns, answers = record["turns"], record[ANSWERS_FIELD]
    texts = [*turns, *answers] if isinstance(turns, list) and isinstance(answers, list) else None
    if texts is None or not all(isinstance(text, str) for text in texts) or len(answers) >= len(turns):
        raise ValueError(
            f"{where}: `turns` must be a list of user turns (strings) and `answers` a shorter list of the assistant's "
            f"answers to the first of them (strings); got turns={turns!r:.80} answers={answers!r:.80}."
        )
    history = tuple(text for pair in zip(turns, answers) for text in pair)
    return turns[len(answers)], history


def records_token_ids(tokenizer: Any, records: Sequence[PromptRecord]) -> list[list[int]]:
    """The chat prompt's token ids of each record, its earlier turns (``history``) rendered before it."""
    return prompt_token_ids(tokenizer, [record.prompt for record in records], [record.history for record in records])


def _missing_fields_error(where: str, records: Sequence[Mapping[str, Any]]) -> ValueError:
    found = sorted({key for record in records for key in record})
    return ValueError(
        f"{where}: no prompt field found. Fields found: {found}; expected one of {list(PROMPT_FIELDS)} "
        "(turns/messages/conversations: the first user turn is used). Rename the field or convert the file."
    )


def validate_prompt_file(path: str | os.PathLike[str], num_records: int = 8) -> str:
    """Check cheaply that ``path`` is JSONL whose first records carry a prompt field; return that field's name.

    Raises ``FileNotFoundError`` or a ``ValueError`` that names the fields found and those expected, so a CLI can
    fail before loading any model.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Prompt file not found: {path}")
    head: list[dict[str, Any]] = []
    for _, record in iter_jsonl(path):
        head.append(record)
        if len(head) >= num_records:
            break
    if not head:
        raise ValueError(f"{path}: the file holds no records; expected JSONL with one of {list(PROMPT_FIELDS)}.")
    for record in head:
        if _prompt_text(record) is not None:
            return prompt_field(record)
    raise _missing_fields_error(f"{path} (first {len(head)} records)", head)


def _raw_prompt_records(source: Any) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(fallback id, record) pairs from a JSONL path, a ``datasets.Dataset`` or any iterable of mappings."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        validate_prompt_file(path)
        for line_number, record in iter_jsonl(path):
            yield f"{path.stem}-{line_number}", record
        return
    # a datasets.Dataset (duck-typed, so `datasets` stays an optional extra) or a plain list of dicts
    for row_index, record in enumerate(source):
        if not isinstance(record, Mapping):
            raise ValueError(f"Prompt record {row_index} is a {type(record).__name__}; expected a mapping.")
        yield str(row_index), record


def read_prompts(
    path_or_dataset: str | os.PathLike[str] | Iterable[Mapping[str, Any]],
    limit: int | None = None,
    *,
    suffix: str = "",
) -> list[PromptRecord]:
    """Read prompts from a JSONL file, a ``datasets.Dataset`` or an iterable of dicts.

    The prompt comes from the first field of :data:`PROMPT_FIELDS` present (for multi-turn records, the first user
    turn). A record with ``turns`` (user turns) and ``answers`` (the assistant's answers to the first of them) asks
    for the turn after the last answer, with the turns and answers before it as ``history`` (MT-Bench's second
    turn: ``{"turns": [q1, q2], "answers": [a1]}``). The id comes from the first of
    :data:`~hf_retrace.chat.ID_FIELDS` present, else ``<file stem>-<line number>`` (or the row index). ``suffix`` is appended to every prompt
    (e.g. the DFlash GSM8K/MATH instruction).

    Example::

        prompts = read_prompts("data/train/gsm8k-train.jsonl", limit=64)
    """
    prompts: list[PromptRecord] = []
    seen: set[str] = set()
    for fallback_id, record in _raw_prompt_records(path_or_dataset):
        if limit is not None and len(prompts) >= limit:
            break
        text = _prompt_text(record)
        rid = record_id(record, fallback_id)
        if text is None:
            raise _missing_fields_error(f"prompt record {rid!r}", [record])
        if rid in seen:
            raise ValueError(f"Duplicate prompt id {rid!r}: ids must be unique for resumable generation.")
        seen.add(rid)
        answered = _answered_turns(record, f"prompt record {rid!r}")
        if answered is not None:
            text, history = answered
            prompts.append(PromptRecord(id=rid, prompt=text + suffix, history=history))
            continue
        prompts.append(PromptRecord(id=rid, prompt=text + suffix))
    return prompts

