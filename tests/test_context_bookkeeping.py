"""The context the drafter receives equals a fresh full forward's tapped states at exactly the committed positions.

This is the off-by-prefill trap of transformers' Gemma-4 assistant (issue #48703): the drafter must see every
committed position once, in order, with the target's states computed on the committed tokens.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ProposalPolicy, tiny_drafter, tiny_target

from hf_retrace.generation import target_features


def _record_contexts(drafter):
    received = []
    original = drafter.forward

    def forward(*args, **kwargs):
        received.append((kwargs["target_hidden"].clone(), kwargs["position_ids"].clone()))
        return original(*args, **kwargs)

    drafter.forward = forward
    return received


@pytest.mark.parametrize("path", ["model_outputs", "hooks"])
@pytest.mark.parametrize("policy", ["drafter", "partial", "all"])
@pytest.mark.parametrize("rounds", ["drafter", "hybrid"])
def test_context_rows_equal_fresh_forward_at_committed_positions(path, policy, rounds, monkeypatch, use_policy):
    """Also when lookup rounds skip the drafter (hybrid): their rows reach the drafter at its next round, in order."""
    if path == "hooks":
        monkeypatch.setattr(target_features, "loop_hands_model_outputs", lambda: False)
    target = tiny_target(seed=3, logit_scale=4.0)
    layer_ids = [0, 2, 3]  # includes the last layer: transformers reports it after the final norm
    drafter = tiny_drafter(target, block_size=5, target_layer_ids=layer_ids)
    if rounds == "hybrid":  # 1-gram matches: lookup wins many rounds, the drafter the others
        drafter.config.lookup, drafter.config.lookup_min_ngram, drafter.config.lookup_num_tokens = True, 1, 3
    prompt = torch.randint(0, 95, (1, 11), generator=torch.Generator().manual_seed(5))
    reference = target.generate(prompt, max_new_tokens=40, do_sample=False)
    if policy != "drafter":
        use_policy(ProposalPolicy(reference, policy, 96, seed=1))
    received = _record_contexts(drafter)
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False)
    assert torch.equal(out, reference)

    with torch.no_grad():
        fresh = target(out, output_hidden_states=True).hidden_states
    fresh_features = torch.cat([fresh[i + 1] for i in layer_ids], dim=-1)[0]

    next_position = 0
    for target_hidden, position_ids in received:
        num_ctx = target_hidden.shape[1]
        ctx_positions = position_ids[0, :num_ctx]
        block_positions = position_ids[0, num_ctx:]
        # contiguous: every committed position exactly once, in order, none skipped, none repeated
        assert ctx_positions.tolist() == list(range(next_position, next_position + num_ctx))
        # the block starts at the anchor: the newest committed token, whose states the target has not computed yet
        assert block_positions[0] == ctx_positions[-1] + 1
        assert len(block_positions) == drafter.config.block_size
        torch.testing.assert_close(target_hidden[0], fresh_features[ctx_positions], rtol=1e-9, atol=1e-9)
        next_position += num_ctx
    assert received, "the drafter was never called"
    assert next_position <= out.shape[1] - 1
    stats = drafter.last_stats
    if rounds == "hybrid":
        assert 0 < stats.lookup_rounds < stats.rounds, "the hybrid case must switch sources"
        assert received[0][0].shape[1] >= prompt.shape[1], "first context must start with the whole prompt"
    else:
        assert stats.lookup_rounds == 0
        assert received[0][0].shape[1] == prompt.shape[1], "first context must be the whole prompt"


def test_rejected_rows_never_enter_the_context(use_policy):
    """With partial acceptance, rows of rejected drafts must not be taken as context (only n+1 rows per round)."""
    target = tiny_target(seed=4, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=6)
    prompt = torch.randint(0, 95, (1, 7), generator=torch.Generator().manual_seed(2))
    reference = target.generate(prompt, max_new_tokens=30, do_sample=False)
    use_policy(ProposalPolicy(reference, "partial", 96, seed=3))
    received = _record_contexts(drafter)
    target.generate(prompt, assistant_model=drafter, max_new_tokens=30, do_sample=False)
    stats = drafter.last_stats
    # round r's verdict (n accepted) gives the next call n + 1 new context rows
    ctx_rows = [th.shape[1] for th, _ in received[1:]]
    assert ctx_rows == stats.acceptance_lengths[: len(ctx_rows)]
