"""Second turns: ShareGPT conversations whose second user turn follows the *target's own* first answer (MT-Bench).

The drafter sees second turns at inference (MT-Bench feeds the model's own first answer back before the second
question), so its data should hold them too: the first turn is answered by the target first, then the second turn
is asked with that answer in place of the one the conversation had.

1. :func:`read_sharegpt` reads ShareGPT's JSON (``[{"id", "conversations": [{"from", "value"}, ...]}, ...]``), also
   when the file is cut short: every complete conversation before the cut is returned.
2. :func:`extract_turns` keeps ``(id, turn1, turn2)`` of those that open human, gpt, human.
3. :func:`second_turn_records` pairs them with the target's answers to ``turn1`` (response records by id) into
   prompt records ``{"id": "<id>-turn2", "turns": [turn1, turn2], "answers": [answer]}``, which ``read_prompts``
   renders as a two-turn chat.

Example::

    turns = extract_turns(read_sharegpt("ShareGPT_V3_unfiltered_cleaned_split.json"), id_prefix="sharegpt-")
    answers = {r["id"]: r for r in read_answered(["data/responses"])}
    records = second_turn_records(turns, answers)
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...atomic import atomic_path
from ...jsonl import iter_jsonl

SECOND_TURN_SUFFIX = "-turn2"
_BETWEEN_ITEMS = re.compile(r"[\s,]*")


def first_turn_id(record_id: str) -> str:
    """The id of the conversation's first turn: a second turn's id without its ``-turn2``; any other id as is."""
    return record_id[: -len(SECOND_TURN_SUFFIX)] if record_id.endswith(SECOND_TURN_SUFFIX) else record_id


@dataclass(frozen=True)
class ConversationTurns:
    """The first two user turns of a conversation (the assistant's answer between them is not kept)."""

    id: str
    turn1: str
    turn2: str

    def record(self) -> dict[str, str]:
        return {"id": self.id, "turn1": self.turn1, "turn2": self.turn2}


def read_sharegpt(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The conversations of a ShareGPT JSON file (a list of objects), one at a time, until the end or the first item
    that does not parse (the published file is cut short mid-conversation: what precedes the cut is kept)."""
    text = Path(path).read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0:
        raise ValueError(f"{path}: expected a JSON list of conversations (ShareGPT's layout), found no '['.")
    decoder, position = json.JSONDecoder(), start + 1
    while True:
        position = _BETWEEN_ITEMS.match(text, position).end()
        if position >= len(text) or text[position] == "]":
            return
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        yield item


def _turn(message: Mapping[str, Any]) -> tuple[str | None, str | None]:
    role = message.get("from", message.get("role"))
    role = {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant"}.get(role, role)
    text = message.get("value", message.get("content"))
    return role, text if isinstance(text, str) else None


def extract_turns(
    conversations: Iterable[Mapping[str, Any]],
    *,
    id_prefix: str = "",
    min_chars: int = 16,
    max_chars: int = 2000,
) -> list[ConversationTurns]:
    """``(id, turn1, turn2)`` of every conversation that opens user, assistant, user, both user turns
    ``min_chars``..``max_chars`` long (stripped; the text is kept as written). Ids get ``id_prefix``
    (``"sharegpt-"`` matches the ids of ``train/sharegpt-prompts.jsonl``); a repeated id keeps its first
    conversation."""
    found: dict[str, ConversationTurns] = {}
    for conversation in conversations:
        messages = conversation.get("conversations") or conversation.get("messages") or []
        if len(messages) < 3 or conversation.get("id") is None:
            continue
        (role1, turn1), (role2, _), (role3, turn2) = (_turn(message) for message in messages[:3])
        if (role1, role2, role3) != ("user", "assistant", "user") or turn1 is None or turn2 is None:
            continue
        if not all(min_chars <= len(turn.strip()) <= max_chars for turn in (turn1, turn2)):
            continue
        key = f"{id_prefix}{conversation['id']}"
        found.setdefault(key, ConversationTurns(key, turn1, turn2))
    return list(found.values())


def read_turns(path: str | os.PathLike[str]) -> list[ConversationTurns]:
    """Turns written by :func:`write_jsonl` of ``ConversationTurns.record()`` (``id, turn1, turn2``)."""
    return [ConversationTurns(**record) for _, record in iter_jsonl(Path(path))]


def second_turn_records(
    turns: Iterable[ConversationTurns], answers: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Prompt records for the second turn of every conversation whose first turn the target has answered.

    ``answers`` maps a first turn's id to the target's response record (``prompt``, ``response``); the record is
    used only when its ``prompt`` is that conversation's ``turn1`` and it has no history of its own, so an answer to
    another question is never fed back.
    """
    records = []
    for conversation in turns:
        answer = answers.get(conversation.id)
        if answer is None or answer.get("history") or answer.get("prompt") != conversation.turn1:
            continue
        records.append({
            "id": conversation.id + SECOND_TURN_SUFFIX, "source": "sharegpt-turn2",
            "turns": [conversation.turn1, conversation.turn2], "answers": [answer["response"]],
        })
    return records


def write_jsonl(records: Iterable[Mapping[str, Any]], out: str | os.PathLike[str]) -> int:
    """Write records as JSONL through a temporary file and an atomic rename; return how many were written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with atomic_path(out) as temporary, temporary.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count
