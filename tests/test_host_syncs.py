"""One host sync per round (issue 23): on an accelerator every tensor read waits for the device, so the default round
reads the host what it needs in one transfer, and the stop check reads its verdict in one.

Counted on the CPU with ``examples/device_check.py``'s counter (a wrapper over ``item`` / ``tolist`` / ``__bool__`` /
``__int__`` / ``__float__`` / ``__index__`` active inside the counted methods only), with the accelerator's round order
forced (the round policy's ``one_transfer``). The greedy-equality fuzzer runs both orders (tests/
test_greedy_equality.py).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from helpers import ProposalPolicy, scripted_source, tiny_drafter, tiny_target
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_retrace.generation.policy import RoundPolicy
from hf_retrace.generation.stopping import PerTokenStopping

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "device_check.py"
NEW = 48


def _device_check():
    spec = importlib.util.spec_from_file_location("device_check_for_syncs", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def models():
    target = tiny_target(family="llama", vocab_size=96, logit_scale=4.0)
    return target, tiny_drafter(target, block_size=8, seed=3)


def _prompt(seed: int, loop: bool) -> torch.Tensor:
    rng = torch.Generator().manual_seed(seed)
    if loop:  # a repeated phrase: the target follows it, lookup matches
        return torch.randint(0, 95, (1, 6), generator=rng).repeat(1, 4)
    return torch.randint(0, 95, (1, 20), generator=rng)


# the default round shape (adaptive block + lookup) and full blocks, drafter alone
POLICIES = {
    "default": RoundPolicy(confidence_cut=0.3, lookup=True, lookup_min_ngram=1, lookup_max_ngram=4, lookup_cap=4),
    "full blocks": RoundPolicy(),
}


@pytest.mark.parametrize("name", POLICIES)
def test_a_round_reads_the_host_once_in_the_accelerator_order(models, name):
    target, drafter = models
    check = _device_check()
    view = drafter.with_policy(POLICIES[name].replace(one_transfer=True))
    sources = {"lookup": 0, "drafter": 0}
    for seed, loop in [(1, False), (2, True), (3, True), (4, False)]:
        prompt = _prompt(seed, loop)
        plain = target.generate(prompt, max_new_tokens=NEW, do_sample=False)
        with check.counting_host_syncs(cuda=False) as counts:
            out = target.generate(prompt, assistant_model=view, max_new_tokens=NEW, do_sample=False)
        assert out.tolist() == plain.tolist()
        stats = view.last_stats
        assert counts["steps"] == len(counts["per_step"]) > stats.rounds > 0
        assert max(counts["per_step"]) <= 1, counts["per_step"]  # every step, lookup and drafter rounds alike
        sources["lookup"] += stats.lookup_rounds
        sources["drafter"] += stats.rounds - stats.lookup_rounds
    assert sources["drafter"] > 0
    if POLICIES[name].lookup:
        assert sources["lookup"] > 0, "the test must see lookup rounds"


def test_the_cpu_order_and_the_accelerator_order_draft_the_same_blocks(models):
    """Same proposals, same verdicts: the order changes where the host reads, not what is drafted."""
    target, drafter = models
    rounds = {}
    for one_transfer in (False, True):
        view = drafter.with_policy(POLICIES["default"].replace(one_transfer=one_transfer))
        shapes = []
        for seed, loop in [(5, False), (6, True)]:
            target.generate(_prompt(seed, loop), assistant_model=view, max_new_tokens=NEW, do_sample=False)
            stats = view.last_stats
            shapes.append((stats.draft_lengths, stats.acceptance_lengths, stats.lookup_rounds))
        rounds[one_transfer] = shapes
    assert rounds[True] == rounds[False]


def test_the_verdict_is_read_from_the_sequence_length(models):
    """The generator derives the accepted count from the committed length (no transfer); it must equal the drafts the
    loop committed, read token by token (argmax proposals: the token after them is the target's own, not a draft's)."""
    target, drafter = models
    seen = []

    class Checking(scripted_source()):
        def observe(self, proposal, verdict):
            super().observe(proposal, verdict)
            committed = verdict.sequence[0, proposal.anchor + 1 :].tolist()
            matched = next((i for i, (d, c) in enumerate(zip(proposal.host_tokens, committed)) if d != c),
                           min(len(proposal), len(committed)))
            seen.append((verdict.accepted, matched))

    view = drafter.with_policy(POLICIES["default"]).with_drafter_source(Checking)
    for seed, loop in [(7, False), (8, True)]:
        target.generate(_prompt(seed, loop), assistant_model=view, max_new_tokens=NEW, do_sample=False)
        target.generate(_prompt(seed, loop), assistant_model=view, max_new_tokens=NEW, do_sample=True, top_k=5)
    assert seen and all(derived == loop for derived, loop in seen)
    assert any(derived > 0 for derived, _ in seen) and any(derived == 0 for derived, _ in seen)


class _StopAfter(StoppingCriteria):
    """Met at the first generated token equal to ``token`` (a criterion plain decoding checks token by token)."""

    def __init__(self, prompt_length: int, token: int):
        self.prompt_length, self.token = prompt_length, token

    def __call__(self, input_ids, scores, **kwargs):
        generated = input_ids[0, self.prompt_length :]
        return (generated[-1:] == self.token).any()[None] if generated.numel() else torch.zeros(1, dtype=torch.bool)


def test_the_stop_check_reads_the_host_once_per_round_and_stops_where_plain_stops(models, use_policy):
    target, drafter = models
    check = _device_check()
    view = drafter.with_policy(POLICIES["default"])
    several = 0
    for seed, loop in [(10, False), (15, False), (16, True), (17, False)]:  # answers with a new token after the 8th
        prompt = _prompt(seed, loop)
        answer = target.generate(prompt, max_new_tokens=NEW, do_sample=False)[0, prompt.shape[1] :].tolist()
        token = next(t for i, t in enumerate(answer) if i >= 8 and t not in answer[:i])  # first seen mid-answer
        criteria = lambda: StoppingCriteriaList([_StopAfter(prompt.shape[1], token)])  # noqa: E731
        plain = target.generate(prompt, max_new_tokens=NEW, do_sample=False, stopping_criteria=criteria())
        assert 8 < plain.shape[1] - prompt.shape[1] < NEW
        use_policy(ProposalPolicy(torch.cat([prompt, torch.tensor([answer])], dim=1), "all", 96, seed=seed))
        with check.counting_host_syncs(cuda=False, methods=((PerTokenStopping, "__call__"),)) as counts:
            out = target.generate(prompt, assistant_model=view, max_new_tokens=NEW, do_sample=False,
                                  stopping_criteria=criteria())
        assert out.tolist() == plain.tolist()
        assert counts["steps"] > 0 and max(counts["per_step"]) <= 1, counts["per_step"]
        several += view.last_stats.rounds < out.shape[1] - prompt.shape[1] - 1
    assert several, "rounds must commit several tokens for the check to mean anything"
