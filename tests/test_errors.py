"""Every unsupported call fails with a message that says what was wrong and what to do, before any target work."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from transformers import DynamicCache


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


@pytest.fixture
def prompt():
    return torch.randint(0, 95, (1, 6), generator=torch.Generator().manual_seed(0))


def _refused(target, count_forwards, match, **kwargs):
    calls = count_forwards(target)
    with pytest.raises(ValueError, match=match):
        target.generate(**kwargs)
    assert calls["n"] == 0, "the target ran before the error: work was done for nothing"


def test_batch_larger_than_one(target, count_forwards):
    drafter = tiny_drafter(target)
    batch = torch.randint(0, 95, (2, 6))
    _refused(target, count_forwards, "one sequence at a time.*batch of 2", input_ids=batch, assistant_model=drafter)


def test_beam_search(target, prompt, count_forwards):
    drafter = tiny_drafter(target)
    _refused(target, count_forwards, "num_beams=2.*silently ignore", input_ids=prompt, assistant_model=drafter, num_beams=2)


def test_num_return_sequences(target, prompt, count_forwards):
    drafter = tiny_drafter(target)
    _refused(
        target,
        count_forwards,
        "num_return_sequences=2",
        input_ids=prompt,
        assistant_model=drafter,
        do_sample=True,
        num_return_sequences=2,
    )


def test_vocabulary_mismatch(target, prompt, count_forwards):
    other = tiny_target(vocab_size=80)
    drafter = tiny_drafter(other)
    _refused(target, count_forwards, "vocabulary of 80 tokens.*has 96", input_ids=prompt, assistant_model=drafter)


def test_hidden_size_mismatch(target, prompt, count_forwards):
    other = tiny_target(hidden_size=32)
    drafter = tiny_drafter(other)
    _refused(target, count_forwards, "hidden size is 32.*has 64", input_ids=prompt, assistant_model=drafter)


def test_target_layer_ids_out_of_range(target, prompt, count_forwards):
    deeper = tiny_target(num_layers=8)
    drafter = tiny_drafter(deeper, target_layer_ids=[1, 6])
    _refused(target, count_forwards, r"reads target layers \[1, 6\].*only 4 layers", input_ids=prompt, assistant_model=drafter)


def test_prefilled_cache(target, prompt, count_forwards):
    drafter = tiny_drafter(target)
    cache = DynamicCache()
    with torch.no_grad():
        target(prompt[:, :4], past_key_values=cache, use_cache=True)
    _refused(
        target,
        count_forwards,
        "pre-filled cache.*no target hidden states",
        input_ids=prompt,
        past_key_values=cache,
        assistant_model=drafter,
    )


def test_padded_prompt(target, prompt, count_forwards):
    drafter = tiny_drafter(target)
    mask = torch.ones_like(prompt)
    mask[0, 0] = 0
    _refused(target, count_forwards, "padding", input_ids=prompt, attention_mask=mask, assistant_model=drafter)


def test_drafter_generate_called_directly(target, prompt):
    drafter = tiny_drafter(target)
    with pytest.raises(TypeError, match="cannot generate on its own.*assistant_model=drafter"):
        drafter.generate(prompt)


def test_bad_proposal_mode(target):
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="'argmax' or 'sample'"):
        drafter.proposal_mode = "beam"
