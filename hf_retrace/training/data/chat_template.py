"""The chat template, shared by response generation, tokenization and τ evaluation so all see exactly the same prompt
tokens: the rendering itself is :mod:`hf_retrace.chat`'s (the benchmark and ``hf-retrace generate`` use it too); here,
what training adds: the token that ends an assistant turn and the check that concatenation matches a full render.

Example::

    ids = prompt_token_ids(tokenizer, ["What is 2 + 3?"])[0]  # user turn + generation prompt
    ids = prompt_token_ids(tokenizer, ["And times 4?"], [("What is 2 + 3?", "5")])[0]  # a second turn
    end_of_turn_token_id(tokenizer)  # e.g. <|im_end|>
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...chat import chat_messages, has_chat_template, prompt_token_ids, render_chat
from ...chat import render_prompt  # noqa: F401  (the data package exports it with prompt_token_ids)

_SENTINEL = "\u2063RETRACE_SENTINEL\u2063"


def end_of_turn_token_id(tokenizer: Any) -> int:
    """The token that closes an assistant turn in the chat template (e.g. ``<|im_end|>``, ``<|eot_id|>``).

    Found by rendering a sentinel answer and taking the first token after it when that token is special; otherwise
    (no template, or plain text after the answer) the tokenizer's ``eos_token_id``.
    """
    if has_chat_template(tokenizer):
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
        rendered = render_chat(tokenizer, chat, add_generation_prompt=False)
        if _SENTINEL in rendered:
            after = rendered.split(_SENTINEL, 1)[1]
            ids = tokenizer(after, add_special_tokens=False)["input_ids"]
            if ids and tokenizer.decode(ids[:1], skip_special_tokens=True) == "":
                return int(ids[0])
    if tokenizer.eos_token_id is None:
        raise ValueError("The tokenizer has neither a chat template that closes assistant turns nor an eos token.")
    return int(tokenizer.eos_token_id)


def split_matches_full_render(tokenizer: Any, prompt: str, response: str, history: Sequence[str] = ()) -> bool:
    """Whether prompt tokens + ``tokenizer(response)`` + end-of-turn equal the tokens of the full rendered chat.

    The training sequences are built by concatenation (:func:`tokenize_responses`); this reports whether that is
    what the tokenizer would give for the whole conversation rendered at once.
    """
    ours = prompt_token_ids(tokenizer, [prompt], [history])[0]
    ours += tokenizer(response, add_special_tokens=False)["input_ids"] + [end_of_turn_token_id(tokenizer)]
    chat = chat_messages(prompt, history) + [{"role": "assistant", "content": response}]
    full_text = render_chat(tokenizer, chat, add_generation_prompt=False)
    full = tokenizer(full_text, add_special_tokens=False)["input_ids"]
    return list(full[: len(ours)]) == ours
