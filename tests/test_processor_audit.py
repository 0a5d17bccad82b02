"""Every logits processor ``generate`` builds from its settings, audited: lossless on drafted prefixes, or refused.

transformers' assisted loop runs the call's logits processors on every drafted prefix: on the target's scores at
each candidate position, and (ours) on the drafter's scores while it proposes. A processor is lossless there when
its output is a function of the prefix it is given (stateless, or state that never depends on the tokens it saw);
otherwise its state advances for drafts the target then rejects, and the output differs from plain ``generate``.

``AUDIT`` lists each processor class ``GenerationMixin._get_logits_processor`` can build (transformers 4.57 and 5.x,
watermarking's two included), the setting that builds it, and the verdict. The tests:

- ``test_audit_lists_every_processor_generate_builds``: the table matches the installed transformers' source;
- ``test_verdict_holds``: a processor replayed on a prefix after calls on rejected drafts returns what it returned
  before (lossless) or something else (refused: that is why);
- ``test_lossless_processor_matches_plain``: built, run on drafted prefixes the target rejected, and the output and
  scores equal plain ``generate`` (sampling entries use ``top_k=1``, a one-hot law; their laws are tested in
  ``tests/test_sampling_law.py``);
- ``test_stateful_processor_is_refused``: hf_retrace's ValueError names the setting, before the target runs.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from helpers import ProposalPolicy, tiny_drafter, tiny_target
from transformers import GenerationMixin, WatermarkingConfig
from transformers.generation import SynthIDTextWatermarkingConfig
from transformers.generation import logits_process

VOCAB = 96
NEW = 24
LOSSLESS, REFUSED = "lossless", "refused"


@dataclass
class Entry:
    """One processor: ``settings(base)`` builds it (``base``: plain greedy new tokens without it); ``context`` are the
    settings it needs to act (EOS, sampling) and stays when the bite is checked against plain without it."""

    verdict: str
    settings: Callable[[list[int]], dict]
    context: Callable[[list[int]], dict] = lambda base: {}
    bites: bool = True  # False: no visible effect on a one-hot law (a cutoff applied after top_k=1)
    prompt_length: int = 9
    refusal_message: str = ""


def same_parity(batch_id: int, ids: torch.Tensor) -> list[int]:
    """A pure ``prefix_allowed_tokens_fn``: only tokens of the last token's parity."""
    return list(range(int(ids[-1]) % 2, VOCAB, 2))


SAMPLED = lambda base: dict(do_sample=True, top_k=1)  # noqa: E731 - a one-hot law: sampling is deterministic
WITH_EOS = lambda base: dict(eos_token_id=base[2], pad_token_id=base[2])  # noqa: E731 - plain stops at token 3
AUDIT: dict[str, Entry] = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": Entry(
        REFUSED, lambda base: dict(guidance_scale=1.5), refusal_message="guidance_scale=1.5"),
    "SequenceBiasLogitsProcessor": Entry(LOSSLESS, lambda base: dict(sequence_bias=[[[base[3]], -10.0]])),
    "EncoderRepetitionPenaltyLogitsProcessor": Entry(LOSSLESS, lambda base: dict(encoder_repetition_penalty=0.5)),
    "RepetitionPenaltyLogitsProcessor": Entry(LOSSLESS, lambda base: dict(repetition_penalty=1.5)),
    "NoRepeatNGramLogitsProcessor": Entry(LOSSLESS, lambda base: dict(no_repeat_ngram_size=2)),
    "EncoderNoRepeatNGramLogitsProcessor": Entry(LOSSLESS, lambda base: dict(encoder_no_repeat_ngram_size=1)),
    "NoBadWordsLogitsProcessor": Entry(LOSSLESS, lambda base: dict(bad_words_ids=[[base[2]], base[5:7]])),
    "MinLengthLogitsProcessor": Entry(LOSSLESS, lambda base: dict(min_length=9 + 8), WITH_EOS),
    "MinNewTokensLengthLogitsProcessor": Entry(LOSSLESS, lambda base: dict(min_new_tokens=8), WITH_EOS),
    "PrefixConstrainedLogitsProcessor": Entry(LOSSLESS, lambda base: dict(prefix_allowed_tokens_fn=same_parity)),
    "ForcedBOSTokenLogitsProcessor": Entry(LOSSLESS, lambda base: dict(forced_bos_token_id=5), prompt_length=1),
    "ForcedEOSTokenLogitsProcessor": Entry(LOSSLESS, lambda base: dict(forced_eos_token_id=base[-1] + 1)),
    "InfNanRemoveLogitsProcessor": Entry(
        LOSSLESS, lambda base: dict(remove_invalid_values=True), lambda base: dict(bad_words_ids=[[base[1]]])),
    "ExponentialDecayLengthPenalty": Entry(
        LOSSLESS, lambda base: dict(exponential_decay_length_penalty=(2, 3.0)),
        lambda base: dict(eos_token_id=base[12], pad_token_id=base[12])),
    "SuppressTokensLogitsProcessor": Entry(LOSSLESS, lambda base: dict(suppress_tokens=[base[1], base[4]])),
    "SuppressTokensAtBeginLogitsProcessor": Entry(LOSSLESS, lambda base: dict(begin_suppress_tokens=[base[0]])),
    "TemperatureLogitsWarper": Entry(LOSSLESS, lambda base: dict(temperature=0.7), SAMPLED),
    "TopKLogitsWarper": Entry(LOSSLESS, lambda base: dict(top_k=1), lambda base: dict(do_sample=True, top_k=0)),
    "TopPLogitsWarper": Entry(LOSSLESS, lambda base: dict(top_p=0.8), SAMPLED, bites=False),
    "MinPLogitsWarper": Entry(LOSSLESS, lambda base: dict(min_p=0.1), SAMPLED, bites=False),
    "TypicalLogitsWarper": Entry(LOSSLESS, lambda base: dict(typical_p=0.8), SAMPLED, bites=False),
    "EpsilonLogitsWarper": Entry(LOSSLESS, lambda base: dict(epsilon_cutoff=0.01), SAMPLED, bites=False),
    "EtaLogitsWarper": Entry(LOSSLESS, lambda base: dict(eta_cutoff=0.01), SAMPLED, bites=False),
    "TopHLogitsWarper": Entry(LOSSLESS, lambda base: dict(top_h=0.5), SAMPLED, bites=False),
    "WatermarkLogitsProcessor": Entry(
        LOSSLESS, lambda base: dict(watermarking_config=WatermarkingConfig(bias=4.0, seeding_scheme="selfhash"))),
    "SynthIDTextWatermarkLogitsProcessor": Entry(
        REFUSED, lambda base: dict(watermarking_config=SynthIDTextWatermarkingConfig(keys=[7, 11, 13], ngram_len=3)),
        refusal_message="SynthID"),
    "LogitNormalization": Entry(LOSSLESS, lambda base: dict(renormalize_logits=True)),
}
INSTALLED = {name: entry for name, entry in AUDIT.items() if hasattr(logits_process, name)}
NAMES = sorted(INSTALLED)


def built_by_generate() -> set[str]:
    """The processor classes the installed ``generate`` can build from its settings (read from its source)."""
    source = inspect.getsource(GenerationMixin._get_logits_processor)
    names = set(re.findall(r"\b([A-Z]\w*(?:Processor|Warper|Penalty|Normalization))\(", source))
    watermarks = (WatermarkingConfig(), SynthIDTextWatermarkingConfig(keys=[1, 2], ngram_len=3))
    return (names - {"LogitsProcessorList"}) | {type(w.construct_processor(VOCAB, "cpu")).__name__ for w in watermarks}


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0, logit_scale=4.0)


def _prompt(length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (1, length), generator=torch.Generator().manual_seed(4))


@pytest.fixture(scope="module")
def bases(target):
    """Plain greedy new tokens per prompt length (what the settings are drawn from, so that they bite)."""
    lengths = {entry.prompt_length for entry in AUDIT.values()}
    return {n: target.generate(_prompt(n), max_new_tokens=NEW, do_sample=False)[0, n:].tolist() for n in lengths}


@pytest.fixture
def record_built(monkeypatch):
    """The processors each ``generate`` call builds, call by call."""
    built: list[list] = []
    original = GenerationMixin._get_logits_processor

    def recording(self, *args, **kwargs):
        processors = original(self, *args, **kwargs)
        built.append(list(processors))
        return processors

    monkeypatch.setattr(GenerationMixin, "_get_logits_processor", recording)
    return built


def _instance(built: list, name: str):
    found = [p for p in built if type(p).__name__ == name]
    assert len(found) == 1, f"{name} was not built by these settings: {[type(p).__name__ for p in built]}"
    return found[0]


# --- the table ------------------------------------------------------------------------------------------------------
def test_audit_lists_every_processor_generate_builds():
    assert built_by_generate() == set(INSTALLED), "a processor generate builds is missing from AUDIT (or gone)"
    assert {name for name, entry in INSTALLED.items() if entry.verdict == REFUSED} == {
        "UnbatchedClassifierFreeGuidanceLogitsProcessor", "SynthIDTextWatermarkLogitsProcessor"}


@pytest.mark.parametrize("name", NAMES)
def test_verdict_holds(name, target, bases, record_built):
    """Replay: the scores for a committed prefix, before and after the processor saw drafts the target rejected."""
    entry = INSTALLED[name]
    prompt = _prompt(entry.prompt_length)
    base = bases[entry.prompt_length]
    target.generate(prompt, max_new_tokens=NEW, **{**entry.context(base), **entry.settings(base)})
    processor = _instance(record_built[-1], name)
    committed = torch.cat([prompt, torch.tensor([base[:3]])], dim=1)
    scores = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    before = processor(committed, scores.clone())
    for rejected in (base[3] + 1, base[3] + 2, base[3] + 3):  # drafts the target then rejects
        processor(torch.cat([committed, torch.tensor([[rejected % VOCAB]])], dim=1), scores.clone())
    after = processor(committed, scores.clone())
    same = torch.equal(torch.nan_to_num(before), torch.nan_to_num(after))
    assert same == (entry.verdict == LOSSLESS), f"{name}: verdict {entry.verdict}, but replay gave same={same}"


def _is_prefix(ids: list[int], sequence: list[int]) -> bool:
    return sequence[: len(ids)] == ids


@pytest.mark.parametrize("name", [n for n in NAMES if INSTALLED[n].verdict == LOSSLESS])
def test_lossless_processor_matches_plain(name, target, bases, record_built, use_policy, monkeypatch):
    entry = INSTALLED[name]
    prompt = _prompt(entry.prompt_length)
    base = bases[entry.prompt_length]
    common = dict(max_new_tokens=NEW, return_dict_in_generate=True, output_scores=True, **entry.context(base))
    settings = {**common, **entry.settings(base)}
    plain = target.generate(prompt, **settings)
    processor = _instance(record_built[-1], name)
    if entry.bites:
        without = target.generate(prompt, **common)
        differs = without.sequences.tolist() != plain.sequences.tolist() or any(
            not torch.equal(a, b) for a, b in zip(without.scores, plain.scores))
        assert differs, f"{name} changes nothing here: nothing tested"

    seen: list[list[int]] = []  # every prefix the processor was called on
    original_call = type(processor).__call__

    def spy(self, input_ids, scores):  # (no *args: LogitsProcessorList would ask for them)
        seen.append(input_ids[0].tolist())
        return original_call(self, input_ids, scores)

    monkeypatch.setattr(type(processor), "__call__", spy)
    use_policy(ProposalPolicy(plain.sequences, "partial", VOCAB, seed=3))
    modes = ["argmax", "sample"] if settings.get("do_sample") else ["argmax"]
    for mode in modes:
        seen.clear()
        drafter = tiny_drafter(target, block_size=5, retrace="random", seed=2)
        drafter.proposal_mode = mode
        out = target.generate(prompt, assistant_model=drafter, **settings)
        assert out.sequences.tolist() == plain.sequences.tolist(), (name, mode)
        assert len(out.scores) == len(plain.scores)
        for step, (a, b) in enumerate(zip(out.scores, plain.scores)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{name} ({mode}) scores[{step}]")
        assert drafter.last_stats.rounds > 0
        final = out.sequences[0].tolist()
        assert any(not _is_prefix(ids, final) for ids in seen), f"{name} never ran on a rejected draft ({mode})"


@pytest.mark.parametrize("name", [n for n in NAMES if INSTALLED[n].verdict == REFUSED])
def test_stateful_processor_is_refused(name, target, bases, count_forwards):
    entry = INSTALLED[name]
    drafter = tiny_drafter(target, block_size=5)
    forwards = count_forwards(target)
    base = bases[entry.prompt_length]
    with pytest.raises(ValueError, match=entry.refusal_message) as refusal:
        target.generate(_prompt(entry.prompt_length), assistant_model=drafter, max_new_tokens=NEW,
                        **{**entry.context(base), **entry.settings(base)})
    assert forwards["n"] == 0, "the target ran before the refusal"
    assert "drop `assistant_model`" in str(refusal.value)  # says what to do


@pytest.mark.parametrize("name", [n for n in NAMES if INSTALLED[n].verdict == REFUSED])
def test_refused_processor_would_change_the_output(name, target, bases, use_policy, monkeypatch):
    """Why the refusal: let the call through, and the output departs from plain generate (or the call fails)."""
    from hf_retrace.generation import checks

    entry = INSTALLED[name]
    prompt = _prompt(entry.prompt_length)
    base = bases[entry.prompt_length]
    settings = dict(max_new_tokens=NEW, do_sample=False, **{**entry.context(base), **entry.settings(base)})
    plain = target.generate(prompt, **settings)
    monkeypatch.setattr(checks, "_refusals", lambda generation_config: [])
    use_policy(ProposalPolicy(plain, "partial", VOCAB, seed=3))
    try:
        out = target.generate(prompt, assistant_model=tiny_drafter(target, block_size=5), **settings)
    except Exception:  # noqa: BLE001 - failing is one way of not being plain generate
        return
    assert out.tolist() != plain.tolist(), f"{name} kept plain's output on drafts: the refusal would not be needed"
