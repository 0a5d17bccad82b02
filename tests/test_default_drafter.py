"""The shipped default drafter: it loads, fits the embedded default target, drafts for real, and stays lossless."""

from __future__ import annotations

import pytest
import torch

from hf_retrace import defaults
from hf_retrace.generation.dispatch import check_target
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
    assert drafter.config.retrace_enabled, "the shipped drafter carries trained ReTrace weights"
    assert drafter.config.draft_vocab_size == 16384


@pytest.mark.parametrize("use_retrace", [True, False])
def test_default_drafter_is_lossless_and_accepts_drafts_in_fp32(pair, use_retrace):
    target, tokenizer, drafter = pair
    drafter.config.use_retrace = use_retrace
    ids = chat_input_ids(tokenizer, "Write a Python function that checks whether a number is prime.")
    plain = target.generate(ids, max_new_tokens=48, do_sample=False)
    fast = target.generate(ids, max_new_tokens=48, do_sample=False, assistant_model=drafter)
    assert fast.tolist() == plain.tolist()
    stats = drafter.last_stats
    assert stats.mean_acceptance_length > 1.0, "the trained drafter should get some drafts accepted"
    assert (stats.rounds_with_fused_suffix > 0) == use_retrace
