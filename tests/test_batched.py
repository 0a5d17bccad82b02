"""Batch > 1 with a drafter (issue 39): every row equals plain batched ``generate`` on the same left-padded batch,
token for token (fp32; randomized cases with ragged acceptance, EOS inside blocks, rows ending at different steps, the
cache compacted every round; test_kwargs_fuzz's settings at 1-4 rows), each row's rounds are the ones it gets alone,
under sampling each row follows the target's law (chi-square per row), a finished row leaves the batch, what is not
per-row yet is refused before the target runs, and ``hf-retrace bench --batch-size N`` reports against plain batched
``generate``. See docs/design/batching.md."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import ProposalPolicy, StopAtToken, byte_level_tokenizer, scripted_source, tiny_drafter, tiny_target
from transformers import StoppingCriteriaList

from hf_retrace.generation import batched, batched_cache
from hf_retrace.generation.drafter_source import DrafterSource

VOCAB = 96
PAD = VOCAB - 2
_targets: dict = {}


def _target(family: str, seed: int, dtype: torch.dtype = torch.float32):
    key = (family, seed, dtype)
    if key not in _targets:
        _targets[key] = tiny_target(family=family, seed=seed, logit_scale=4.0, dtype=dtype)
    return _targets[key]


def padded_batch(lengths: list[int], seed: int, vocab: int = VOCAB) -> dict:
    """A left-padded batch of random prompts of ``lengths`` tokens (row ``b`` starts with token ``b``, so no row's
    prompt is a prefix of another's)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), PAD if vocab == VOCAB else 0, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, length in enumerate(lengths):
        prompt = torch.randint(len(lengths), vocab - 3, (length,), generator=generator)
        prompt[0] = b
        input_ids[b, width - length :], attention_mask[b, width - length :] = prompt, 1
    return dict(input_ids=input_ids, attention_mask=attention_mask)


class RowProposals:
    """:class:`ProposalPolicy` per row: each row's drafts come from its own plain answer (its unpadded prompt and the
    tokens plain batched decoding gave it), corrupted as ``mode`` says."""

    def __init__(self, batch: dict, reference: torch.Tensor, mode: str, seed: int):
        self.rows = []
        for b in range(reference.shape[0]):
            row = reference[b, int((batch["attention_mask"][b] == 0).sum()) :]
            self.rows.append((row, ProposalPolicy(row[None], mode, VOCAB, seed=seed + b)))

    def __call__(self, input_ids: torch.Tensor, num_drafts: int) -> torch.Tensor:
        length = input_ids.shape[1]
        for row, proposals in self.rows:
            if length <= row.shape[0] and torch.equal(row[:length], input_ids[0]):
                return proposals(input_ids, num_drafts)
        raise AssertionError("a row proposed from a sequence that is no row's plain answer: it left its own path")


NUM_CASES = 80


def _case(index: int) -> dict:
    rng = random.Random(1000 + index)
    block_size = rng.choice([2, 3, 4, 6, 8])
    rows = rng.randint(2, 4)
    return dict(
        family=rng.choice(["qwen3", "llama"]),
        target_seed=rng.randrange(3),
        lengths=[rng.randint(1, 16) for _ in range(rows)],
        block_size=block_size,
        max_new_tokens=rng.choice([1, 2, block_size - 1, block_size + 1, 2 * block_size, rng.randint(3, 36)]),
        policy=rng.choice(["drafter", "all", "all", "none", "partial", "partial"]),
        retrace=rng.choice([None, "untrained", "random"]),
        eos_inside=rng.random() < 0.4,
        confidence_threshold=rng.choice([None, None, 0.2, 0.6]),
        lookup=rng.random() < 0.25,
        compact_every_round=rng.random() < 0.3,
        seed=index,
    )


@pytest.mark.parametrize("index", range(NUM_CASES))
def test_every_row_equals_plain_batched_greedy(index, monkeypatch):
    case = _case(index)
    target = _target(case["family"], case["target_seed"])
    batch = padded_batch(case["lengths"], case["seed"])
    kwargs = dict(max_new_tokens=max(1, case["max_new_tokens"]), do_sample=False, pad_token_id=PAD)
    reference = target.generate(**batch, **kwargs)
    new = reference[:, batch["input_ids"].shape[1] :]
    if case["eos_inside"] and new.shape[1] > 2:
        kwargs["eos_token_id"] = int(new[0, new.shape[1] // 2])  # row 0 stops mid-answer, others where they meet it
        reference = target.generate(**batch, **kwargs)
    drafter = tiny_drafter(target, block_size=case["block_size"], retrace=case["retrace"], seed=case["seed"])
    drafter = drafter.with_policy(confidence_cut=case["confidence_threshold"], lookup=case["lookup"])
    if case["policy"] != "drafter":
        drafter = drafter.with_drafter_source(
            scripted_source(RowProposals(batch, reference, case["policy"], case["seed"])))
    if case["compact_every_round"]:  # the cache's compaction runs after every round with a masked slot
        monkeypatch.setattr(batched_cache, "COMPACT_WHEN_MASKED_OVER", 0.0)
    out = target.generate(**batch, assistant_model=drafter, **kwargs)
    assert out.tolist() == reference.tolist(), f"case {case}"
    stats = drafter.last_stats
    if case["policy"] == "none" and not case["lookup"]:
        assert all(length == 1 for length in stats.acceptance_lengths)
    plain_rounds = not case["lookup"] and case["confidence_threshold"] is None
    if plain_rounds and case["policy"] == "all" and kwargs["max_new_tokens"] > case["block_size"] + 1:
        assert case["block_size"] in stats.acceptance_lengths, "a fully right block must be fully accepted"


def test_cases_cover_ragged_rows():
    """The cases include every policy, EOS inside blocks, 2-4 rows, and the compaction after every round."""
    cases = [_case(i) for i in range(NUM_CASES)]
    assert {c["policy"] for c in cases} == {"drafter", "all", "none", "partial"}
    assert {len(c["lengths"]) for c in cases} == {2, 3, 4}
    assert sum(c["eos_inside"] for c in cases) >= 20
    assert sum(c["compact_every_round"] for c in cases) >= 15
    assert sum(len(set(c["lengths"])) > 1 for c in cases) >= 60  # prompts of different lengths


@pytest.mark.parametrize("seed", range(6))
def test_rows_ending_at_different_steps_equal_plain(seed):
    """An EOS that ends rows at different steps (inside accepted blocks: the drafts are the plain answers)."""
    target = _target("llama", seed % 3)
    batch = padded_batch([3, 9, 5, 12], seed)
    kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    free = target.generate(**batch, **kwargs)[:, 12:]
    counts = torch.bincount(free[:, 3:].reshape(-1), minlength=VOCAB)
    kwargs["eos_token_id"] = int(counts.argmax())  # a token several rows emit, at different steps
    reference = target.generate(**batch, **kwargs)
    ends = (reference[:, 12:] == PAD).sum(-1)
    assert len(set(ends.tolist())) > 1, "the rows must end at different steps"
    drafter = tiny_drafter(target, block_size=6).with_drafter_source(
        scripted_source(RowProposals(batch, reference, "all", seed)))
    assert target.generate(**batch, assistant_model=drafter, **kwargs).tolist() == reference.tolist()


def test_a_finished_row_stops_drafting_and_leaves_the_verify_batch(count_forwards):
    target = _target("qwen3", 1)
    batch = padded_batch([4, 6, 8], seed=3)
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    free = target.generate(**batch, **kwargs)[:, 8:]
    kwargs["eos_token_id"] = int(free[1, 4])  # row 1 ends at its 5th new token (or earlier)
    reference = target.generate(**batch, **kwargs)
    stop = int((reference[1, 8:] == kwargs["eos_token_id"]).nonzero()[0, 0]) + 1
    assert stop < 24 and (reference[[0, 2], 8 + stop :] != PAD).any(), "other rows must go on after row 1 stops"
    anchors: dict[int, list[int]] = {}

    class Recorded(DrafterSource):
        def propose(self, inputs):
            anchors.setdefault(inputs.sequence[0, 0].item(), []).append(inputs.anchor)  # row b's prompt starts with b
            return super().propose(inputs)

    rows_verified = []
    handle = target.register_forward_pre_hook(
        lambda module, args, kw: rows_verified.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        drafter = tiny_drafter(target, block_size=4).with_policy(confidence_cut=None).with_drafter_source(Recorded)
        out = target.generate(**batch, assistant_model=drafter, **kwargs)
    finally:
        handle.remove()
    assert out.tolist() == reference.tolist()
    # row 1 (6 prompt tokens) drafts only from anchors before its last token; the others draft on
    assert max(anchors[1]) < 6 + stop - 1
    assert max(anchors[0]) > 4 + stop and max(anchors[2]) > 8 + stop
    # the prefill and rounds hold all 3 rows, then row 1 leaves for good (the others end at their own steps)
    assert rows_verified[0] == 3 and 2 in rows_verified, rows_verified
    assert rows_verified == sorted(rows_verified, reverse=True), rows_verified


@pytest.mark.parametrize("processors", [
    dict(repetition_penalty=1.5),
    dict(no_repeat_ngram_size=2),
    dict(bad_words_ids=[[5], [7, 8]], suppress_tokens=[9, 10]),
    dict(min_new_tokens=12, eos_token_id=3, sequence_bias={(4,): -5.0}),
])
@pytest.mark.parametrize("mode", ["all", "partial"])
def test_logits_processors_apply_per_row_as_plain(processors, mode):
    target = _target("llama", 0)
    batch = padded_batch([2, 7, 11], seed=5)
    kwargs = dict(max_new_tokens=28, do_sample=False, pad_token_id=PAD, **processors)
    reference = target.generate(**batch, **kwargs)
    drafter = tiny_drafter(target, block_size=5).with_drafter_source(
        scripted_source(RowProposals(batch, reference, mode, seed=2)))
    assert target.generate(**batch, assistant_model=drafter, **kwargs).tolist() == reference.tolist()


@pytest.mark.parametrize("with_eos", [True, False])
def test_stopping_criteria_stop_each_row_where_plain_does(with_eos):
    """A custom criterion per row; without an EOS criterion plain keeps decoding a stopped row until every row stopped
    (it pads only when an EOS criterion exists), and so does the batch loop."""
    target = _target("qwen3", 2)
    batch = padded_batch([5, 3, 8], seed=7)
    free = target.generate(**batch, max_new_tokens=30, do_sample=False, pad_token_id=PAD)[:, 8:]
    kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    if with_eos:
        kwargs["eos_token_id"] = int(free[2, 20])
    criteria = StoppingCriteriaList([StopAtToken(int(free[0, 6])), StopAtToken(int(free[1, 10])),
                                     StopAtToken(int(free[2, 15]))])  # each row meets one at its own step
    reference = target.generate(**batch, stopping_criteria=criteria, **kwargs)
    assert reference.shape[1] < 8 + 30, "the criterion must end the call early"
    drafter = tiny_drafter(target, block_size=6).with_drafter_source(
        scripted_source(RowProposals(batch, reference, "all", seed=1)))
    out = target.generate(**batch, assistant_model=drafter, stopping_criteria=criteria, **kwargs)
    assert out.tolist() == reference.tolist()


def test_stop_strings_stop_each_row_where_plain_does():
    target = _target("llama", 1)
    tokenizer = byte_level_tokenizer()
    batch = padded_batch([6, 4], seed=11)
    free = target.generate(**batch, max_new_tokens=30, do_sample=False, pad_token_id=PAD)[:, 6:]
    stop = tokenizer.decode(free[1, 8:10])
    kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=PAD, eos_token_id=PAD, stop_strings=[stop],
                  tokenizer=tokenizer)
    reference = target.generate(**batch, **kwargs)
    assert (reference[1] == PAD).sum() > (batch["input_ids"][1] == PAD).sum(), "row 1 must stop at the string"
    drafter = tiny_drafter(target, block_size=6).with_drafter_source(
        scripted_source(RowProposals(batch, reference, "partial", seed=3)))
    assert target.generate(**batch, assistant_model=drafter, **kwargs).tolist() == reference.tolist()


def test_an_unpadded_batch_and_return_dict_give_plains_sequences():
    target = _target("qwen3", 0)
    input_ids = padded_batch([6, 6, 6], seed=2)["input_ids"]
    kwargs = dict(max_new_tokens=17, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True)
    reference = target.generate(input_ids, **kwargs)
    out = target.generate(input_ids, assistant_model=tiny_drafter(target, block_size=4), **kwargs)
    assert out.sequences.tolist() == reference.sequences.tolist()


def test_float64_rows_equal_plain_with_the_drafters_own_blocks():
    target = _target("llama", 2, torch.float64)
    batch = padded_batch([1, 13, 6, 9], seed=4)
    kwargs = dict(max_new_tokens=40, do_sample=False, pad_token_id=PAD)
    drafter = tiny_drafter(target, block_size=8, retrace="random")
    assert target.generate(**batch, assistant_model=drafter, **kwargs).tolist() == \
        target.generate(**batch, **kwargs).tolist()


def test_batch_of_one_keeps_the_batch_one_path(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a batch of one must not enter the batch loop")

    monkeypatch.setattr(batched, "batched_assisted_decoding", refuse)
    target = _target("qwen3", 0)
    prompt = padded_batch([5], seed=1)["input_ids"]
    out = target.generate(prompt, assistant_model=tiny_drafter(target), max_new_tokens=9, do_sample=False)
    assert out.tolist() == target.generate(prompt, max_new_tokens=9, do_sample=False).tolist()


class _Streamer:
    def put(self, value):
        pass

    def end(self):
        pass


@pytest.mark.parametrize("change,words", [
    (dict(streamer=_Streamer()), "streamer"),
    (dict(return_dict_in_generate=True, output_scores=True), "output_scores"),
    (dict(return_dict_in_generate=True, output_attentions=True), "output_attentions"),
    (dict(attention_mask=torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])), "padding_side='left'"),
    (dict(attention_mask=torch.tensor([[0, 0, 0, 0], [0, 1, 1, 1]])), "all padding"),
    (dict(input_ids=torch.tensor([[1, 2, 3, 4], [5, 6, 7, VOCAB + 3]])), "Row 1"),
])
def test_what_is_not_per_row_is_refused_before_the_target_runs(change, words, count_forwards):
    target = _target("qwen3", 0)
    inputs = dict(input_ids=torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]),
                  attention_mask=torch.ones(2, 4, dtype=torch.long))
    inputs.update(change)
    forwards = count_forwards(target)
    with pytest.raises(ValueError, match=words) as error:
        target.generate(**inputs, assistant_model=tiny_drafter(target), max_new_tokens=5, pad_token_id=PAD)
    assert forwards["n"] == 0
    assert any(fix in str(error.value).lower() for fix in ("drop", "pass", "give", "tokenize")), "it says what to do"


# --- sampling: each row's law is the target's ---------------------------------------------------------------------
SAMPLING_VOCAB = 12
MAX_NEW = 4
N_ASSISTED = 400  # batched calls per arm (two rows each)
N_PLAIN = 8000


@pytest.mark.slow
@pytest.mark.parametrize("mode,sampling", [
    ("argmax", dict(temperature=1.0, top_k=0, top_p=1.0)),
    ("sample", dict(temperature=0.7, top_k=6, top_p=0.9, repetition_penalty=1.3)),
])
def test_each_rows_sampling_follows_the_target_law(mode, sampling):
    from test_sampling_law import homogeneity_p  # the one chi-square homogeneity test of the suite

    target = tiny_target(vocab_size=SAMPLING_VOCAB, num_layers=2, hidden_size=32, seed=0, logit_scale=20.0)
    batch = padded_batch([5, 2], seed=0, vocab=SAMPLING_VOCAB)
    kwargs = dict(do_sample=True, max_new_tokens=MAX_NEW, pad_token_id=0, **sampling)
    torch.manual_seed(0)
    plain = target.generate(**{k: v.repeat(N_PLAIN, 1) for k, v in batch.items()}, **kwargs)[:, 5:]
    plain = plain.view(N_PLAIN, 2, MAX_NEW).numpy()
    drafter = tiny_drafter(target, block_size=4, seed=5 if mode == "sample" else 1, retrace="random")
    drafter.proposal_mode = mode
    assisted, accepted = np.empty((N_ASSISTED, 2, MAX_NEW), dtype=np.int64), 0
    torch.manual_seed(1)
    for i in range(N_ASSISTED):
        assisted[i] = target.generate(**batch, assistant_model=drafter, **kwargs)[:, 5:].numpy()
        accepted += sum(length - 1 for length in drafter.last_stats.acceptance_lengths)
    assert accepted > 0.1 * N_ASSISTED, "drafts must really be accepted (the acceptance rule exercised)"
    for row in range(2):
        for slot in range(1, MAX_NEW):
            p = homogeneity_p(assisted[:, row, slot], plain[:, row, slot])
            assert p > 1e-3, (row, slot, p)
        pair = homogeneity_p(assisted[:, row, 1] * SAMPLING_VOCAB + assisted[:, row, 2],
                             plain[:, row, 1] * SAMPLING_VOCAB + plain[:, row, 2])
        assert pair > 1e-3, (row, pair)


def test_the_sampling_battery_rejects_a_wrong_row_law():
    """Power: the per-row battery tells row 0's law from row 1's (different prompts) on the same sample sizes."""
    from test_sampling_law import homogeneity_p

    target = tiny_target(vocab_size=SAMPLING_VOCAB, num_layers=2, hidden_size=32, seed=0, logit_scale=20.0)
    batch = padded_batch([5, 2], seed=0, vocab=SAMPLING_VOCAB)
    torch.manual_seed(0)
    out = target.generate(**{k: v.repeat(N_ASSISTED, 1) for k, v in batch.items()}, do_sample=True,
                          max_new_tokens=2, pad_token_id=0)[:, 5:].view(N_ASSISTED, 2, 2).numpy()
    assert homogeneity_p(out[:, 0, 1], out[:, 1, 1]) < 1e-3


# --- the fuzzer over generate's settings, at batch sizes 1-4 ---------------------------------------------------------
NUM_FUZZ_CASES = 160
# settings that cannot be per-row yet: the batch loop refuses them (in words, before the target runs)
REFUSED_AT_BATCH = {"output_scores": "output_scores", "output_logits": "output_scores",
                    "output_attentions": "output_attentions"}


@pytest.mark.parametrize("index", range(NUM_FUZZ_CASES))
def test_fuzzed_settings_per_row_equal_plain_batched(index, count_forwards):
    """test_kwargs_fuzz's drawn settings (processors, warpers under top_k=1, EOS ids, stop strings and criteria, the
    static cache) on a left-padded batch of 1-4 rows: each row equals plain batched generate, or the call is refused
    before the target runs."""
    from test_kwargs_fuzz import _case as fuzz_case
    from test_kwargs_fuzz import _drafter as fuzz_drafter
    from test_kwargs_fuzz import _prompt as fuzz_prompt
    from test_kwargs_fuzz import _settings as fuzz_settings
    from test_kwargs_fuzz import _target as fuzz_target

    case = fuzz_case(index)
    rng = random.Random(f"batched-{index}")
    target = fuzz_target(case["family"], case["target_seed"])
    prompt = fuzz_prompt(case)[0]
    others = [torch.randint(0, VOCAB - 1, (rng.randint(1, 14),), generator=torch.Generator().manual_seed(index + b))
              for b in range(rng.randint(0, 3))]
    rows = [prompt, *others]
    width = max(row.shape[0] for row in rows)
    base = target.generate(prompt[None], do_sample=False, max_new_tokens=case["new_tokens"])[0, prompt.shape[0] :]
    drafter = fuzz_drafter(case, target)
    draft_vocab = None if drafter.draft_vocab is None else drafter.draft_vocab.tolist()
    kwargs = fuzz_settings(case, prompt[None], base.tolist(), draft_vocab)
    if "max_length" in kwargs:  # the prompt's own length is the padded width here
        kwargs["max_length"] += width - prompt.shape[0]
    kwargs.setdefault("pad_token_id", PAD)
    pad = kwargs["pad_token_id"]
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, row in enumerate(rows):
        input_ids[b, width - row.shape[0] :], attention_mask[b, width - row.shape[0] :] = row, 1
    batch = dict(input_ids=input_ids, attention_mask=attention_mask)
    refused = [words for name, words in REFUSED_AT_BATCH.items() if kwargs.get(name)]
    if refused and len(rows) > 1:
        forwards = count_forwards(target)
        with pytest.raises(ValueError, match=refused[0]):
            target.generate(**batch, assistant_model=drafter, **kwargs)
        assert forwards["n"] == 0
        return
    try:
        reference = target.generate(**batch, **kwargs)
    except Exception as error:  # noqa: BLE001 - plain generate's own failure (e.g. 4.57's NaN exponential decay)
        with pytest.raises(Exception):  # noqa: B017 - it must fail with the drafter too, never return something
            target.generate(**batch, assistant_model=drafter, **kwargs)
        pytest.skip(f"plain generate fails on this combination ({type(error).__name__}: {error}); so does ours")
    sequences = reference if isinstance(reference, torch.Tensor) else reference.sequences
    if case["policy"] != "drafter":
        drafter = drafter.with_drafter_source(scripted_source(RowProposals(batch, sequences, case["policy"], index)))
    out = target.generate(**batch, assistant_model=drafter, **kwargs)
    out = out if isinstance(out, torch.Tensor) else out.sequences
    assert out.tolist() == sequences.tolist(), f"case {case}\nrows {len(rows)} kwargs {sorted(kwargs)}"


def test_a_policy_that_does_not_speculate_decodes_the_batch_plainly(count_forwards):
    target = _target("llama", 0)
    batch = padded_batch([3, 8, 5], seed=6)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    drafter = tiny_drafter(target).with_policy(speculate=False, reason="a test's choice")
    drafter_forwards = count_forwards(drafter)
    out = target.generate(**batch, assistant_model=drafter, **kwargs)
    assert out.tolist() == target.generate(**batch, **kwargs).tolist()
    assert drafter_forwards["n"] == 0
    assert "plain decoding" in drafter.last_stats.policy


def test_the_stats_pool_every_rows_rounds():
    """last_stats: every row's committed tokens and rounds, τ pooled over all of them."""
    target = _target("qwen3", 2)
    batch = padded_batch([4, 9], seed=8)
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    reference = target.generate(**batch, **kwargs)
    drafter = tiny_drafter(target, block_size=4).with_policy(confidence_cut=None).with_drafter_source(
        scripted_source(RowProposals(batch, reference, "all", seed=0)))
    target.generate(**batch, assistant_model=drafter, **kwargs)
    stats = drafter.last_stats
    assert stats.new_tokens == 2 * 20
    # all drafts right: each row's first token from the prefill, then full blocks of 4 until the room runs out
    assert sorted(stats.acceptance_lengths) == [3] * 2 + [4] * 8


def test_the_cache_is_compacted_at_the_default_threshold_and_rows_stay_exact(monkeypatch):
    """Blocks of 8 that are all rejected leave most verified slots masked: compactions run, rows stay exact, and
    the cache never holds many more masked slots than a compaction leaves."""
    target = _target("qwen3", 0)
    batch = padded_batch([2, 10, 6], seed=9)
    kwargs = dict(max_new_tokens=40, do_sample=False, pad_token_id=PAD)
    reference = target.generate(**batch, **kwargs)
    widths, compactions = [], []
    original = batched_cache.compact

    def recorded(cache, mask):
        compactions.append(mask.shape[1])
        new_mask = original(cache, mask)
        widths.append((new_mask.shape[1], int(new_mask.sum(-1).max())))
        return new_mask

    monkeypatch.setattr(batched_cache, "compact", recorded)
    drafter = tiny_drafter(target, block_size=8).with_policy(confidence_cut=None).with_drafter_source(
        scripted_source(RowProposals(batch, reference, "none", seed=4)))
    assert target.generate(**batch, assistant_model=drafter, **kwargs).tolist() == reference.tolist()
    assert compactions, "no compaction ran"
    assert all(width == longest for width, longest in widths), "a compaction leaves no column beyond the longest row"


def test_compaction_gain_counts_the_removable_columns():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 1, 1]])
    assert batched_cache.compaction_gain(mask) == 2 * (6 - 4)


# --- hf-retrace bench --batch-size ---------------------------------------------------------------------------------
def test_bench_batch_size_reports_throughput_against_plain_batched(tmp_path, capsys):
    import json

    from helpers import word_level_tokenizer

    from hf_retrace import cli

    target = tiny_target(family="llama", vocab_size=VOCAB, dtype=torch.float32, logit_scale=4.0)
    target.save_pretrained(tmp_path / "target")
    word_level_tokenizer(VOCAB).save_pretrained(tmp_path / "target")
    tiny_drafter(target, block_size=4).save_pretrained(tmp_path / "drafter")
    out = tmp_path / "out.json"
    argv = ["bench", "--batch-size", "2", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
            "--dataset", "gsm8k", "--methods", "plain,prompt-lookup,dflash", "--temperature", "0", "--temperature",
            "1", "--max-new-tokens", "8", "--limit", "3", "--dtype", "fp32", "--json", str(out), "--no-progress",
            "--repeats", "2"]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["repeats"] == 2 and "timed 2 times" in report["settings"]["timing"]
    rows = {(row["method"], row["temperature"]): row for row in report["rows"]}
    assert set(rows) == {(m, t) for m in ("plain", "dflash") for t in ("T=0", "T=1")}  # prompt lookup: skipped
    assert report["settings"]["skipped_methods"] == ["prompt-lookup"]
    for (method, temperature), row in rows.items():
        assert row["rows"] == 3 and row["batches"] == 2 and row["batch_size"] == 2  # batches of 2 and 1
        assert row["tokens_per_second"] > 0 and row["speedup"] > 0
        assert (row["tau"] is None) == (method == "plain")
    assert rows[("dflash", "T=0")]["rows_differing_from_plain"] == 0, "fp32 rows must equal plain batched generate"
    assert rows[("dflash", "T=0")]["near_ties"] == 0 and rows[("plain", "T=0")]["policy"] is None
    assert "DFlash drafter" in rows[("dflash", "T=0")]["policy"]  # the policy the batch ran, tuned per batch size
    out = capsys.readouterr().out
    assert "| gsm8k | T=0 | dflash | 3 |" in out and "Round policies (each batch size is tuned apart)" in out


def test_bench_batch_size_refuses_bad_values_before_any_model_loads(capsys):
    from hf_retrace import cli

    for argv, words in ((["bench", "--batch-size", "0"], "batch size of 1 or more"),
                        (["bench", "--batch-size", "4", "--plots", "p"], "drop it with --batch-size"),
                        (["bench", "--batch-size", "4", "--repeats", "0"], "1 or more timings per request"),
                        (["bench", "--repeats", "0"], "1 or more timings per request")):
        with pytest.raises(SystemExit, match=words):
            cli.main(argv)


@pytest.mark.parametrize("policy", [dict(confidence_cut=None),
                                    dict(confidence_cut=0.05, lookup=True, lookup_min_ngram=1)])
def test_each_rows_rounds_are_the_rounds_it_gets_alone(policy):
    """Per-row rounds: a row drafts on its own unpadded tokens and positions, with its own drafter cache, lookup index
    and ReTrace carry, so its rounds (drafts and acceptances) are those of a batch-1 call on its prompt (float64)."""
    target = tiny_target(vocab_size=SAMPLING_VOCAB, num_layers=2, hidden_size=32, seed=0, logit_scale=20.0)
    batch = padded_batch([3, 11, 7], seed=12, vocab=SAMPLING_VOCAB)  # a small vocabulary: drafts get accepted
    drafter = tiny_drafter(target, block_size=6, retrace="random", seed=1).with_policy(**policy)
    kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
    target.generate(**batch, assistant_model=drafter, **kwargs)
    batched_rounds = drafter.last_stats.round_log
    alone = []
    for b in range(3):
        prompt = batch["input_ids"][b : b + 1, batch["attention_mask"][b].bool()]
        target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter, **kwargs)
        alone += drafter.last_stats.round_log
    assert batched_rounds == alone
    assert any(accepted > 0 for accepted, _, _ in alone), "some drafts must be accepted for the rounds to say much"


def test_one_drafter_forward_drafts_every_running_row(count_forwards):
    """The rows' blocks come from one shared drafter forward per round, not one per row."""
    target = _target("llama", 0)
    batch = padded_batch([4, 9, 2, 6], seed=13)
    drafter = tiny_drafter(target, block_size=4)
    target_forwards, drafter_forwards = count_forwards(target), count_forwards(drafter)
    out = target.generate(**batch, assistant_model=drafter, max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    verifies, drafts = target_forwards["n"] - 1, drafter_forwards["n"]  # the first target forward is the prefill
    assert out.tolist() == target.generate(**batch, max_new_tokens=16, do_sample=False, pad_token_id=PAD).tolist()
    # one per round (not one per row), but none in a last round where no row has room left to draft
    assert verifies - 1 <= drafts <= verifies and drafts > 0, (drafts, verifies)


def test_the_batched_report_classifies_differing_rows_and_names_each_policy():
    from hf_retrace.bench.batched_throughput import batched_markdown

    settings = {"batch_size": 4, "target": "t", "dtype": "bf16", "max_new_tokens": 8, "timing": "decode only"}
    row = dict(dataset="gsm8k", temperature="T=0", rows=4, tokens_per_second=10.0, tau=None, speedup=1.0,
               rows_differing_from_plain=0, near_ties=0, policy=None)
    drafted = dict(row, method="default", tau=2.5, speedup=1.4, rows_differing_from_plain=3, near_ties=2,
                   policy="DFlash drafter, confidence cut 0.3 (policy: tuned)")
    text = batched_markdown({"settings": settings, "rows": [dict(row, method="plain"), drafted]})
    assert "| gsm8k | T=0 | default | 4 | 10.0 | 1.40× | 2.50 | 3 (2 near-tie, 1 beyond 2 ulps) |" in text
    assert "- default, T=0: DFlash drafter, confidence cut 0.3 (policy: tuned)" in text
