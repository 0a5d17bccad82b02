"""The round shape's calibration: the replay is the generator's own cut rule, and a real calibration run records what
the replays need (full-block rounds, the target's answers for the lookup budget), on a tiny random pair."""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers import tiny_drafter, tiny_target
from hf_retrace.training.calibrate import (
    LOOKUP_GRID,
    best_row,
    calibrate_confidence_threshold,
    measure_verify_costs,
    replay_threshold,
)

# two recorded rounds: (top draft probability per slot, drafts the target accepted)
ROUNDS = [([0.9, 0.8, 0.3, 0.9], 2), ([0.5, 0.2, 0.1, 0.1], 0)]
VERIFY = [1.0, 1.1, 1.2, 1.3, 1.4]


def test_replay_drafts_while_the_next_slot_is_confident_and_counts_its_cost():
    cut = replay_threshold(ROUNDS, 0.5, draft_cost=0.1, verify_costs=VERIFY)
    # round 1: slots 1-2 (slot 3 at 0.3 is cut), 2 accepted + 1 -> 3 tokens for 0.1 + 1.2;
    # round 2: slot 1 only (always drafted), 0 accepted -> 1 token for 0.1 + 1.1
    assert cut == pytest.approx({"threshold": 0.5, "tau": 2.0, "mean_drafted": 1.5, "tokens_per_cost": 4 / 2.5})
    full = replay_threshold(ROUNDS, 0.0, draft_cost=0.1, verify_costs=VERIFY)
    assert full == pytest.approx({"threshold": 0.0, "tau": 2.0, "mean_drafted": 4.0, "tokens_per_cost": 4 / 3.0})
    # a cut can only lose accepted drafts: round 1 cut at slot 1 commits 1 draft of its 2
    strict = replay_threshold(ROUNDS, 0.95, draft_cost=0.1, verify_costs=VERIFY)
    assert strict["tau"] == pytest.approx((2 + 1) / 2) and strict["mean_drafted"] == 1.0


def test_the_replay_cut_is_the_generators_cut():
    """The generator records the confidences of the slots it drafted: replaying its threshold drafts the same."""
    torch.manual_seed(0)
    target = tiny_target(dtype=torch.float32, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=6, dtype=torch.float32)
    prompt = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    drafter.config.draft_confidence_threshold = 0.0
    target.generate(prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False)
    full_rounds = drafter.last_stats.slot_confidences
    threshold = min(full_rounds[0][2] + 1e-6, 0.999)  # the first round stops before its third slot
    drafter.config.draft_confidence_threshold = threshold
    target.generate(prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False)
    cut_rounds = drafter.last_stats.slot_confidences
    # greedy output never depends on the threshold, so the first round drafts from the same state in both runs
    expected = replay_threshold([(full_rounds[0], 0)], threshold, 0.0, [1.0] * 8)["mean_drafted"]
    assert len(full_rounds[0]) == 5 and len(cut_rounds[0]) == expected <= 2


def test_calibration_records_rounds_costs_and_picks_the_best_replayed_threshold():
    target = tiny_target(dtype=torch.float32, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=6, dtype=torch.float32)
    drafter.config.draft_confidence_threshold, drafter.config.lookup = 0.4, True
    prompts = [[5, 9, 14, 2, 7, 7, 30], [11, 12, 13, 40, 2]]
    result = calibrate_confidence_threshold(target, drafter, prompts, max_new_tokens=16, progress=False)
    # the drafter's own settings are restored after the full-block recording
    assert (drafter.config.draft_confidence_threshold, drafter.config.lookup) == (0.4, True)
    assert result["prompts"] == 2 and result["rounds"] == len(result["recorded_rounds"]) > 0
    assert max(len(confidences) for confidences, _ in result["recorded_rounds"]) == 5, "full blocks recorded"
    assert len(result["verify_costs"]) == 17 and result["verify_costs"][0] == 1.0  # up to the longest lookup cap
    assert result["best"] == best_row(result["table"])
    assert result["threshold"] == result["best"]["threshold"] and result["full_block"]["threshold"] == 0.0
    replayed = replay_threshold(result["recorded_rounds"], result["threshold"], result["draft_cost_c"],
                                result["verify_costs"])
    assert replayed == pytest.approx(result["best"])
    # the lookup budget: every (start, cap) of the grid walked over the target's own answers at the best threshold
    lookup = result["lookup"]
    assert [(r["start_tokens"], r["num_tokens"]) for r in lookup["table"]] == list(LOOKUP_GRID)
    assert lookup["best"] == best_row(lookup["table"])
    assert (lookup["start_tokens"], lookup["num_tokens"]) == (lookup["best"]["start_tokens"], lookup["best"]["num_tokens"])
    assert lookup["drafter_alone"]["lookup_share"] == 0 and lookup["best"]["rounds"] > 0
    # every walk commits each answer token after the prefill's once, whichever source drafted it
    assert lookup["drafter_alone"]["tokens"] == lookup["best"]["tokens"] == 2 * (16 - 1)
    with pytest.raises(ValueError, match="at least one prompt"):
        calibrate_confidence_threshold(target, drafter, [], progress=False)


def test_verify_costs_are_relative_to_a_one_token_forward():
    target = tiny_target(dtype=torch.float32)
    with warnings.catch_warnings():  # the cache goes in under the name this transformers takes (5.24: `cache`)
        warnings.filterwarnings("error", message=".*past_key_values.*")
        costs = measure_verify_costs(target, max_drafts=3, context_length=16, repeats=2)
    assert len(costs) == 4 and costs[0] == 1.0 and all(c > 0 for c in costs)


def test_best_row_takes_the_higher_tau_among_ties():
    table = [{"tokens_per_cost": 1.000, "tau": 1.7}, {"tokens_per_cost": 0.997, "tau": 1.9},
             {"tokens_per_cost": 0.990, "tau": 2.5}]
    assert best_row(table) == table[1]  # 0.3 % below the top: a tie, and more tokens per round
    assert best_row(table, tie=0.0) == table[0]
    assert best_row(table, tie=0.02) == table[2]
