"""``hf-retrace calibrate`` records the rounds a drafter ships; the tuner's pieces it relies on (the verify-cost
timing, the tie rule) behave as documented."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import tiny_drafter, tiny_target

from hf_retrace.generation.policy import RoundPolicy
from hf_retrace.training.calibrate import record_round_records
from hf_retrace.tuning.costs import measure_verify_costs
from hf_retrace.tuning.replay import replay
from hf_retrace.tuning.search import best_row


def test_recording_keeps_the_drafters_own_settings_and_every_answer_token():
    target = tiny_target(dtype=torch.float32, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=6, dtype=torch.float32)
    drafter.config.draft_confidence_threshold, drafter.config.lookup = 0.4, True
    prompts = [[5, 9, 14, 2, 7, 7, 30], [11, 12, 13, 40, 2]]
    target.generation_config.eos_token_id = None  # answers run to max_new_tokens
    records = record_round_records(target, drafter, prompts, max_new_tokens=16, progress=False)
    assert (drafter.config.draft_confidence_threshold, drafter.config.lookup) == (0.4, True)  # nothing mutated
    assert records.block_size == 6 and records.made_with["prompts"] == 2
    for answers in (records.greedy, records.sampled):
        assert [len(a.tokens) - a.start for a in answers] == [16, 16]
        assert all(len(row) == 5 for a in answers for row in a.drafts)  # full blocks at every anchor
    # every walk commits each answer token after the prefill's once, whichever source drafted it
    walked = replay(records.greedy, RoundPolicy(lookup=True, lookup_min_ngram=1), 5)
    assert walked["tokens"] == 2 * (16 - 1)
    with pytest.raises(ValueError, match="at least one prompt"):
        record_round_records(target, drafter, [], progress=False)


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
