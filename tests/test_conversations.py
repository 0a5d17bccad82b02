"""Second turns after the target's own first answer (ShareGPT, MT-Bench style), two-turn prompts through generation
and tokenization, and the prompt recipes of ``hf-retrace data`` (chat-prompts, mix)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from helpers import smollm2_gguf_tokenizer

from hf_retrace.training.data import (
    PromptRecord,
    TokenizedDataset,
    generate_responses,
    prompt_token_ids,
    read_prompts,
    read_responses,
    records_token_ids,
    split_matches_full_render,
    tokenize_responses,
)
from hf_retrace.training.data.conversations import (
    ConversationTurns,
    extract_turns,
    read_sharegpt,
    read_turns,
    second_turn_records,
    write_jsonl,
)
from hf_retrace.training.data.recipes import run_chat_prompts, run_mix
from hf_retrace.training.data.response_shards import read_answered

@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_gguf_tokenizer()


def _conversation(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": role, "value": text} for role, text in turns]}


CONVERSATIONS = [
    _conversation("a_0", ("human", "What is the capital of France?"), ("gpt", "Paris."),
                  ("human", "And how many people live there?")),
    _conversation("b_0", ("human", "Write a haiku about the sea."), ("gpt", "Waves...")),  # one turn only
    _conversation("c_1", ("gpt", "continued answer"), ("human", "thanks, and then?"), ("gpt", "then this")),
    _conversation("d_0", ("human", "Tell me a joke about cats."), ("gpt", "..."), ("human", "Another one please.")),
]


def _sharegpt_file(tmp_path: Path, cut: bool) -> Path:
    text = json.dumps(CONVERSATIONS, indent=2)
    if cut:  # the published file stops in the middle of a conversation
        text = text[: text.index('"d_0"') + 40]
    path = tmp_path / "sharegpt.json"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_sharegpt_file_cut_short_yields_every_conversation_before_the_cut(tmp_path):
    assert [c["id"] for c in read_sharegpt(_sharegpt_file(tmp_path, cut=False))] == ["a_0", "b_0", "c_1", "d_0"]
    assert [c["id"] for c in read_sharegpt(_sharegpt_file(tmp_path, cut=True))] == ["a_0", "b_0", "c_1"]


def test_only_conversations_opening_user_assistant_user_give_second_turns(tmp_path):
    turns = extract_turns(read_sharegpt(_sharegpt_file(tmp_path, cut=False)), id_prefix="sharegpt-")
    assert turns == [
        ConversationTurns("sharegpt-a_0", "What is the capital of France?", "And how many people live there?"),
        ConversationTurns("sharegpt-d_0", "Tell me a joke about cats.", "Another one please."),
    ]
    write_jsonl((t.record() for t in turns), tmp_path / "turns.jsonl")
    assert read_turns(tmp_path / "turns.jsonl") == turns


def test_second_turns_follow_the_targets_own_answer_to_the_same_question():
    turns = [ConversationTurns("s-a", "Q1", "Q2"), ConversationTurns("s-b", "R1", "R2"),
             ConversationTurns("s-c", "S1", "S2")]
    answers = {
        "s-a": {"id": "s-a", "prompt": "Q1", "response": "the target's answer"},
        "s-b": {"id": "s-b", "prompt": "another question", "response": "x"},  # not this conversation's turn
    }
    assert second_turn_records(turns, answers) == [
        {"id": "s-a-turn2", "source": "sharegpt-turn2", "turns": ["Q1", "Q2"], "answers": ["the target's answer"]}
    ]


def test_a_turns_record_with_answers_reads_as_the_next_turn_after_that_history(tmp_path):
    path = tmp_path / "p.jsonl"
    write_jsonl([{"id": "x-turn2", "turns": ["Q1", "Q2"], "answers": ["A1"]},
                 {"id": "mt", "turns": ["Q1", "Q2"]}], path)
    assert read_prompts(path, suffix="!") == [PromptRecord("x-turn2", "Q2!", ("Q1", "A1")), PromptRecord("mt", "Q1!")]
    write_jsonl([{"id": "bad", "turns": ["Q1"], "answers": ["A1"]}], path)
    with pytest.raises(ValueError, match="shorter list"):
        read_prompts(path)


def test_a_two_turn_prompt_renders_the_full_conversation(tokenizer):
    history = ("What is 2 + 3?", "2 + 3 = 5.")
    ids = prompt_token_ids(tokenizer, ["And times 4?"], [history])[0]
    messages = [{"role": "user", "content": history[0]}, {"role": "assistant", "content": history[1]},
                {"role": "user", "content": "And times 4?"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert split_matches_full_render(tokenizer, "And times 4?", "20.", history)


def test_eval_and_calibration_prompts_keep_a_second_turns_history(tmp_path, tokenizer):
    """`train --eval-prompts` and `calibrate --prompts` ask a second turn after its first turn and answer."""
    from types import SimpleNamespace

    from hf_retrace.training.cli.commands import _calibration_prompts
    from hf_retrace.training.cli.train_command import _eval_prompt_ids

    path = tmp_path / "p.jsonl"
    write_jsonl([{"id": "x-turn2", "turns": ["What is 2 + 3?", "And times 4?"], "answers": ["2 + 3 = 5."]},
                 {"id": "y", "prompt": "Hi"}], path)
    expected = [prompt_token_ids(tokenizer, ["And times 4?"], [("What is 2 + 3?", "2 + 3 = 5.")])[0],
                prompt_token_ids(tokenizer, ["Hi"])[0]]
    assert records_token_ids(tokenizer, read_prompts(path)) == expected
    assert _eval_prompt_ids(SimpleNamespace(eval_prompts=str(path)), tokenizer, None, []) == expected
    assert _calibration_prompts(SimpleNamespace(prompts=str(path), limit=None), tokenizer, None) == expected


@pytest.fixture(scope="module")
def tiny_target(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).eval()


def test_second_turn_answers_are_generated_and_tokenized_after_their_history(tmp_path, tokenizer, tiny_target):
    history = ("Name a colour.", "Blue.")
    prompts = [PromptRecord("one", "Name a colour."), PromptRecord("one-turn2", "Another one?", history)]
    generate_responses(tiny_target, tokenizer, prompts, tmp_path / "responses", max_new_tokens=6, batch_size=2)
    records = {r["id"]: r for r in read_responses([tmp_path / "responses"])}
    assert records["one-turn2"]["history"] == list(history) and "history" not in records["one"]
    # batch-1 greedy decoding of the full two-turn prompt gives the same tokens
    ids = torch.tensor([prompt_token_ids(tokenizer, ["Another one?"], [history])[0]])
    plain = tiny_target.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    expected = plain[0, ids.shape[1]:].tolist()[: len(records["one-turn2"]["response_ids"])]
    assert records["one-turn2"]["response_ids"] == expected

    tokenize_responses(tokenizer, [tmp_path / "responses"], tmp_path / "tok", max_length=512)
    dataset = TokenizedDataset(tmp_path / "tok")
    item = dataset[list(json.loads((tmp_path / "tok" / "shard-00000.ids.json").read_text())).index("one-turn2")]
    prompt_ids = prompt_token_ids(tokenizer, ["Another one?"], [history])[0]
    assert item["input_ids"][: len(prompt_ids)].tolist() == prompt_ids
    assert not item["loss_mask"][: len(prompt_ids)].any() and item["loss_mask"][len(prompt_ids):].all()


def test_answers_of_a_run_in_progress_count_as_answered(tmp_path):
    out = tmp_path / "responses"
    out.mkdir()
    done = {"id": "a", "prompt": "p", "response": "r", "finish": "eos"}
    (out / "responses-00000.jsonl").write_text(json.dumps(done) + "\n")
    partial = json.dumps({**done, "id": "b"}) + "\n" + '{"id": "c", "pro'  # a batch cut mid-write
    (out / "responses-00001.jsonl.partial").write_text(partial)
    assert sorted(r["id"] for r in read_answered([out])) == ["a", "b"]


def test_mix_takes_the_next_unanswered_prompts_of_each_file(tmp_path):
    first = tmp_path / "code.jsonl"
    second = tmp_path / "turns.jsonl"
    write_jsonl([{"id": f"c{i}", "prompt": f"code {i}"} for i in range(5)], first)
    write_jsonl([{"id": f"t{i}-turn2", "turns": ["q", f"t{i}"], "answers": ["a"]} for i in range(2)], second)
    answered = tmp_path / "answered.jsonl"
    write_jsonl([{"id": i, "prompt": "x", "response": "y", "finish": "eos"} for i in ("c0", "c2", "t0-turn2")],
                answered)
    out = tmp_path / "round.jsonl"
    run_mix(argparse.Namespace(prompts=[str(first), str(second)], answered=[str(answered)], per_file=2, out=str(out),
                               max_prompt_tokens=0))
    taken = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in taken] == ["c1", "c3", "t1-turn2"]
    assert taken[2]["answers"] == ["a"]  # records are copied as they are: still a second turn
    with pytest.raises(SystemExit, match="needs ids"):
        write_jsonl([{"prompt": "no id"}], first)
        run_mix(argparse.Namespace(prompts=[str(first)], answered=[], per_file=1, out=str(out), max_prompt_tokens=0))


def test_mix_passes_over_prompts_too_long_to_be_answered(tmp_path, tokenizer):
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    prompts = tmp_path / "p.jsonl"
    write_jsonl([{"id": "long", "prompt": "word " * 400}, {"id": "short", "prompt": "hi"},
                 {"id": "long-turn2", "turns": ["a", "b"], "answers": ["word " * 400]}], prompts)
    out = tmp_path / "round.jsonl"
    run_mix(argparse.Namespace(prompts=[str(prompts)], answered=[], per_file=5, out=str(out),
                               target=str(tokenizer_dir), max_prompt_tokens=300))
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["short"]


def test_chat_prompts_splits_unanswered_first_turns_and_asks_second_turns_after_the_answer(tmp_path, tokenizer):
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    prompts = tmp_path / "sharegpt-prompts.jsonl"
    write_jsonl([{"id": "sharegpt-a_0", "prompt": "What is the capital of France?"},
                 {"id": "sharegpt-b_0", "prompt": "Write a python function that reverses a list."},
                 {"id": "sharegpt-d_0", "prompt": "Tell me a joke about cats."}], prompts)
    answers = tmp_path / "answers.jsonl"
    write_jsonl([{"id": "sharegpt-a_0", "prompt": "What is the capital of France?", "response": "Paris.",
                  "finish": "eos"}], answers)
    out = tmp_path / "chat"
    args = argparse.Namespace(prompts=str(prompts), conversations=str(_sharegpt_file(tmp_path, cut=False)),
                              answers=[str(answers)], out_dir=str(out), id_prefix="sharegpt-",
                              target=str(tokenizer_dir), max_prompt_tokens=768)
    run_chat_prompts(args)

    def ids(name):
        return [json.loads(line)["id"] for line in (out / name).read_text().splitlines()]

    assert ids("turns.jsonl") == ["sharegpt-a_0", "sharegpt-d_0"]
    assert ids("first-turns-code.jsonl") == ["sharegpt-b_0"]
    assert ids("first-turns-chat.jsonl") == ["sharegpt-d_0"]
    [second] = [json.loads(line) for line in (out / "second-turns.jsonl").read_text().splitlines()]
    assert second == {"id": "sharegpt-a_0-turn2", "source": "sharegpt-turn2",
                      "turns": ["What is the capital of France?", "And how many people live there?"],
                      "answers": ["Paris."]}
    run_chat_prompts(argparse.Namespace(**{**vars(args), "max_prompt_tokens": 10}))
    assert (out / "second-turns.jsonl").read_text() == ""  # longer than --max-prompt-tokens: left out


def test_the_recipes_are_data_subcommands():
    from hf_retrace.cli import build_parser
    from hf_retrace.training.data.recipes import run_code_prompts

    parser = build_parser()
    assert parser.parse_args(["data", "mix", "--prompts", "a", "--per-file", "3", "--out", "o"]).func is run_mix
    assert parser.parse_args(["data", "code-prompts", "--out", "o"]).func is run_code_prompts
    args = parser.parse_args(["data", "chat-prompts", "--prompts", "p", "--conversations", "c", "--out-dir", "d"])
    assert args.func is run_chat_prompts and args.max_prompt_tokens == 768
