"""Lossless sampling: with a drafter, sampled text follows the target's own distribution (chi-square homogeneity).

A tiny float64 target over 12 tokens, its lm_head scaled so the next-token law is neither uniform nor one-hot
(about [0.33, 0.30, 0.11, ...]). For each proposal mode ("argmax": argmax drafts + sample-and-match; "sample":
sampled drafts + rejection sampling against the returned processed draft logits), with and without
temperature/top-k/top-p, ``N_ASSISTED`` single-sequence assisted calls are compared with ``N_PLAIN`` plain samples
(drawn in one batched plain ``generate`` call, which is cheap and has the same per-row law). The test battery:
the marginals of new tokens #2, #3, #4 (the ones drafting rounds produce; #1 comes from the undrafted prefill)
and the joint law of the pair (#2, #3), each a chi-square homogeneity test; every p-value must exceed 1e-3.

Power: the same battery must *reject* (a) the drafter's own proposal distribution for token #2 (what sampling
would give if drafts were committed unverified) and (b) assisted samples against plain sampling at a slightly
different temperature; and it must *accept* two independent plain samples (calibration). Seeds are fixed, so
every run is deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import DraftLog, scripted_source, tiny_drafter, tiny_target
from scipy.stats import chi2_contingency
from transformers import GenerationConfig


VOCAB = 12
PROMPT = torch.tensor([[3, 7, 1, 9, 4]])
MAX_NEW = 4
BLOCK_SIZE = 4
N_ASSISTED = 600  # single-sequence assisted calls per arm (~10 ms of CPU each)
N_PLAIN = 16000  # plain samples, drawn batched
ALPHA = 1e-3
WARPERS = {
    "untempered": dict(temperature=1.0, top_k=0, top_p=1.0),
    "warped": dict(temperature=0.7, top_k=6, top_p=0.9),
    # a penalty that depends on the sequence, under temperature and top-k
    "penalized": dict(temperature=0.8, top_k=8, top_p=1.0, repetition_penalty=1.3),
    # the cutoff warpers (top-h where this transformers has it)
    "cutoffs": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.02, typical_p=0.95, epsilon_cutoff=0.01,
                    eta_cutoff=0.01, **({"top_h": 0.9} if hasattr(GenerationConfig(), "top_h") else {})),
}
# (proposal mode, warpers, drafter kind, drafter seed). A random drafter proposes poorly; these seeds were picked so
# that every arm accepts a fair share of drafts (0.3-0.6 per call). "random" = a ReTrace module with a non-zero
# output projection: each call's first drafting round is plain DFlash, later rounds fuse the rejected suffix.
ARMS = [  # drafter seeds chosen so that drafts really get accepted (the rejection sampler must be exercised)
    ("argmax", "untempered", "random", 1),
    ("argmax", "warped", "random", 1),
    ("sample", "untempered", None, 5),
    ("sample", "warped", "random", 1),
]
CUTOFF_ARMS = [("sample", "cutoffs", None, 5)]  # drawn after all the others: their seeds stay as they were
# the hybrid: context-lookup rounds (1-gram matches, so they are frequent here) mixed with drafter rounds in one call
LOOKUP_ARMS = [
    ("argmax", "untempered", "random", 1),
    ("sample", "warped", None, 5),
]
# a drafter whose vocabulary is a subset (DRAFT_VOCAB of the VOCAB tokens): its proposals never leave it, the target's
# own tokens outside it come from the correction (the residual law) alone
DRAFT_VOCAB = 8
DRAFT_VOCAB_ARMS = [
    ("sample", "penalized", None, 5),
    ("argmax", "penalized", "random", 1),
]
# the accelerator's round order (drafter first, one transfer to the host; forced on the CPU), hybrid with lookup
ONE_TRANSFER_ARMS = [("argmax", "warped", "random", 1)]
SHIFTED_TEMPERATURE = 1.3  # the power check's "slightly wrong" sampler


# --- the statistical test -------------------------------------------------------------------------------------------
def _pooled_table(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """2 x C contingency table of category counts; categories too rare for the chi-square approximation are pooled.

    A category is kept on its own only when its expected count in the smaller sample is at least 5; the rest form
    one extra column (folded into the rarest kept column if that pool is itself too small).
    """
    cats, codes = np.unique(np.concatenate([a, b]), return_inverse=True)
    table = np.zeros((2, len(cats)), dtype=np.int64)
    np.add.at(table[0], codes[: len(a)], 1)
    np.add.at(table[1], codes[len(a) :], 1)
    small_share = min(len(a), len(b)) / (len(a) + len(b))
    expected_small = table.sum(0) * small_share
    order = np.argsort(-expected_small)
    keep = [c for c in order if expected_small[c] >= 5]
    rest = [c for c in order if expected_small[c] < 5]
    columns = [table[:, c] for c in keep]
    if rest:
        pooled = table[:, rest].sum(1)
        if pooled.sum() * small_share >= 5 or not columns:
            columns.append(pooled)
        else:
            columns[-1] = columns[-1] + pooled
    return np.stack(columns, axis=1)


def homogeneity_p(a: np.ndarray, b: np.ndarray) -> float:
    """p-value of the chi-square test that two samples of categories come from the same law."""
    table = _pooled_table(np.asarray(a), np.asarray(b))
    if table.shape[1] < 2:
        return 1.0  # one category only in both samples: identical (degenerate) laws
    return float(chi2_contingency(table, correction=False).pvalue)


def law_battery(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """p-values of the battery on new-token matrices ``[n, MAX_NEW]``: marginals of #2..#4 and the pair (#2, #3)."""
    pvalues = {f"#{i + 1}": homogeneity_p(a[:, i], b[:, i]) for i in range(1, MAX_NEW)}
    pvalues["(#2,#3)"] = homogeneity_p(a[:, 1] * VOCAB + a[:, 2], b[:, 1] * VOCAB + b[:, 2])
    return pvalues


# --- samples ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=VOCAB, num_layers=2, hidden_size=32, seed=0, logit_scale=20.0)


def _plain_samples(target, n: int, seed: int, prompt: torch.Tensor = PROMPT, **sampling) -> np.ndarray:
    torch.manual_seed(seed)
    out = target.generate(prompt.repeat(n, 1), do_sample=True, max_new_tokens=MAX_NEW, **sampling)
    assert out.shape == (n, prompt.shape[1] + MAX_NEW)
    return out[:, prompt.shape[1] :].numpy()


def lookup_prompt(target) -> torch.Tensor:
    """PROMPT, the target's greedy continuation of it, PROMPT again: lookup then proposes likely tokens."""
    greedy = target.generate(PROMPT, do_sample=False, max_new_tokens=6)
    return torch.cat([greedy, PROMPT], dim=1)


@pytest.fixture(scope="module")
def plain_lookup(target):
    """Plain sampling after the lookup arms' prompt, per warper set (seeded)."""
    prompt = lookup_prompt(target)
    return {name: _plain_samples(target, N_PLAIN, seed=400 + i, prompt=prompt, **kw)
            for i, (name, kw) in enumerate(WARPERS.items()) if name in {warp for _, warp, _, _ in LOOKUP_ARMS}}


@pytest.fixture(scope="module")
def plain(target):
    """Plain sampling, per warper set (seeded)."""
    return {name: _plain_samples(target, N_PLAIN, seed=100 + i, **kw) for i, (name, kw) in enumerate(WARPERS.items())}


@pytest.fixture(scope="module")
def assisted(target):
    """Per arm: the assisted new tokens ``[N_ASSISTED, MAX_NEW]``, the drafts of token #2, and acceptance counts."""
    results = {}
    arms = [(*arm, False, None, False) for arm in ARMS] + [(*arm, True, None, False) for arm in LOOKUP_ARMS]
    arms += [(*arm, False, DRAFT_VOCAB, False) for arm in DRAFT_VOCAB_ARMS]
    arms += [(*arm, False, None, False) for arm in CUTOFF_ARMS] + [(*arm, True, None, True) for arm in ONE_TRANSFER_ARMS]
    for arm_index, (mode, warp, retrace, drafter_seed, lookup, draft_vocab_size, one_transfer) in enumerate(arms):
        drafter = tiny_drafter(target, block_size=BLOCK_SIZE, seed=drafter_seed, retrace=retrace,
                               draft_vocab_size=draft_vocab_size)
        drafter.proposal_mode = mode
        drafter.config.lookup, drafter.config.lookup_min_ngram = lookup, 2
        log = DraftLog()
        drafter = drafter.with_policy(one_transfer=one_transfer).with_drafter_source(scripted_source(log=log))
        prompt = lookup_prompt(target) if lookup else PROMPT
        lookup_rounds = 0
        tokens = np.empty((N_ASSISTED, MAX_NEW), dtype=np.int64)
        rounds = accepted = full_blocks = fused = 0
        torch.manual_seed(1000 + arm_index)
        for i in range(N_ASSISTED):
            out = target.generate(
                prompt, assistant_model=drafter, do_sample=True, max_new_tokens=MAX_NEW, **WARPERS[warp]
            )
            tokens[i] = out[0, prompt.shape[1] :].numpy()
            stats = drafter.last_stats
            rounds += stats.rounds
            accepted += sum(length - 1 for length in stats.acceptance_lengths)
            full_blocks += sum(a == d and d > 0 for a, d, _ in stats.round_log)
            fused += stats.rounds_with_fused_suffix
            lookup_rounds += stats.lookup_rounds
        key = (mode, warp, "lookup") if lookup else (mode, warp)
        key = (mode, warp, "draft_vocab") if draft_vocab_size else key
        key = (mode, warp, "one transfer") if one_transfer else key
        results[key] = dict(
            lookup_rounds=lookup_rounds,
            tokens=tokens,
            # the first drafting round: its slot 1 proposes token #2
            first_drafts=np.array([drafts[0] for length, drafts in log.choices if length == PROMPT.shape[1] + 1]),
            rounds=rounds,
            accepted=accepted,
            full_blocks=full_blocks,
            fused=fused,
            retrace=retrace,
            draft_vocab=None if drafter.draft_vocab is None else set(drafter.draft_vocab.tolist()),
        )
    return results


# --- the tests ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,warp", [(m, w) for m, w, _, _ in ARMS + CUTOFF_ARMS])
def test_assisted_sampling_follows_the_target_law(mode, warp, assisted, plain):
    arm = assisted[(mode, warp)]
    # the drafter really takes part: drafting rounds ran, drafts were accepted, sometimes a whole block
    assert arm["rounds"] >= N_ASSISTED, arm
    assert arm["accepted"] > 0.1 * N_ASSISTED, arm
    assert arm["full_blocks"] > 0, arm
    if arm["retrace"] is not None:
        assert arm["fused"] > 0, "the ReTrace arm never fused a rejected suffix"
    pvalues = law_battery(arm["tokens"], plain[warp])
    assert min(pvalues.values()) > ALPHA, f"{mode}/{warp}: assisted sampling departs from plain sampling: {pvalues}"


@pytest.mark.parametrize("mode,warp,order", [(m, w, "lookup") for m, w, _, _ in LOOKUP_ARMS]
                         + [(m, w, "one transfer") for m, w, _, _ in ONE_TRANSFER_ARMS])
def test_hybrid_sampling_follows_the_target_law(mode, warp, order, assisted, plain_lookup):
    """Rounds that switch between context lookup and the drafter inside one call keep the target's law (in the CPU's
    round order and in the accelerator's)."""
    arm = assisted[(mode, warp, order)]
    summary = {k: arm[k] for k in ("rounds", "lookup_rounds", "accepted", "full_blocks")}
    assert 0.1 * arm["rounds"] < arm["lookup_rounds"] < 0.9 * arm["rounds"], f"both sources must draft: {summary}"
    assert arm["accepted"] > 0.1 * N_ASSISTED and arm["full_blocks"] > 0, summary
    pvalues = law_battery(arm["tokens"], plain_lookup[warp])
    assert min(pvalues.values()) > ALPHA, f"hybrid {mode}/{warp}: departs from plain sampling: {pvalues}"


@pytest.mark.parametrize("mode,warp", [(m, w) for m, w, _, _ in DRAFT_VOCAB_ARMS])
def test_draft_vocabulary_sampling_follows_the_target_law(mode, warp, assisted, plain):
    """A drafter that can only propose DRAFT_VOCAB of the tokens, under a repetition penalty, temperature and top-k:
    the target's tokens outside the draft vocabulary still come at their own rates."""
    arm = assisted[(mode, warp, "draft_vocab")]
    inside = np.isin(plain[warp], list(arm["draft_vocab"]))
    assert 0.05 < 1 - inside.mean() < 0.95, "the target's law must put mass inside and outside the draft vocabulary"
    assert set(arm["first_drafts"].tolist()) <= arm["draft_vocab"], "a proposal left the draft vocabulary"
    assert arm["rounds"] >= N_ASSISTED and arm["accepted"] > 0.1 * N_ASSISTED and arm["full_blocks"] > 0, arm
    assert not np.isin(arm["tokens"], list(arm["draft_vocab"])).all(), "no token from outside the draft vocabulary"
    pvalues = law_battery(arm["tokens"], plain[warp])
    assert min(pvalues.values()) > ALPHA, f"draft vocabulary {mode}/{warp}: departs from plain sampling: {pvalues}"


def test_warpers_shape_the_law(assisted, plain):
    """Sanity: top-k/top-p really cut tokens off, and the assisted samples never produce a cut token."""
    for position in range(MAX_NEW):
        support = set(np.unique(plain["warped"][:, position]).tolist())
        assert len(support) < VOCAB
        for mode in ("argmax", "sample"):
            assert set(np.unique(assisted[(mode, "warped")]["tokens"][:, position]).tolist()) <= support


def test_power_two_plain_samples_pass(target, plain):
    """Calibration: an independent plain sample of the assisted arms' size passes the battery."""
    for i, (name, kw) in enumerate(WARPERS.items()):
        other = _plain_samples(target, N_ASSISTED, seed=200 + i, **kw)
        pvalues = law_battery(other, plain[name])
        assert min(pvalues.values()) > ALPHA, (name, pvalues)


@pytest.mark.parametrize("warp", ["untempered", "warped"])
def test_power_draft_proposals_are_rejected(warp, assisted, plain):
    """Committing the drafter's sampled proposals unverified would be caught: their law of token #2 is rejected."""
    drafts = assisted[("sample", warp)]["first_drafts"]
    assert len(drafts) >= 0.9 * N_ASSISTED  # almost every call drafts token #2 in its first round
    p = homogeneity_p(drafts, plain[warp][:, 1])
    assert p < ALPHA, f"the test cannot tell the draft's proposal law from the target's (p={p})"


@pytest.fixture(scope="module")
def shifted(target):
    return _plain_samples(target, N_PLAIN, seed=300, **{**WARPERS["untempered"], "temperature": SHIFTED_TEMPERATURE})


@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_power_shifted_temperature_is_rejected(mode, assisted, shifted):
    """A sampler that is only slightly off (temperature 1.3 instead of 1.0) fails the same battery."""
    pvalues = law_battery(assisted[(mode, "untempered")]["tokens"], shifted)
    assert min(pvalues.values()) < ALPHA, f"temperature {SHIFTED_TEMPERATURE} was not detected: {pvalues}"
