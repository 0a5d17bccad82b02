"""Scoring against the draft head is one rule, on the drafter (``draft_head``, ``compute_logits``, ``draft_token_ids``,
``draft_index``, ``full_vocab_logits``), used by generation, the training objective and the cost probes: here both
sides are checked against a direct computation, with a draft vocabulary and an ``lm_head`` with a bias (where a
second copy of the rule would drift first)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_drafter, tiny_target

from hf_retrace.generation.candidate_generator import ReTraceCandidateGenerator
from hf_retrace.training.objective import DFlashObjective

VOCAB = 96


@pytest.fixture(scope="module", params=[None, 40], ids=["full vocabulary", "draft vocabulary"])
def pair(request):
    target = tiny_target(family="llama", vocab_size=VOCAB, seed=4)
    head = torch.nn.Linear(target.config.hidden_size, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.copy_(target.lm_head.weight)
        head.bias.copy_(torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)))
    target.lm_head = head
    return target, tiny_drafter(target, draft_vocab_size=request.param, seed=2)


def _direct(target, drafter, hidden):
    """Scores over the whole vocabulary, restricted to the draft vocabulary by hand."""
    scores = hidden @ target.lm_head.weight.T + target.lm_head.bias
    vocab = torch.arange(VOCAB) if drafter.draft_vocab is None else drafter.draft_vocab
    return scores[..., vocab], vocab


def test_generation_scores_and_proposes_as_the_direct_computation(pair):
    target, drafter = pair
    prompt = torch.randint(0, VOCAB - 1, (1, 5), generator=torch.Generator().manual_seed(3))
    config = target.generation_config
    config.max_length = 20
    generator = ReTraceCandidateGenerator(drafter, target, config, None, prompt_length=5)
    hidden = torch.randn(1, 4, target.config.hidden_size, generator=torch.Generator().manual_seed(5))
    expected, vocab = _direct(target, drafter, hidden)
    logits = generator.drafter_source.draft_logits(hidden)
    torch.testing.assert_close(logits, expected)
    tokens, _ = generator.drafter_source.choose(prompt, logits)
    assert tokens.tolist() == vocab[expected.argmax(-1)].tolist()
    full = drafter.full_vocab_logits(logits, VOCAB)  # what the processors see: -inf outside the draft vocabulary
    assert full.shape == (1, 4, VOCAB) and torch.equal(full.argmax(-1), tokens)
    assert int(torch.isfinite(full[0, 0]).sum()) == len(vocab)


def test_training_scores_as_the_direct_computation_and_maps_labels_back(pair):
    target, drafter = pair
    objective = DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings())
    rows = torch.randn(6, target.config.hidden_size, generator=torch.Generator().manual_seed(6))
    weight, bias = objective._draft_head(rows.dtype, rows.device)
    expected, vocab = _direct(target, drafter, rows)
    torch.testing.assert_close(drafter.compute_logits(rows, (weight, bias)), expected)
    index, in_vocab = objective.draft_index(torch.arange(VOCAB))
    assert int(in_vocab.sum()) == len(vocab) and torch.equal(drafter.draft_token_ids(index[in_vocab]), vocab)


def test_the_training_head_follows_a_vocabulary_reselected_at_the_same_size():
    target = tiny_target(family="llama", vocab_size=VOCAB, seed=4)
    drafter = tiny_drafter(target, draft_vocab_size=40, seed=2)
    objective = DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings())
    rows = torch.randn(3, target.config.hidden_size, generator=torch.Generator().manual_seed(6))
    objective._draft_head(rows.dtype, rows.device)  # cached for the first vocabulary
    drafter.set_draft_vocab(torch.arange(VOCAB - 40, VOCAB))  # another 40 tokens
    weight, _ = objective._draft_head(rows.dtype, rows.device)
    torch.testing.assert_close(weight, target.lm_head.weight[VOCAB - 40 :].to(weight.dtype))
