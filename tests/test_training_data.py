"""Data from the target: prompt reading, resumable generation, tokenization into masked training sequences."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import smollm2_gguf_tokenizer

from hf_retrace.training.data import (
    PromptRecord,
    TokenizedDataset,
    build_sequence,
    end_of_turn_token_id,
    generate_responses,
    prompt_token_ids,
    read_prompts,
    read_responses,
    response_shards,
    split_matches_full_render,
    tokenize_responses,
    validate_prompt_file,
)

@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_gguf_tokenizer()


@pytest.fixture(scope="module")
def target_with_smollm_vocab(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


PROMPTS = [
    PromptRecord(id=f"p{i}", prompt=text)
    for i, text in enumerate(
        [
            "What is 2 + 2?",
            "Write a haiku about the sea and the wind over the dunes at night.",
            "Hi",
            "Explain speculative decoding in one long sentence, with an example about a drafter and a target.",
            "Name three colours.",
            "Why is the sky blue? Please answer in detail, citing Rayleigh scattering.",
            "Count to five.",
        ]
    )
]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def _records_by_id(out_dir: Path) -> dict[str, dict]:
    return {record["id"]: record for record in read_responses([out_dir])}


# --- prompts ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "field", "expected"),
    [
        ({"id": "a", "prompt": "P"}, "prompt", "P"),
        ({"id": "a", "question": "Q", "answer": "x"}, "question", "Q"),
        ({"id": "a", "problem": "M", "solution": "x"}, "problem", "M"),
        ({"question_id": 81, "turns": ["first", "second"]}, "turns", "first"),
        ({"id": "a", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "U"}]},
         "messages", "U"),
        ({"id": "a", "conversations": [{"from": "human", "value": "H"}, {"from": "gpt", "value": "g"}]},
         "conversations", "H"),
    ],
)
def test_prompt_field_detection(tmp_path, record, field, expected):
    path = _write_jsonl(tmp_path / "prompts.jsonl", [record])
    assert validate_prompt_file(path) == field
    [prompt] = read_prompts(path)
    assert prompt.prompt == expected
    assert prompt.id == str(record.get("id", record.get("question_id")))


def test_ids_fall_back_to_line_numbers_and_limit_and_suffix(tmp_path):
    path = _write_jsonl(tmp_path / "qs.jsonl", [{"question": f"q{i}"} for i in range(5)])
    prompts = read_prompts(path, limit=3, suffix="\nThink.")
    assert [p.id for p in prompts] == ["qs-1", "qs-2", "qs-3"]
    assert prompts[0].prompt == "q0\nThink."


def test_file_without_prompt_fields_is_a_clear_error(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"id": 1, "text": "x", "label": 0}] * 3)
    with pytest.raises(ValueError, match=r"Fields found: \['id', 'label', 'text'\].*expected one of \['turns'"):  # hf_retrace.chat.PROMPT_FIELDS
        validate_prompt_file(path)
    with pytest.raises(ValueError, match="no prompt field found"):
        read_prompts(path)


def test_duplicate_ids_are_rejected(tmp_path):
    path = _write_jsonl(tmp_path / "dup.jsonl", [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}])
    with pytest.raises(ValueError, match="Duplicate prompt id 'x'"):
        read_prompts(path)


def test_dataset_like_input_uses_row_indices():
    rows = [{"prompt": "a"}, {"prompt": "b", "id": "named"}]  # what iterating a datasets.Dataset yields
    assert read_prompts(rows) == [PromptRecord("0", "a"), PromptRecord("named", "b")]


# --- generation ---------------------------------------------------------------------------------------------------


def test_left_padded_batches_match_batch_one_greedy(tmp_path, tokenizer, target_with_smollm_vocab):
    batched = generate_responses(target_with_smollm_vocab, tokenizer, PROMPTS, tmp_path / "b4", batch_size=4, max_new_tokens=12)
    single = generate_responses(target_with_smollm_vocab, tokenizer, PROMPTS, tmp_path / "b1", batch_size=1, max_new_tokens=12)
    assert batched.num_generated == single.num_generated == len(PROMPTS)
    batched_records, single_records = _records_by_id(tmp_path / "b4"), _records_by_id(tmp_path / "b1")
    for prompt in PROMPTS:
        assert batched_records[prompt.id]["response_ids"] == single_records[prompt.id]["response_ids"], prompt.id
        assert batched_records[prompt.id]["response"] == single_records[prompt.id]["response"]
    # left-padded batches answer with the same tokens as the target's own generate, one prompt at a time
    ids = prompt_token_ids(tokenizer, [p.prompt for p in PROMPTS])
    for prompt, prompt_ids in zip(PROMPTS, ids):
        plain = target_with_smollm_vocab.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False,
                                                  pad_token_id=tokenizer.pad_token_id)[0, len(prompt_ids) :].tolist()
        assert batched_records[prompt.id]["response_ids"] == plain[: len(batched_records[prompt.id]["response_ids"])]


def test_a_growing_cache_layer_holds_what_concatenation_holds():
    """The batched answers' cache layer (a buffer grown by doubling) against transformers' DynamicLayer: a prefill,
    single steps across two growths, a crop and a reorder (replaced tensors are adopted), step by step."""
    from transformers.cache_utils import DynamicLayer

    from hf_retrace.training.data.responses import GrowingLayer

    ours, reference = GrowingLayer(), DynamicLayer()
    generator = torch.Generator().manual_seed(0)

    def step(length: int) -> None:
        k, v = torch.randn(2, 3, length, 4, generator=generator), torch.randn(2, 3, length, 4, generator=generator)
        got, want = ours.update(k, v), reference.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and ours.get_seq_length() == reference.get_seq_length()

    step(5)
    for _ in range(600):  # past 256 and 512 positions: two growths
        step(1)
    ours.crop(-7), reference.crop(-7)
    step(3)
    order = torch.tensor([1, 0])
    ours.keys, ours.values = ours.keys[order], ours.values[order]
    reference.keys, reference.values = reference.keys[order], reference.values[order]
    step(1)
    step(2)


class _CrashingTarget:
    """Delegates to a model; its ``generate`` raises after ``crash_after`` calls (a simulated kill)."""

    def __init__(self, model, crash_after: int | None = None) -> None:
        self.model, self.crash_after, self.batch_sizes = model, crash_after, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def generate(self, **kwargs):
        if self.crash_after is not None and len(self.batch_sizes) >= self.crash_after:
            raise KeyboardInterrupt("simulated kill")
        self.batch_sizes.append(kwargs["input_ids"].shape[0])
        return self.model.generate(**kwargs)


def test_generation_resumes_after_a_limited_run(tmp_path, tokenizer, target_with_smollm_vocab):
    kwargs = dict(batch_size=2, max_new_tokens=8, shard_size=3)
    generate_responses(target_with_smollm_vocab, tokenizer, PROMPTS, tmp_path / "reference", **kwargs)

    first = generate_responses(target_with_smollm_vocab, tokenizer, PROMPTS[:3], tmp_path / "resumed", **kwargs)
    spy = _CrashingTarget(target_with_smollm_vocab)
    second = generate_responses(spy, tokenizer, PROMPTS, tmp_path / "resumed", **kwargs)
    assert (first.num_generated, second.num_already_done, second.num_generated) == (3, 3, len(PROMPTS) - 3)
    assert sum(spy.batch_sizes) == len(PROMPTS) - 3  # only the remaining ids were sent to the target
    assert _records_by_id(tmp_path / "resumed") == _records_by_id(tmp_path / "reference")
    assert not list((tmp_path / "resumed").glob("*.partial"))


def test_generation_resumes_after_a_kill_and_a_torn_line(tmp_path, tokenizer, target_with_smollm_vocab):
    kwargs = dict(batch_size=2, max_new_tokens=8, shard_size=100)
    generate_responses(target_with_smollm_vocab, tokenizer, PROMPTS, tmp_path / "reference", **kwargs)

    with pytest.raises(KeyboardInterrupt):
        generate_responses(_CrashingTarget(target_with_smollm_vocab, crash_after=2), tokenizer, PROMPTS, tmp_path / "run", **kwargs)
    [partial] = list((tmp_path / "run").glob("*.partial"))
    assert response_shards(tmp_path / "run") == []  # nothing is promoted before it is complete
    with partial.open("a", encoding="utf-8") as handle:
        handle.write('{"id": "torn", "prompt": "half a li')  # a kill in the middle of a write

    spy = _CrashingTarget(target_with_smollm_vocab)
    summary = generate_responses(spy, tokenizer, PROMPTS, tmp_path / "run", **kwargs)
    assert summary.num_already_done == 4 and sum(spy.batch_sizes) == len(PROMPTS) - 4
    assert _records_by_id(tmp_path / "run") == _records_by_id(tmp_path / "reference")
    assert [path.name for path in response_shards(tmp_path / "run")] == ["responses-00000.jsonl"]


def test_response_records_have_the_documented_fields(tmp_path, tokenizer, target_with_smollm_vocab):
    eos = tokenizer.eos_token_id
    with torch.no_grad():  # make the end of turn the only likely token, so the "eos" path is taken
        target_with_smollm_vocab.lm_head.weight.data[eos] += 50.0 * target_with_smollm_vocab.lm_head.weight.data[eos].sign()
    try:
        generate_responses(target_with_smollm_vocab, tokenizer, PROMPTS[:2], tmp_path, max_new_tokens=4)
    finally:
        with torch.no_grad():
            target_with_smollm_vocab.lm_head.weight.data[eos] -= 50.0 * target_with_smollm_vocab.lm_head.weight.data[eos].sign()
    for record in read_responses([tmp_path]):
        assert set(record) == {"id", "prompt", "response", "finish", "response_tokens", "response_ids"}
        assert record["finish"] in ("eos", "length")
        assert record["response_tokens"] == len(record["response_ids"])
    assert "eos" in {record["finish"] for record in read_responses([tmp_path])}


def test_too_long_prompts_are_skipped(tmp_path, tokenizer, target_with_smollm_vocab):
    summary = generate_responses(target_with_smollm_vocab, tokenizer, PROMPTS, tmp_path, max_new_tokens=2, max_prompt_tokens=40)
    lengths = [len(ids) for ids in prompt_token_ids(tokenizer, [p.prompt for p in PROMPTS])]
    assert summary.num_too_long == sum(length > 40 for length in lengths) > 0
    assert len(_records_by_id(tmp_path)) == len(PROMPTS) - summary.num_too_long


# --- tokenization -------------------------------------------------------------------------------------------------


RESPONSES = [
    {"id": "a", "prompt": "What is 2 + 2?", "response": "2 + 2 = 4.", "finish": "eos", "response_tokens": 7},
    {"id": "b", "prompt": "Count to three.", "response": "One, two, three, four, five", "finish": "length"},
    {"id": "c", "prompt": "Say nothing.", "response": "", "finish": "eos"},
    {"id": "d", "prompt": "Say nothing.", "response": "", "finish": "length"},  # no loss token: skipped
]


def test_loss_mask_marks_exactly_the_response_tokens(tokenizer):
    eot = end_of_turn_token_id(tokenizer)
    assert tokenizer.convert_ids_to_tokens(eot) == "<|im_end|>"
    for record in RESPONSES[:2]:
        input_ids, loss_mask = build_sequence(
            tokenizer, record["prompt"], record["response"], record["finish"], max_length=512
        )
        prompt_ids = prompt_token_ids(tokenizer, [record["prompt"]])[0]
        response_ids = tokenizer(record["response"], add_special_tokens=False)["input_ids"]
        response_ids += [eot] if record["finish"] == "eos" else []
        assert input_ids == prompt_ids + response_ids
        assert loss_mask == [0] * len(prompt_ids) + [1] * len(response_ids)
        response_part = [token for token, mask in zip(input_ids, loss_mask) if mask]
        assert tokenizer.decode(response_part, skip_special_tokens=True) == record["response"]
    assert build_sequence(tokenizer, "x", "", "length", max_length=512) is None
    cut = len(prompt_token_ids(tokenizer, ["What is 2 + 2?"])[0]) + 2
    input_ids, loss_mask = build_sequence(tokenizer, "What is 2 + 2?", "2 + 2 = 4.", "eos", max_length=cut)
    assert len(input_ids) == len(loss_mask) == cut and loss_mask[-2:] == [1, 1] and loss_mask[-3] == 0
    assert build_sequence(tokenizer, "What is 2 + 2?", "2 + 2 = 4.", "eos", max_length=cut - 2) is None


def test_concatenation_equals_the_full_rendered_chat(tokenizer):
    for record in RESPONSES[:3]:
        assert split_matches_full_render(tokenizer, record["prompt"], record["response"])


def test_manifest_counts_and_dataset(tmp_path, tokenizer):
    source = _write_jsonl(tmp_path / "responses.jsonl", RESPONSES)
    manifest = tokenize_responses(tokenizer, [source], tmp_path / "tok", max_length=512, shard_size=2)
    expected = [build_sequence(tokenizer, r["prompt"], r["response"], r["finish"], max_length=512)
                for r in RESPONSES]
    expected = [sequence for sequence in expected if sequence is not None]
    assert manifest["complete"] and len(manifest["shards"]) == 2
    assert manifest["num_sequences"] == len(expected) == 3 and manifest["num_skipped"] == 1
    assert manifest["num_tokens"] == sum(len(ids) for ids, _ in expected)
    assert manifest["num_response_tokens"] == sum(sum(mask) for _, mask in expected)
    assert manifest["max_length"] == 512 and manifest["sources"][0]["path"] == str(source.resolve())

    dataset = TokenizedDataset(tmp_path / "tok")
    assert len(dataset) == 3
    for index, (ids, mask) in enumerate(expected):
        item = dataset[index]
        assert item["input_ids"].dtype == torch.long and item["loss_mask"].dtype == torch.bool
        assert item["input_ids"].tolist() == ids and item["loss_mask"].tolist() == [bool(m) for m in mask]
    assert dataset[-1]["input_ids"].tolist() == expected[-1][0]
    assert np.array_equal(dataset.sequence_lengths(), [len(ids) for ids, _ in expected])
    assert isinstance(np.load(tmp_path / "tok" / "shard-00000.input_ids.npy", mmap_mode="r"), np.memmap)


def test_tokenization_is_resumable_and_checks_settings(tmp_path, tokenizer):
    source = _write_jsonl(tmp_path / "responses.jsonl", RESPONSES)
    out = tmp_path / "tok"
    full = tokenize_responses(tokenizer, [source], out, max_length=512, shard_size=2)
    # simulate a kill after the first shard: manifest not complete, second shard gone
    partial = dict(full, complete=False, shards=full["shards"][:1])
    (out / "manifest.json").write_text(json.dumps(partial))
    for path in out.glob("shard-00001.*"):
        path.unlink()
    first_shard_mtime = (out / "shard-00000.input_ids.npy").stat().st_mtime_ns
    assert tokenize_responses(tokenizer, [source], out, max_length=512, shard_size=2) == full
    assert (out / "shard-00000.input_ids.npy").stat().st_mtime_ns == first_shard_mtime  # not rewritten
    with pytest.raises(ValueError, match=r"other settings \(\['max_length'\] differ\)"):
        tokenize_responses(tokenizer, [source], out, max_length=256, shard_size=2)


MORE = [
    {"id": "e", "prompt": "Name a colour.", "response": "Blue.", "finish": "eos"},
    {"id": "f", "prompt": "Name a fruit.", "response": "An apple, or a pear", "finish": "length"},
    {"id": "g", "prompt": "Name a tree.", "response": "Oak.", "finish": "eos"},
]


def _sequences(dataset: TokenizedDataset) -> list[tuple[list[int], list[bool]]]:
    return [(dataset[i]["input_ids"].tolist(), dataset[i]["loss_mask"].tolist()) for i in range(len(dataset))]


def test_a_tokenized_folder_grows_by_new_sources_and_keeps_its_sequences(tmp_path, tokenizer):
    shipped = _write_jsonl(tmp_path / "shipped.jsonl", RESPONSES)
    shards = tmp_path / "responses"
    shards.mkdir()
    _write_jsonl(shards / "responses-00000.jsonl", MORE[:1])
    _write_jsonl(shards / "responses-00001.jsonl.partial", MORE[1:2])  # being written: not a source yet
    out = tmp_path / "tok"
    first = tokenize_responses(tokenizer, [shipped, shards], out, max_length=512, shard_size=2)
    assert first["num_sequences"] == 4 and first["parts"] == [0]
    before = _sequences(TokenizedDataset(out))
    stamps = {path.name: path.stat().st_mtime_ns for path in out.glob("shard-*")}

    (shards / "responses-00001.jsonl.partial").rename(shards / "responses-00001.jsonl")  # the run moved on
    _write_jsonl(shards / "responses-00002.jsonl", MORE[2:])
    grown = tokenize_responses(tokenizer, [shipped, shards], out, max_length=512, shard_size=2)
    assert grown["complete"] and grown["parts"] == [0, 2] and grown["num_sequences"] == 6
    assert [shard["part"] for shard in grown["shards"]] == [0, 0, 0, 1]
    after = _sequences(TokenizedDataset(out))
    assert after[:4] == before  # sequence i stays sequence i
    assert all(path.stat().st_mtime_ns == stamps[path.name] for path in out.glob("shard-*") if path.name in stamps)
    fresh = tmp_path / "fresh"
    tokenize_responses(tokenizer, [shipped, shards], fresh, max_length=512, shard_size=2)
    assert _sequences(TokenizedDataset(fresh)) == after  # the same sequences as one call over every source

    # killed while growing: the new part's shard is lost, the next call with the same sources makes it again
    partial = dict(grown, complete=False, shards=grown["shards"][:3])
    (out / "manifest.json").write_text(json.dumps(partial))
    (out / "shard-00003.input_ids.npy").unlink()
    assert tokenize_responses(tokenizer, [shipped, shards], out, max_length=512, shard_size=2) == grown

    # a second shard folder (another generation worker) whose shards sort before the first's new ones: its files
    # are appended after the folder's own, whatever the order given
    worker = tmp_path / "worker-1"
    worker.mkdir()
    _write_jsonl(worker / "responses-00000.jsonl", [dict(MORE[0], id="w")])
    both = tokenize_responses(tokenizer, [worker, shipped, shards], out, max_length=512, shard_size=2)
    assert both["parts"] == [0, 2, 4] and both["num_sequences"] == 7
    assert [Path(source["path"]).parent.name for source in both["sources"]][-1] == "worker-1"
    assert _sequences(TokenizedDataset(out))[:6] == after
    grown = both

    # a source that changed, or one left out, is refused before anything is written
    _write_jsonl(shards / "responses-00000.jsonl", MORE[:2])
    with pytest.raises(ValueError, match="not all among these, unchanged.*responses-00000.jsonl"):
        tokenize_responses(tokenizer, [shipped, shards], out, max_length=512, shard_size=2)
    with pytest.raises(ValueError, match="not all among these"):
        tokenize_responses(tokenizer, [shards], out, max_length=512, shard_size=2)
    assert json.loads((out / "manifest.json").read_text()) == grown


def test_excluded_ids_leave_out_the_prompt_and_its_later_turns(tmp_path, tokenizer):
    second_turn = {"id": "b-turn2", "prompt": "And to four?", "response": "One, two, three, four.", "finish": "eos",
                   "history": ["Count to three.", "One, two, three, four, five"]}
    source = _write_jsonl(tmp_path / "r.jsonl", RESPONSES + [second_turn] + MORE)
    manifest = tokenize_responses(tokenizer, [source], tmp_path / "tok", max_length=512, exclude_ids={"b", "e"})
    ids = json.loads((tmp_path / "tok" / "shard-00000.ids.json").read_text())
    assert ids == ["a", "c", "f", "g"] and manifest["num_excluded"] == 3 and manifest["num_skipped"] == 1
    assert manifest["exclude_ids"] == ["b", "e"]
    with pytest.raises(ValueError, match=r"other settings \(\['exclude_ids'\] differ\)"):
        tokenize_responses(tokenizer, [source], tmp_path / "tok", max_length=512)
    with pytest.raises(ValueError, match=r"other settings \(\['exclude_ids'\] differ\)"):
        tokenize_responses(tokenizer, [source], tmp_path / "tok", max_length=512, exclude_ids={"b"})


def test_generated_token_ids_are_used_when_present(tmp_path, tokenizer):
    exact = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    non_canonical = tokenizer.convert_tokens_to_ids(list("Hello"))  # one token per letter, as a model might emit
    record = {"id": "x", "prompt": "Hi", "response": "Hello", "finish": "length", "response_ids": non_canonical}
    tokenize_responses(tokenizer, [_write_jsonl(tmp_path / "r.jsonl", [record])], tmp_path / "tok", max_length=64)
    item = TokenizedDataset(tmp_path / "tok")[0]
    assert item["input_ids"][item["loss_mask"]].tolist() == non_canonical != exact[:1]
