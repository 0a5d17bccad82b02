"""The shipped default drafter: it loads, fits the embedded default target, drafts for real, and stays lossless."""

from __future__ import annotations

import pytest
import torch

from hf_retrace import defaults
from hf_retrace.generation.checks import check_target
from hf_retrace.generation.policy import shipped_policy
from hf_retrace.side_by_side import chat_input_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair():
    try:
        drafter_path = defaults.default_drafter_path()
    except FileNotFoundError as error:  # pragma: no cover - the repository ships it
        pytest.fail(str(error))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_retrace

    target_path = defaults.ensure_default_target()
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    drafter = hf_retrace.ReTraceDrafter.from_pretrained(drafter_path, dtype=torch.float32).eval()
    return target, tokenizer, drafter


def test_default_drafter_fits_the_default_target(pair):
    target, _, drafter = pair
    check_target(drafter, target)
    config = drafter.config
    assert config.draft_vocab_size and config.draft_vocab_size == drafter.draft_vocab.numel()
    threshold = config.draft_confidence_threshold
    assert threshold is None or 0.0 <= threshold < 1.0, "the adaptive block ships calibrated or off"
    # ReTrace ships on only with trained weights (issue: ReTrace must beat its backbone before it is on by default)
    assert shipped_policy(config).retrace == (config.retrace == "trained")


@pytest.mark.parametrize("lookup", [False, True])
def test_default_drafter_is_lossless_and_accepts_drafts_in_fp32(pair, lookup):
    target, tokenizer, drafter = pair
    saved = drafter.config.lookup
    drafter.config.lookup = lookup
    try:
        ids = chat_input_ids(tokenizer, "Write a Python function that checks whether a number is prime.")
        plain = target.generate(ids, max_new_tokens=48, do_sample=False)
        fast = target.generate(ids, max_new_tokens=48, do_sample=False, assistant_model=drafter)
    finally:
        drafter.config.lookup = saved
    assert fast.tolist() == plain.tolist()
    stats = drafter.last_stats
    assert stats.mean_acceptance_length > 1.2, "the trained drafter should get drafts accepted"
    assert (stats.lookup_rounds > 0) == lookup
    if not lookup:  # the drafter alone: its own drafts were accepted in many rounds
        assert sum(length > 1 for length in stats.acceptance_lengths) >= 0.2 * stats.rounds
