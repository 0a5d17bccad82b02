"""ReTrace's bound (examples/kept_suffix_signal.py) and its learned probe (examples/retrace_probe.py), on constructed
blocks and tiny random models: each oracle raises τ by exactly what its candidates allow, and the probe learns what
the suffix carries."""

from __future__ import annotations

import importlib.util
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from helpers import tiny_drafter, tiny_target

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


signal = _example("kept_suffix_signal")
probe = _example("retrace_probe")


def test_tokens_per_round_counts_the_leading_right_drafts_plus_the_targets_token():
    assert signal.tokens_per_round([True, True, False, True]) == 3
    assert signal.tokens_per_round([False, True]) == 1
    assert signal.tokens_per_round([True] * 7) == 8


def test_a_right_kept_token_raises_the_oracle_by_exactly_the_slots_it_unblocks():
    right, truth = [True, False, True, True, False], [5, 6, 7, 8, 9]
    assert signal.tokens_per_round(right) == 2
    fixed = signal.oracle_right(right, truth, signal.shifted_candidates({1: {6}}, 0, 5))
    assert signal.tokens_per_round(fixed) == 5  # slot 1 fixed: slots 2 and 3 were right already, so +3
    wrong = signal.oracle_right(right, truth, signal.shifted_candidates({1: {4}}, 0, 5))
    assert signal.tokens_per_round(wrong) == 2


def test_one_shift_moves_the_whole_suffix_and_the_best_shift_per_block_wins():
    right, truth = [True, False, False, False], [1, 2, 3, 4]
    kept = {0: {2}, 1: {3}}  # the suffix lags the next block by one slot
    by_shift = {s: signal.tokens_per_round(signal.oracle_right(right, truth, signal.shifted_candidates(kept, s, 4)))
                for s in (-1, 0, 1)}
    assert by_shift == {-1: 2, 0: 2, 1: 4}
    shift, best = signal.best_shift(right, truth, kept)
    assert shift == 1 and signal.tokens_per_round(best) == 4
    assert signal.shifted_candidates({3: {9}}, 1, 4) == [set()] * 4  # moved off the block: dropped


def test_near_candidates_hold_every_kept_token_within_reach():
    near = signal.near_candidates({0: {1}, 3: {4}}, 5, reach=2)
    assert near == [{1}, {1, 4}, {1, 4}, {4}, {4}]


def test_negative_information_replaces_only_vetoed_drafts():
    right, drafts, second, truth = [True, False, False], [1, 2, 3], [7, 5, 8], [1, 5, 6]
    vetoed = {0: {1}, 1: {2}}
    # the rule takes the second choice at both vetoed slots: slot 0 was right and is lost
    assert signal.veto_right(right, drafts, second, truth, vetoed, oracle=False) == [False, True, False]
    # the oracle takes it only when right: slot 0 stays, slot 1 is fixed
    assert signal.veto_right(right, drafts, second, truth, vetoed, oracle=True) == [True, True, False]


def test_a_cascade_keeps_the_first_pass_before_the_first_fed_slot():
    right, again, fed = [True, False, False, False], [False, False, True, False], [False, True, False, False]
    assert signal.cascaded_right(right, again, fed) == [True, True, True, False]
    assert signal.cascaded_right(right, again, [False] * 4) == right


@pytest.fixture(scope="module")
def objective():
    target = tiny_target(family="llama", seed=0, dtype=torch.float32, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=5, dtype=torch.float32)
    return signal.verdict_objective(drafter, target, num_anchors=4)


def _batch(length=30, seed=0):
    ids = torch.randint(0, 95, (1, length), generator=torch.Generator().manual_seed(seed))
    loss_mask = torch.zeros(1, length, dtype=torch.bool)
    loss_mask[:, 8:] = True
    return dict(input_ids=ids, loss_mask=loss_mask, attention_mask=torch.ones(1, length, dtype=torch.long),
                anchor_generator=torch.Generator().manual_seed(seed))


def test_the_verdict_keeps_the_targets_top3_and_its_rank_of_each_draft(objective):
    first = objective._first_pass(_batch())
    verdict = objective.verdict
    assert torch.equal(verdict["topk"][..., 0], first["target_tokens"])
    torch.testing.assert_close(verdict["topk_probs"][..., 0], first["target_probs"])
    agree = first["drafts"] == first["target_tokens"]
    assert torch.equal(verdict["draft_ranks"] == 0, agree)
    assert (verdict["draft_probs"] <= verdict["topk_probs"][..., 0] + 1e-6).all()


def test_a_redraft_without_fed_tokens_is_the_backbones_block(objective):
    batch = _batch()
    first = objective._first_pass(batch)
    ids, anchors, valid = batch["input_ids"], first["anchors"], first["anchor_valid"]
    drafts, _, _ = objective.backbone_drafts(ids, first["features"], anchors, valid)
    plain = signal.redraft_with_tokens(objective, ids, first["features"], anchors, valid)
    assert torch.equal(plain["drafts"], drafts)
    unfed = signal.redraft_with_tokens(objective, ids, first["features"], anchors, valid, torch.full_like(drafts, -1))
    assert torch.equal(unfed["drafts"], drafts)


def test_a_fed_token_reaches_the_other_slots_of_its_block_and_no_other_block(objective):
    batch = _batch()
    first = objective._first_pass(batch)
    ids, anchors, valid = batch["input_ids"], first["anchors"], first["anchor_valid"]
    plain = signal.redraft_with_tokens(objective, ids, first["features"], anchors, valid)
    fed = torch.full_like(plain["drafts"], -1)
    fed[0, 1, 0] = 7
    given = signal.redraft_with_tokens(objective, ids, first["features"], anchors, valid, fed)
    assert not torch.allclose(given["hidden"][0, 1, 1:], plain["hidden"][0, 1, 1:])  # the block's attention carries it
    others = [0, 2, 3]
    torch.testing.assert_close(given["hidden"][0, others], plain["hidden"][0, others])


def _constructed_round(objective, monkeypatch, batch, anchor=10):
    """One block at ``anchor``: slot 1 right, slot 2 wrong (n = 1), kept slots 3..4 holding the committed tokens; the
    target's t and top-3 there wrong; the backbone's next block all wrong."""
    ids, vocab = batch["input_ids"][0], 96
    real = objective._first_pass

    def first_pass(b):
        first = real(b)
        truth = ids[anchor + 1: anchor + 5]
        drafts = truth.clone()
        drafts[1] = (truth[1] + 1) % vocab
        first.update(anchors=torch.tensor([[anchor] * 4]), anchor_valid=torch.tensor([[True, False, False, False]]),
                     accepted=torch.tensor([[1, 0, 0, 0]]), drafts=drafts.expand(1, 4, 4).clone(),
                     target_tokens=((truth + 2) % vocab).expand(1, 4, 4).clone())
        objective.verdict["topk"] = ((truth + 2) % vocab)[None, None, :, None].expand(1, 4, 4, 3).clone()
        return first

    def all_wrong(obj, input_ids, features, anchors, anchor_valid, fed=None):
        positions = (anchors[..., None] + torch.arange(1, 5)).clamp(max=input_ids.shape[1] - 1)
        drafts = (input_ids[0][positions] + 1) % vocab
        drafts = torch.where(fed >= 0, fed, drafts) if fed is not None else drafts
        return dict(drafts=drafts, top4=torch.stack([drafts + k for k in (0, 1, 2, -1)], -1) % vocab,
                    hidden=torch.zeros(*drafts.shape, 64), confidence=torch.ones(drafts.shape))

    monkeypatch.setattr(objective, "_first_pass", first_pass)
    monkeypatch.setattr(signal, "redraft_with_tokens", all_wrong)


def test_the_bound_aligns_the_kept_suffix_with_the_next_block(objective, monkeypatch):
    """Kept d_3, d_4 are the committed tokens at s+3, s+4: slots 0 and 1 of the next block (anchor s+2)."""
    batch = _batch()
    _constructed_round(objective, monkeypatch, batch)
    # "cut 2": every slot past slot 1 is cut, so d_3, d_4 are the unverified tail of a fully accepted round
    thresholds = {"full block": 0.0, "cut 2": 2.0}
    counts = {m: defaultdict(lambda: defaultdict(int)) for m in thresholds}
    bound, negative = {m: defaultdict(list) for m in thresholds}, {m: defaultdict(int) for m in thresholds}
    rows = {m: [] for m in thresholds}
    signal.measure_sequence(objective, batch, thresholds, counts, bound, negative, rows)
    full, cut = bound["full block"], bound["cut 2"]
    assert full["backbone"] == [1] and cut["backbone"] == [1]
    # the backbone's 4th choice is the right token at every slot: only the top-4 control takes it
    assert full["control: backbone's own top-2"] == [1] and full["control: backbone's own top-4"] == [5]
    assert full["d @0 (verified only)"] == [3]  # +2: both kept tokens right at their slots
    assert full["d @0"] == [3] and full["d @-1"] == [1] and full["d @+1"] == [1]
    assert full["d, best shift per block"] == [3]
    assert full["d or t @0"] == [3] and full["d or top-3 @0"] == [3]  # the target's tokens are wrong here
    assert full["+ cascade (re-drafted)"] == [3]  # the fed slots count, the re-draft of the rest is wrong
    assert full["first wrong slot given, not re-drafted"] == [2]
    assert cut["d @0 (verified only)"] == [1] and cut["d @0"] == [3]  # only the tail holds them under the cut
    assert negative["full block"]["backbone wrong at a verified kept slot"] == 2
    assert negative["full block"]["kept d right there"] == 2
    kept = rows["full block"][0]
    assert kept["kept"][:2].tolist() == batch["input_ids"][0, 13:15].tolist() and kept["kept_verified"][:2].all()
    assert not rows["cut 2"][0]["kept_verified"].any()


def _probe_rows(blocks, slots, hidden, vocab, copy, seed):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (blocks, slots), generator=gen)
    zeros = torch.zeros(blocks, slots)
    return dict(hidden=torch.randn(blocks, slots, hidden, generator=gen), labels=labels, drafts=labels,
                kept=labels if copy else torch.full_like(labels, -1),
                kept_verified=torch.full((blocks, slots), copy), kept_target=torch.full_like(labels, -1),
                kept_target_prob=zeros, kept_draft_prob=zeros, kept_confidence=zeros,
                rejected=torch.zeros(blocks, dtype=torch.bool), rejection_prob=torch.zeros(blocks),
                rejection_rank=torch.zeros(blocks))


def test_suffix_features_are_zero_where_nothing_is_kept():
    target = tiny_target(family="llama", seed=0, dtype=torch.float32)
    features = probe.suffix_features(_probe_rows(3, 4, 64, 96, copy=False, seed=0), target.get_input_embeddings())
    assert features.shape[:2] == (3, 4) and torch.count_nonzero(features) == 0


@pytest.mark.parametrize("kind", ["residual", "candidates"])
def test_the_probe_learns_a_kept_token_that_is_the_label_and_only_with_the_suffix(kind):
    """Labels equal the kept token and the states are noise: only the head that reads the suffix can learn them."""
    target = tiny_target(family="llama", seed=0, dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=5, dtype=torch.float32)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    head = tuple(None if t is None else t.detach() for t in drafter.draft_head(lm_head))
    results = {}
    for use_suffix in (False, True):
        train = probe.flatten(_probe_rows(400, 4, 64, 96, copy=True, seed=1), embed, drafter, head, 96, use_suffix)
        held = probe.flatten(_probe_rows(100, 4, 64, 96, copy=True, seed=2), embed, drafter, head, 96, use_suffix)
        trained = probe.train_probe(train, head, drafter, width=64, steps=300, batch=256, lr=1e-2, seed=0, kind=kind)
        results[use_suffix] = probe.score(held, head, drafter, trained)
    assert results[True]["top1"] > 0.9 and results[False]["top1"] < 0.1
    assert results[True]["ce"] < results[False]["ce"] and results[True]["tau"] > results[False]["tau"] + 1


def test_recorded_rounds_become_sequences_with_the_loss_on_the_answer_only(tmp_path):
    from hf_retrace.tuning.records import AnswerRecord, RoundRecords

    RoundRecords(block_size=4, greedy=[AnswerRecord([5, 6, 7, 8, 9], 3, [], []),
                                       AnswerRecord([1, 2, 3], 1, [], [])]).save(tmp_path)
    first, second = signal.records_as_sequences(str(tmp_path))
    assert first["input_ids"].tolist() == [5, 6, 7, 8, 9]
    assert first["loss_mask"].tolist() == [False, False, False, True, True]
    assert second["loss_mask"].tolist() == [False, True, True]
