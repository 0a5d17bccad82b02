"""The one chat renderer (:mod:`hf_retrace.chat`): a multi-turn prompt, MT-Bench style (user, assistant, user), is the
same token ids for training, the benchmark and ``hf-retrace generate``."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from helpers import word_level_tokenizer

from hf_retrace.bench import loop
from hf_retrace.bench.datasets import BenchPrompt
from hf_retrace.bench.methods import ALL_METHODS
from hf_retrace.side_by_side import Run, chat_input_ids
from hf_retrace.training.data import prompt_token_ids

TURNS = ["how do you make time", "and then what"]
ANSWER = "you make it"


def _expected_ids(tokenizer, with_template: bool) -> tuple[list[int], list[int]]:
    """Turn 1's and turn 2's input ids, written out from tests/helpers.py's template (not rendered by the package)."""
    if with_template:
        first = f"<|user|> {TURNS[0]} <|end|> <|assistant|>"
        second = f"<|user|> {TURNS[0]} <|end|> <|assistant|> {ANSWER} <|end|> <|user|> {TURNS[1]} <|end|> <|assistant|>"
    else:  # no template: the turns joined by blank lines
        first, second = TURNS[0], f"{TURNS[0]}\n\n{ANSWER}\n\n{TURNS[1]}"
    return tuple(tokenizer.convert_tokens_to_ids(text.split()) for text in (first, second))


def _bench_inputs(tokenizer, monkeypatch) -> list[list[int]]:
    """The input ids the benchmark's loop sends to ``generate`` for each turn (its model calls stubbed: every answer
    is ``ANSWER``)."""
    sent = []

    def fake_generate(target, tokenizer, input_ids, **kwargs):
        sent.append(input_ids[0].tolist())
        return Run(token_ids=[0], text=ANSWER, seconds=1.0)

    monkeypatch.setattr(loop, "timed_generate", fake_generate)
    bench = types.SimpleNamespace(
        methods=[ALL_METHODS["plain"]], tokenizer=tokenizer, max_new_tokens=4, target=None, dtype="fp32", repeats=1,
        prefill_seconds=lambda input_ids, onednn=True: 0.0, generate_kwargs=lambda method: {},
        rounds_of=lambda method: contextlib.nullcontext({"stats": None}),
    )
    loop.run_prompt(bench, BenchPrompt("q1", "mt-bench", list(TURNS)), temperature=0.0, seed=0)
    return sent


@pytest.mark.parametrize("with_template", [True, False], ids=["chat-template", "no-template"])
def test_a_multi_turn_prompt_is_the_same_tokens_on_every_path(with_template, monkeypatch):
    tokenizer = word_level_tokenizer()
    if not with_template:
        tokenizer.chat_template = None
    first, second = _expected_ids(tokenizer, with_template)
    assert tokenizer.unk_token_id not in first + second  # every word is in the vocabulary: the ids mean something

    training = prompt_token_ids(tokenizer, [TURNS[0], TURNS[1]], [(), (TURNS[0], ANSWER)])
    generate_command = chat_input_ids(tokenizer, TURNS[0])
    benchmark = _bench_inputs(tokenizer, monkeypatch)

    assert training == benchmark == [first, second]
    assert generate_command.dtype == torch.long and generate_command[0].tolist() == first


def test_a_history_must_alternate_user_and_assistant():
    with pytest.raises(ValueError, match="alternate user and assistant"):
        prompt_token_ids(word_level_tokenizer(), [TURNS[1]], [(TURNS[0],)])
