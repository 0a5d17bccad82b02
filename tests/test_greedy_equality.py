"""Lossless greedy: with any drafter, output equals the target's own greedy ``generate``, token for token (float64)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import ProposalPolicy, scripted_source, tiny_drafter, tiny_target

NUM_CASES = 224
_targets: dict = {}


def _target(family: str, seed: int):
    key = (family, seed)
    if key not in _targets:
        _targets[key] = tiny_target(family=family, seed=seed, logit_scale=4.0)
    return _targets[key]


def _case(index: int) -> dict:
    rng = random.Random(index)
    block_size = rng.choice([2, 3, 4, 5, 8, 16])
    return dict(
        family=rng.choice(["qwen3", "llama"]),
        target_seed=rng.randrange(3),
        prompt_length=rng.randint(1, 24),
        block_size=block_size,
        # at, just off, and away from block boundaries
        max_new_tokens=rng.choice([1, 2, block_size - 1, block_size, block_size + 1, 2 * block_size, rng.randint(3, 40)]),
        policy=rng.choice(["drafter", "all", "none", "partial"]),
        retrace=rng.choice([None, "untrained", "random"]),
        eos_inside=rng.random() < 0.3,
        draft_vocab_size=rng.choice([None, None, 48]),
        seed=index,
        # round shape: the adaptive block cut, and context lookup rounds mixed with drafter rounds
        confidence_threshold=rng.choice([None, None, 0.2, 0.6, 0.95]),
        lookup=rng.random() < 0.3,
        lookup_min_ngram=rng.choice([1, 2]),
        lookup_num_tokens=rng.choice([1, 4, 12]),
        lookup_start_tokens=rng.choice([1, 2, 3]),  # (above a cap of 1: the first budget is clamped to it)
        # the accelerator's round order (drafter first, one transfer to the host), forced on the CPU
        one_transfer=rng.random() < 0.5,
    )


@pytest.mark.parametrize("index", range(NUM_CASES))
def test_greedy_output_equals_plain_greedy(index):
    case = _case(index)
    target = _target(case["family"], case["target_seed"])
    torch.manual_seed(case["seed"])
    prompt = torch.randint(0, target.config.vocab_size - 1, (1, case["prompt_length"]))
    max_new = max(1, case["max_new_tokens"])
    kwargs = dict(max_new_tokens=max_new, do_sample=False)
    reference = target.generate(prompt, **kwargs)
    if case["eos_inside"] and reference.shape[1] - prompt.shape[1] > 2:
        # an EOS that the target emits in the middle of the answer (so inside some drafted block)
        eos = int(reference[0, prompt.shape[1] + (reference.shape[1] - prompt.shape[1]) // 2])
        kwargs["eos_token_id"] = eos
        kwargs["pad_token_id"] = eos
        reference = target.generate(prompt, **kwargs)
    drafter = tiny_drafter(
        target,
        block_size=case["block_size"],
        retrace=None if case["retrace"] is None else case["retrace"],
        seed=case["seed"],
        draft_vocab_size=case["draft_vocab_size"],
    )
    drafter.config.draft_confidence_threshold = case["confidence_threshold"]
    drafter.config.lookup = case["lookup"]
    drafter.config.lookup_min_ngram, drafter.config.lookup_num_tokens = case["lookup_min_ngram"], case["lookup_num_tokens"]
    drafter.config.lookup_start_tokens = case["lookup_start_tokens"]
    drafter = drafter.with_policy(one_transfer=case["one_transfer"])
    if case["policy"] != "drafter":
        proposals = ProposalPolicy(reference, case["policy"], target.config.vocab_size, seed=case["seed"])
        drafter = drafter.with_drafter_source(scripted_source(proposals))
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert out.tolist() == reference.tolist(), f"case {case}"
    stats = drafter.last_stats
    assert stats.new_tokens == out.shape[1] - prompt.shape[1]
    # the first token comes from the prefill; every other one from a drafting round or a last single step
    assert sum(stats.acceptance_lengths) <= stats.new_tokens - 1 or stats.new_tokens == 1
    if max_new > 2 and "eos_token_id" not in kwargs:
        assert stats.rounds >= 1
    if not case["lookup"]:
        assert stats.lookup_rounds == 0
        assert all(d <= case["block_size"] - 1 for d in stats.draft_lengths)
    plain_rounds = not case["lookup"] and case["confidence_threshold"] is None
    if plain_rounds and case["policy"] == "all" and "eos_token_id" not in kwargs and max_new > case["block_size"]:
        assert stats.acceptance_lengths[0] == case["block_size"], "a fully right block must be fully accepted"
    if case["policy"] == "none" and not case["lookup"]:
        assert all(length == 1 for length in stats.acceptance_lengths)


def test_cases_cover_the_required_shapes():
    """The randomized cases include every policy, EOS inside a block, and block-boundary lengths."""
    cases = [_case(i) for i in range(NUM_CASES)]
    assert {c["policy"] for c in cases} == {"drafter", "all", "none", "partial"}
    assert {c["retrace"] for c in cases} == {None, "untrained", "random"}
    assert sum(c["eos_inside"] for c in cases) >= 30
    assert any(c["max_new_tokens"] == c["block_size"] for c in cases)
    assert any(c["max_new_tokens"] == c["block_size"] + 1 for c in cases)
    assert {c["family"] for c in cases} == {"qwen3", "llama"}
    assert sum(c["draft_vocab_size"] is not None for c in cases) >= 30
    assert sum(c["lookup"] for c in cases) >= 40
    assert sum(c["confidence_threshold"] is not None for c in cases) >= 60
    assert sum(c["one_transfer"] and c["lookup"] for c in cases) >= 20
    assert sum(c["one_transfer"] and c["confidence_threshold"] is not None for c in cases) >= 30
