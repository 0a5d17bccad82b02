"""The one chat rendering: a user turn (after the conversation's earlier turns) as the token ids the target answers.

``hf-retrace generate`` (:mod:`hf_retrace.side_by_side`), the benchmark (:mod:`hf_retrace.bench.loop`) and training's
data and τ evaluation (:mod:`hf_retrace.training.data.chat_template`) all render through here, so one prompt is the
same tokens everywhere.

Example::

    prompt_token_ids(tokenizer, ["What is 2 + 3?"])[0]  # user turn + generation prompt
    prompt_token_ids(tokenizer, ["And times 4?"], [("What is 2 + 3?", "5")])[0]  # a second turn, MT-Bench style
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ID_FIELDS", "PROMPT_FIELDS", "chat_messages", "has_chat_template", "humaneval_prompt", "prompt_field",
           "prompt_token_ids", "record_id", "render_chat", "render_prompt", "user_turns"]

# DFlash's HumanEval instruction (its ``benchmark.py``): the benchmark's ``humaneval`` set and training's code prompts
_HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{code}\n```"


def humaneval_prompt(code: str) -> str:
    """A HumanEval problem's user turn: ``code`` (imports, signature, docstring) wrapped in DFlash's instruction."""
    return _HUMANEVAL.format(code=code)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_messages(prompt: str, history: Sequence[str] = ()) -> list[dict[str, str]]:
    """Chat messages: ``history`` (user and assistant alternating, user first), then the user turn ``prompt``."""
    if len(history) % 2:
        raise ValueError(f"history must alternate user and assistant turns (an even count), got {len(history)} texts.")
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": text} for i, text in enumerate(history)] + [
        {"role": "user", "content": prompt}]


def render_chat(tokenizer: Any, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
    """``messages`` as text in the tokenizer's chat template. ``enable_thinking=False`` is always passed: templates
    that know it (Qwen3) turn thinking off, the others ignore it."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         enable_thinking=False)


def render_prompt(tokenizer: Any, prompt: str, history: Sequence[str] = ()) -> str:
    """The user turn ``prompt`` (after ``history``'s turns, the target's own earlier answers among them, as MT-Bench
    feeds them back) plus the generation prompt, as text. A tokenizer without a chat template gets the turns joined by
    blank lines."""
    messages = chat_messages(prompt, history)
    if not has_chat_template(tokenizer):
        return "\n\n".join(message["content"] for message in messages)
    return render_chat(tokenizer, messages, add_generation_prompt=True)


def prompt_token_ids(
    tokenizer: Any, prompts: Sequence[str], histories: Sequence[Sequence[str]] | None = None
) -> list[list[int]]:
    """Token ids of :func:`render_prompt` for each prompt (special tokens come from the template itself, or from the
    tokenizer without one); ``histories``, when given, holds each prompt's earlier turns."""
    if not prompts:
        return []
    histories = [()] * len(prompts) if histories is None else histories
    if len(histories) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(histories)} histories; give one history per prompt.")
    texts = [render_prompt(tokenizer, prompt, history) for prompt, history in zip(prompts, histories)]
    encoded = tokenizer(texts, add_special_tokens=not has_chat_template(tokenizer))["input_ids"]
    return [list(ids) for ids in encoded]


# --- prompt records: the one schema of the benchmark's and training's prompt files ----------------------------------
PROMPT_FIELDS: tuple[str, ...] = ("turns", "messages", "conversations", "prompt", "question", "problem")
"""The fields a prompt record carries its user turns in, the first holding usable text wins: ``turns`` (the user
turns, a list of strings), ``messages`` / ``conversations`` (chat messages, ``{role, content}`` or ``{from, value}``:
the user ones), or one text (``prompt``, ``question``, ``problem``)."""

ID_FIELDS: tuple[str, ...] = ("id", "question_id", "task_id", "unique_id", "idx")
"""The fields a prompt record's id comes from, the first holding a value wins."""


def _user_text(message: Any) -> str | None:
    if isinstance(message, Mapping) and message.get("role", message.get("from")) in ("user", "human"):
        text = message.get("content", message.get("value"))
        return text if isinstance(text, str) else None
    return None


_TURN_LISTS = ("turns", "messages", "conversations")  # the fields of PROMPT_FIELDS that hold a list


def _turns_in(field: str, value: Any) -> list[str] | None:
    """``field``'s user turns; None unless a list of strings or of chat messages (:data:`_TURN_LISTS`) or one string
    (the others), no turn blank."""
    if isinstance(value, str) and field not in _TURN_LISTS:
        turns = [value]
    elif field not in _TURN_LISTS or not isinstance(value, (list, tuple)):
        return None
    elif all(isinstance(turn, str) for turn in value):
        turns = list(value)
    else:
        turns = [text for text in map(_user_text, value) if text is not None]
    return turns if turns and all(turn.strip() for turn in turns) else None


def prompt_field(record: Mapping[str, Any]) -> str | None:
    """The field of :data:`PROMPT_FIELDS` a record's user turns come from (the first holding usable text), or None."""
    return next((field for field in PROMPT_FIELDS if field in record and _turns_in(field, record[field])), None)


def user_turns(record: Mapping[str, Any]) -> list[str] | None:
    """The user turns of a prompt record, from its :func:`prompt_field`; None when no field holds usable text.

    Example: ``user_turns({"turns": ["Hi?", "And then?"]}) == ["Hi?", "And then?"]``,
    ``user_turns({"messages": [{"role": "user", "content": "Hi?"}]}) == ["Hi?"]``,
    ``user_turns({"turns": [], "prompt": "Hi?"}) == ["Hi?"]``.
    """
    field = prompt_field(record)
    return None if field is None else _turns_in(field, record[field])


def record_id(record: Mapping[str, Any], fallback: str | None = None) -> str | None:
    """A prompt record's id: its first :data:`ID_FIELDS` value that is a scalar, else ``fallback``."""
    for field in ID_FIELDS:
        value = record.get(field)
        if value is not None and not isinstance(value, (Mapping, list, tuple)):
            return str(value)
    return fallback
