"""The shape of a round: the adaptive block cut, context lookup, and what one round may copy."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import DraftLog, ProposalPolicy, scripted_source, tiny_drafter, tiny_target
from torch.profiler import ProfilerActivity, profile
from transformers import GenerationConfig

from hf_retrace.generation.candidate_generator import ReTraceCandidateGenerator
from hf_retrace.generation.lookup import ContextLookup
from hf_retrace.generation.policy import RoundPolicy


def _brute_force(tokens: list[int], num_tokens: int, min_ngram: int, max_ngram: int) -> tuple[int, list[int]]:
    """Rescan the whole context: the latest earlier occurrence of the longest suffix n-gram."""
    length = len(tokens)
    for n in range(min(max_ngram, length), min_ngram - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 2, n - 2, -1):  # the n-gram's last token strictly before the newest token
            if tokens[end - n + 1 : end + 1] == suffix:
                out = []
                for i in range(num_tokens):
                    j = end + 1 + i
                    out.append(tokens[j] if j < length else out[j - length])
                return n, out
    return 0, []


@pytest.mark.parametrize("seed", range(40))
def test_incremental_lookup_equals_a_rescan(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 20])
    max_ngram, min_ngram = rng.randint(1, 5), 1
    min_ngram = rng.randint(1, max_ngram)
    lookup, tokens = ContextLookup(max_ngram), []
    for _ in range(30):  # rounds commit 1..6 tokens at a time, as verification does
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        tokens += new
        lookup.extend(new)
        num = rng.randint(1, 12)
        assert lookup.propose(num, min_ngram) == _brute_force(tokens, num, min_ngram, max_ngram)


def test_lookup_repeats_a_loop_shorter_than_its_budget():
    lookup = ContextLookup(4)
    lookup.extend([9, 1, 2, 3, 1, 2, 3, 1, 2])
    assert lookup.propose(7, 2) == (4, [3, 1, 2, 3, 1, 2, 3])


def test_lookup_budget_doubles_on_a_full_accept_and_falls_back_on_a_rejection():
    policy = RoundPolicy(lookup=True, lookup_start=1, lookup_cap=6)
    assert policy.next_lookup_budget(drafted=2, accepted=2) == 4
    assert policy.next_lookup_budget(drafted=4, accepted=4) == 6  # capped
    assert policy.next_lookup_budget(drafted=6, accepted=3) == 4  # accepted + 1
    assert policy.replace(lookup_start=2).next_lookup_budget(drafted=6, accepted=0) == 2  # never below the start
    assert RoundPolicy(lookup_start=2, lookup_cap=1).first_lookup_budget() == 1
    assert policy.first_lookup_budget() == 1


def test_lookup_rounds_follow_the_budget_rule():
    """A real generate's lookup rounds draft exactly what next_lookup_budget allowed after the previous one."""
    target = tiny_target(seed=5, logit_scale=4.0)
    policy = RoundPolicy(lookup=True, lookup_min_ngram=1, lookup_start=1, lookup_cap=5)
    drafter = tiny_drafter(target, block_size=4, seed=6).with_policy(policy)
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]])
    target.generate(prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False)
    stats = drafter.last_stats
    rounds = [(source, k, a - 1) for source, k, a in zip(stats.round_sources, stats.draft_lengths, stats.acceptance_lengths)]
    lookups = [r for r in rounds if r[0] == "lookup"]
    assert len(lookups) >= 3 and any(k > 1 for _, k, _ in lookups)  # the budget grew at least once
    budget = 1
    for _, k, accepted in lookups:
        assert k <= budget  # (less only where the output's end cut it)
        budget = policy.next_lookup_budget(k, accepted)


@pytest.mark.parametrize("lookup_cap", [2, 9])
def test_no_round_proposes_more_than_num_drafting_tokens(lookup_cap):
    """transformers >= 5.25 sizes the target cache's rollback record by the generator's ``num_drafting_tokens``: it
    must bound every round, a drafter block's (block - 1) and a lookup copy's (lookup_cap) alike."""
    target = tiny_target(seed=5, logit_scale=4.0)
    policy = RoundPolicy(lookup=True, lookup_min_ngram=1, lookup_start=1, lookup_cap=lookup_cap)
    drafter = tiny_drafter(target, block_size=4, seed=6).with_policy(policy)
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]])
    config = GenerationConfig(max_new_tokens=40, do_sample=False)
    config.max_length = prompt.shape[1] + 40
    bounds = [ReTraceCandidateGenerator(drafter, target, config, None, prompt.shape[1], policy).num_drafting_tokens]
    target.generate(prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False)
    stats = drafter.last_stats
    assert bounds == [max(3, lookup_cap)]
    assert "lookup" in stats.round_sources
    assert max(stats.draft_lengths) <= bounds[0]
    assert lookup_cap < 3 or max(k for s, k in zip(stats.round_sources, stats.draft_lengths) if s == "lookup") > 3


def test_bad_round_settings_fail_when_the_drafter_is_built():
    target = tiny_target()
    drafter = tiny_drafter(target)
    config = drafter.config
    for field, value, words in [
        ("draft_confidence_threshold", 1.5, "in [0, 1)"),
        ("lookup_min_ngram", 0, "lookup_min_ngram"),
        ("lookup_num_tokens", 0, "lookup_num_tokens"),
        ("lookup_start_tokens", 0, "lookup_start_tokens"),
        ("lookup_start_tokens", 99, "in 1..lookup_num_tokens"),
    ]:
        saved = getattr(config, field)
        setattr(config, field, value)
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            config.validate_drafter_fields()
        setattr(config, field, saved)


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.7, 0.99])
def test_confidence_cut_drafts_exactly_the_confident_prefix(threshold):
    """Each round drafts slot 1, then every slot up to (not including) the first below the threshold."""
    target = tiny_target(seed=2, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=8, retrace="random", seed=3)
    drafter.config.draft_confidence_threshold = threshold
    expected: list[int] = []

    class AgainstTheWholeHead(scripted_source()):
        def confident_logits(self, hidden):  # the cut the whole head would give, against the chunked head's cut
            full = self.draft_logits(hidden)
            top = full[0].softmax(-1).amax(-1)
            below = [i for i in range(1, top.shape[0]) if top[i] < threshold]
            expected.append(below[0] if below else top.shape[0])
            kept = super().confident_logits(hidden)
            torch.testing.assert_close(kept, full[:, : kept.shape[1]])
            return kept

    drafter = drafter.with_drafter_source(AgainstTheWholeHead)
    prompt = torch.randint(0, 95, (1, 9), generator=torch.Generator().manual_seed(4))
    reference = target.generate(prompt, max_new_tokens=48, do_sample=False)
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=48, do_sample=False)
    assert out.tolist() == reference.tolist()
    stats = drafter.last_stats
    assert stats.draft_lengths == expected[: stats.rounds]
    if threshold == 0.0:
        assert stats.draft_lengths[0] == 7
    if threshold == 0.99:
        assert min(stats.draft_lengths) == 1


def test_rejected_suffix_lies_inside_the_cut_block():
    """ReTrace keeps only slots the round really drafted: a cut block leaves a shorter (or no) suffix."""
    target = tiny_target(seed=5, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=8, retrace="random", seed=6)
    prompt = torch.randint(0, 95, (1, 6), generator=torch.Generator().manual_seed(7))
    reference = target.generate(prompt, max_new_tokens=60, do_sample=False)
    cuts, seen = torch.Generator().manual_seed(3), []

    class RandomCut(scripted_source(ProposalPolicy(reference, "partial", 96, seed=2), DraftLog())):
        def confident_logits(self, hidden):
            return self.draft_logits(hidden)[:, : int(torch.randint(1, hidden.shape[1] + 1, (1,), generator=cuts))]

        def observe(self, proposal, verdict):
            super().observe(proposal, verdict)
            if proposal.source == self.name and self.carry is not None:
                seen.append((proposal.anchor, len(proposal), self.carry.positions[0].tolist()))

    drafter = drafter.with_drafter_source(RandomCut)
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=60, do_sample=False)
    assert out.tolist() == reference.tolist()
    assert len(set(drafter.last_stats.draft_lengths)) > 3, "the cut must vary"
    assert seen, "no round kept a suffix: the test needs partial acceptance"
    for anchor, drafted, positions in seen:
        assert positions[-1] == anchor + drafted and all(anchor < p <= anchor + drafted for p in positions)


def test_a_round_never_copies_a_weight_sized_tensor():
    """The draft head must see a 2-D input: a 3-D slice takes matmul's batched path, which views the head as a
    ``[1, H, V]`` batch and copies it every round (``aten::copy_`` under ``aten::bmm``; 20-35 ms a round on SmolLM2).

    Fails if any op of a drafted ``generate`` sees the head (or any 2-D drafter weight) as a 3-D batched operand, or
    copies a tensor of its size.
    """
    target = tiny_target(vocab_size=512, hidden_size=64, seed=1, dtype=torch.bfloat16)
    drafter = tiny_drafter(target, block_size=8, draft_vocab_size=300, retrace="random")
    weights = {tuple(sorted(p.shape)) for p in drafter.parameters() if p.dim() == 2} | {(64, 300)}
    prompt = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False)
    assert drafter.last_stats.rounds > 2
    batched = []
    for event in prof.events():
        for shape in event.input_shapes or []:
            if isinstance(shape, list) and len(shape) == 3 and shape[0] == 1:
                if tuple(sorted(shape[1:])) in weights and not (event.name.startswith("aten::_unsafe_view")):
                    batched.append((event.name, shape))
    assert not batched, f"a drafter weight was treated as a batch (and copied) in a round: {sorted(set(map(str, batched)))}"


def test_lookup_never_proposes_a_copy_the_processors_forbid():
    """``no_repeat_ngram_size=2`` bans every bigram already in the context; a lookup copy after a matched bigram
    (min n-gram 2) always starts with one, so no lookup round may be sent, and the output stays plain's."""
    target = tiny_target(seed=5, logit_scale=4.0, dtype=torch.float32)
    policy = RoundPolicy(lookup=True, lookup_min_ngram=2, lookup_start=2, lookup_cap=6)
    drafter = tiny_drafter(target, block_size=4, seed=6, dtype=torch.float32).with_policy(policy)
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]])
    kwargs = dict(max_new_tokens=30, do_sample=False, no_repeat_ngram_size=2)
    plain = target.generate(prompt, **kwargs)
    ours = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert torch.equal(plain, ours)
    assert drafter.last_stats.lookup_rounds == 0 and drafter.last_stats.rounds > 0
