"""The chat template, shared by response generation and tokenization so both see exactly the same prompt tokens.

Example::

    ids = prompt_token_ids(tokenizer, ["What is 2 + 3?"])[0]  # user turn + generation prompt
    end_of_turn_token_id(tokenizer)  # e.g. <|im_end|>
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_SENTINEL = "\u2063RETRACE_SENTINEL\u2063"


def render_prompt(tokenizer: Any, prompt: str) -> str:
    """The user turn plus the generation prompt, as text, in the tokenizer's chat template.

    ``enable_thinking=False`` is always passed: templates that know it (Qwen3) turn thinking off, the others ignore
    it. A tokenizer without a chat template gets the raw prompt.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return prompt
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )


def prompt_token_ids(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of :func:`render_prompt` for each prompt (special tokens come from the template itself)."""
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if not prompts:
        return []
    texts = [render_prompt(tokenizer, prompt) for prompt in prompts]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=not has_template)["input_ids"]]


def end_of_turn_token_id(tokenizer: Any) -> int:
    """The token that closes an assistant turn in the chat template (e.g. ``<|im_end|>``, ``<|eot_id|>``).

    Found by rendering a sentinel answer and taking the first token after it when that token is special; otherwise
    (no template, or plain text after the answer) the tokenizer's ``eos_token_id``.
    """
    if getattr(tokenizer, "chat_template", None) is not None:
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
        rendered = tokenizer.apply_chat_template(chat, tokenize=False, enable_thinking=False)
        if _SENTINEL in rendered:
            after = rendered.split(_SENTINEL, 1)[1]
            ids = tokenizer(after, add_special_tokens=False)["input_ids"]
            if ids and tokenizer.decode(ids[:1], skip_special_tokens=True) == "":
                return int(ids[0])
    if tokenizer.eos_token_id is None:
        raise ValueError("The tokenizer has neither a chat template that closes assistant turns nor an eos token.")
    return int(tokenizer.eos_token_id)


def split_matches_full_render(tokenizer: Any, prompt: str, response: str) -> bool:
    """Whether prompt tokens + ``tokenizer(response)`` + end-of-turn equal the tokens of the full rendered chat.

    The training sequences are built by concatenation (:func:`tokenize_responses`); this reports whether that is
    what the tokenizer would give for the whole conversation rendered at once.
    """
    ours = prompt_token_ids(tokenizer, [prompt])[0]
    ours += tokenizer(response, add_special_tokens=False)["input_ids"] + [end_of_turn_token_id(tokenizer)]
    chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    full_text = tokenizer.apply_chat_template(chat, tokenize=False, enable_thinking=False)
    full = tokenizer(full_text, add_special_tokens=False)["input_ids"]
    return list(full[: len(ours)]) == ours

