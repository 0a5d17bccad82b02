"""The one chat rendering: a user turn (after the conversation's earlier turns) as the token ids the target answers.

``hf-retrace generate`` (:mod:`hf_retrace.side_by_side`), the benchmark (:mod:`hf_retrace.bench.loop`) and training's
data and τ evaluation (:mod:`hf_retrace.training.data.chat_template`) all render through here, so one prompt is the
same tokens everywhere.

Example::

    prompt_token_ids(tokenizer, ["What is 2 + 3?"])[0]  # user turn + generation prompt
    prompt_token_ids(tokenizer, ["And times 4?"], [("What is 2 + 3?", "5")])[0]  # a second turn, MT-Bench style
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["chat_messages", "has_chat_template", "humaneval_prompt", "prompt_token_ids", "render_chat", "render_prompt"]

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
