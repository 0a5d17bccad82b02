"""ReTrace: the rejected suffix's life cycle, alignment, zero-init identity, ablations, no extra target forward."""

from __future__ import annotations

import pytest
import torch
from helpers import DraftLog, ProposalPolicy, scripted_source, tiny_drafter, tiny_target

from hf_retrace import RejectedSuffix
from hf_retrace.generation.policy import shipped_policy
from hf_retrace.retrace import PendingSuffix
from hf_retrace.training.retrace_stage import ReTraceObjective


def _recorded(drafter, proposals=None):
    """``drafter`` proposing through a source that logs its drafts and verdicts (the log, the view)."""
    log = DraftLog()
    return log, drafter.with_drafter_source(scripted_source(proposals, log))


def _run(target, drafter, prompt, max_new_tokens=40):
    return target.generate(prompt, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)


def test_untrained_retrace_drafts_exactly_what_its_backbone_drafts():
    target = tiny_target(seed=5, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=6, retrace="untrained")
    prompt = torch.randint(0, 95, (1, 9), generator=torch.Generator().manual_seed(1))
    with_retrace, view = _recorded(drafter)
    _run(target, view, prompt)
    fused = view.last_stats.rounds_with_fused_suffix
    without, view = _recorded(drafter.with_policy(retrace=False))
    _run(target, view, prompt)
    assert fused > 0, "the ReTrace path never ran: nothing was fused"
    assert with_retrace.drafts == without.drafts


def test_trained_retrace_changes_the_drafts_but_not_the_output():
    target = tiny_target(seed=5, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=6, retrace="random")
    prompt = torch.randint(0, 95, (1, 9), generator=torch.Generator().manual_seed(1))
    on, view = _recorded(drafter)
    out_on = _run(target, view, prompt)
    off, view = _recorded(drafter.with_policy(retrace=False))
    out_off = _run(target, view, prompt)
    assert on.drafts != off.drafts, "a non-zero ReTrace module must change some drafts"
    assert torch.equal(out_on, out_off)


def test_alignment_places_kept_slots_by_absolute_position():
    # round with anchor s=10, k=6 drafted, n=2 accepted: kept slots j=4..6 at positions 14..16; next anchor 13
    hidden = torch.arange(3 * 4, dtype=torch.float32).view(1, 3, 4)
    suffix = RejectedSuffix(
        positions=torch.tensor([[14, 15, 16]]),
        drafter_hidden=hidden,
        rejected_tokens=torch.tensor([[7, 8, 9]]),
        target_tokens=torch.tensor([[7, 1, 2]]),
        target_probs=torch.tensor([[0.5, 0.25, 0.125]]),
        target_features=hidden + 100,
    )
    assert suffix.agree.tolist() == [[True, False, False]]
    aligned = suffix.align(anchor_position=13, block_size=6)
    # new slots 1, 2, 3 (mask indices 0, 1, 2) hold old slots 4, 5, 6; slots 4, 5 stay MASK
    assert aligned.valid.tolist() == [[True, True, True, False, False]]
    assert aligned.rejected_tokens.tolist() == [[7, 8, 9, 0, 0]]
    assert torch.equal(aligned.drafter_hidden[0, :3], hidden[0])
    assert torch.equal(aligned.target_features[0, :3], hidden[0] + 100)
    # a block too short for the suffix keeps only what fits
    short = suffix.align(anchor_position=13, block_size=3)
    assert short.valid.tolist() == [[True, True]] and short.rejected_tokens.tolist() == [[7, 8]]


def test_rejected_suffix_life_cycle():
    """Fresh state per call; dropped after a fully accepted round; kept (from the same verification) otherwise."""
    target = tiny_target(seed=6, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=5, retrace="random")
    prompt = torch.randint(0, 95, (1, 7), generator=torch.Generator().manual_seed(2))
    reference = target.generate(prompt, max_new_tokens=30, do_sample=False)
    log, view = _recorded(drafter, ProposalPolicy(reference, "all", 96))
    _run(target, view, prompt, 30)
    assert log.verdicts and all(s is None for n, k, s in log.verdicts if n == k), "all accepted: nothing may be kept"
    first = log.sources
    log, view = _recorded(drafter, ProposalPolicy(reference, "partial", 96, seed=4))
    _run(target, view, prompt, 30)
    assert len(first) == len(log.sources) == 1 and first[0] is not log.sources[0], "fresh state per call"
    for accepted, drafted, suffix in log.verdicts:
        if accepted + 1 < drafted:
            assert suffix is not None and len(suffix) == drafted - accepted - 1
        else:
            assert suffix is None


@pytest.mark.parametrize("retrace", [None, "random"])
def test_no_extra_target_forward(retrace, count_forwards):
    target = tiny_target(seed=7, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=5, retrace=retrace)
    prompt = torch.randint(0, 95, (1, 8), generator=torch.Generator().manual_seed(3))
    calls = count_forwards(target)
    _run(target, drafter, prompt, 30)
    stats = drafter.last_stats
    # one prefill, one verification per drafting round, and single steps where no draft was possible
    undrafted_steps = stats.new_tokens - 1 - sum(stats.acceptance_lengths)
    assert calls["n"] == 1 + stats.rounds + undrafted_steps


def test_ablations_change_the_fusion_as_documented():
    target = tiny_target(seed=8)
    drafter = tiny_drafter(target, block_size=4, retrace="random")
    with torch.no_grad():
        drafter.retrace.gate.weight.normal_(0, 0.3)
    gen = torch.Generator().manual_seed(0)
    suffix = RejectedSuffix(
        positions=torch.tensor([[5, 6]]),
        drafter_hidden=torch.randn(1, 2, 64, generator=gen, dtype=torch.float64),
        rejected_tokens=torch.tensor([[3, 4]]),
        target_tokens=torch.tensor([[3, 9]]),
        target_probs=torch.tensor([[0.9, 0.4]], dtype=torch.float64),
        target_features=torch.randn(1, 2, 64, generator=gen, dtype=torch.float64),
    ).align(4, 4)
    embed = target.get_input_embeddings()
    masks = drafter.mask_vector(embed).expand(1, 3, -1)
    outputs = {}
    for ablation in ("full", "no_correction", "no_gate", "tokens_only"):
        drafter.config.retrace_ablation = "no_gate"  # the module never reads the shared config: the call decides
        with torch.no_grad():
            outputs[ablation] = drafter.retrace(masks, suffix, embed, ablation)
    for ablation in ("no_correction", "no_gate", "tokens_only"):
        assert not torch.allclose(outputs[ablation][0, :2], outputs["full"][0, :2]), ablation
    for out in outputs.values():  # the unaligned slot stays the plain MASK embedding
        assert torch.equal(out[0, 2], masks[0, 2])


def test_plain_dflash_drafter_can_gain_a_retrace_module():
    target = tiny_target(seed=9)
    drafter = tiny_drafter(target, retrace=None)
    assert drafter.retrace is None and drafter.config.retrace == "absent"
    assert not shipped_policy(drafter.config).retrace
    module = drafter.add_retrace()
    assert torch.count_nonzero(module.output_projection.weight) == 0
    assert drafter.config.retrace == "untrained" and not shipped_policy(drafter.config).retrace, "off by default"
    drafter.config.retrace = "trained"
    assert shipped_policy(drafter.config).retrace


def test_training_aligns_exactly_as_generate_does():
    """The ReTrace stage's batched alignment and the per-round one inside ``generate`` are one rule: for every block
    and every accepted count (all accepted included), the training row equals the suffix a round would keep."""
    block, hidden = 6, 3
    gen = torch.Generator().manual_seed(0)
    accepted = torch.tensor([[0, 1, 2], [3, 4, 5]])  # n = 0 .. B-1
    anchors = torch.tensor([[2, 9, 20], [4, 11, 30]])
    first = {
        "accepted": accepted,
        "anchors": anchors,
        "drafter_hidden": torch.randn(2, 3, block - 1, hidden, generator=gen),
        "drafts": torch.randint(0, 50, (2, 3, block - 1), generator=gen),
        "target_tokens": torch.randint(0, 50, (2, 3, block - 1), generator=gen),
        "target_probs": torch.rand(2, 3, block - 1, generator=gen),
        "target_features": torch.randn(2, 3, block - 1, hidden, generator=gen),
    }
    next_anchors, batched = ReTraceObjective.align_next_block(first, block)
    for row, (i, j) in enumerate((i, j) for i in range(2) for j in range(3)):
        n, s = int(accepted[i, j]), int(anchors[i, j])
        assert int(next_anchors[i, j]) == s + n + 1
        slots = torch.arange(n + 2, max(block, n + 2))  # what a round keeps: j = n+2 .. k (k = B-1 drafted)
        pick = slots - 1
        one = RejectedSuffix(
            positions=(s + slots)[None],
            drafter_hidden=first["drafter_hidden"][i, j, pick][None],
            rejected_tokens=first["drafts"][i, j, pick][None],
            target_tokens=first["target_tokens"][i, j, pick][None],
            target_probs=first["target_probs"][i, j, pick][None],
            target_features=first["target_features"][i, j, pick][None],
        ).align(s + n + 1, block)
        assert int(batched.valid[row].sum()) == max(block - 1 - (n + 1), 0)
        for name in ("valid", "drafter_hidden", "rejected_tokens", "target_tokens", "target_probs", "target_features"):
            assert torch.equal(getattr(batched, name)[row], getattr(one, name)[0]), (row, name)


def test_a_pending_suffix_becomes_a_complete_immutable_one():
    """The verdict of a round waits for the target's rows as a PendingSuffix; completing it gives a frozen suffix."""
    import dataclasses

    pending = PendingSuffix(
        anchor_position=10,
        positions=torch.tensor([[13, 15]]),
        drafter_hidden=torch.zeros(1, 2, 4),
        rejected_tokens=torch.tensor([[5, 6]]),
        target_tokens=torch.tensor([[5, 7]]),
        target_probs=torch.tensor([[0.5, 0.5]]),
    )
    assert pending.window_rows.tolist() == [3, 5]
    window = torch.arange(8 * 4, dtype=torch.float32).view(1, 8, 4)
    suffix = pending.complete(window[:, pending.window_rows])
    assert torch.equal(suffix.target_features[0], window[0, [3, 5]])
    with pytest.raises(dataclasses.FrozenInstanceError):
        suffix.target_features = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        pending.positions = None


def test_settings_changed_mid_call_do_not_reach_the_call_in_flight():
    """A generate call reads its run-time choices once: another caller flipping the shared config between two of its
    rounds (ReTrace off, another ablation, a confidence cut) leaves its drafts exactly as in an undisturbed call."""
    target = tiny_target(seed=5, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=6, retrace="random")
    with torch.no_grad():
        drafter.retrace.gate.weight.normal_(0, 0.3)
    prompt = torch.randint(0, 95, (1, 9), generator=torch.Generator().manual_seed(1))
    undisturbed, view = _recorded(drafter)
    _run(target, view, prompt)
    assert view.last_stats.rounds_with_fused_suffix > 0
    flipping = DraftLog()

    class FlipsTheConfigAfterEachVerdict(scripted_source(log=flipping)):
        def observe(self, proposal, verdict):
            super().observe(proposal, verdict)
            drafter.config.retrace = "untrained"  # the shipped policy would turn it off
            drafter.config.retrace_ablation = "no_gate"
            drafter.config.draft_confidence_threshold = 0.99

    _run(target, drafter.with_drafter_source(FlipsTheConfigAfterEachVerdict), prompt)
    assert flipping.drafts == undisturbed.drafts
    later, view = _recorded(drafter)
    _run(target, view, prompt)  # the next call does see them
    assert later.drafts != undisturbed.drafts
