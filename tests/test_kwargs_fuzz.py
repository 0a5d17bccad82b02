"""Losslessness at the edges of ``generate``: a seeded fuzzer over its keyword arguments (float64 tiny targets).

Each case draws a tiny random target and prompt, a drafter (the random drafter itself, or proposals that are right
everywhere, nowhere, or up to a random slot), its round shape (ReTrace, the lookup hybrid, the adaptive block, a
draft vocabulary, argmax or sampled proposals), and a set of ``generate`` settings: ``max_new_tokens`` or
``max_length``, one or several EOS ids, logits processors (bad words, sequence bias, suppressed tokens, forced EOS/BOS,
minimum lengths, penalties, n-gram bans, watermarking, a prefix constraint, a user's own processor), stopping criteria
(one that reads ``scores``) and stop strings, the static cache, ``return_dict_in_generate`` with scores. Then one of
two things must hold:

- the output equals plain ``generate`` with the same settings, token for token (and the scores, when returned), and
  where drawn, plain ``generate`` continuing from the returned cache continues it as it continues plain's;
- the combination is one hf_retrace refuses (``REFUSALS``): the call raises hf_retrace's ValueError, which names the
  setting, before the target runs a single forward.

Sampling cases keep ``top_k=1`` (with other warpers on top): the processed law is one-hot, so sampling is
deterministic and must equal plain ``generate`` too, while the sampling paths run (sample-and-match for argmax
proposals, rejection sampling against the returned draft logits for sampled ones). The laws themselves are tested in
``tests/test_sampling_law.py``.

A failing case reproduces alone: ``pytest tests/test_kwargs_fuzz.py -k "test_kwargs_case[417]"``; ``_case(417)`` and
the assertion message show what was drawn.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from helpers import (
    ProposalPolicy,
    StopAtLength,
    StopAtToken,
    StopWhenUnsure,
    byte_level_tokenizer,
    generate_cache_name,
    returned_cache,
    tiny_drafter,
    tiny_target,
)
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteriaList,
    WatermarkingConfig,
)
from packaging import version
from transformers.generation import SynthIDTextWatermarkingConfig

VOCAB = 96  # the byte-level tokenizer's size, so that stop strings can be drawn
HIDDEN = 32  # the tiny targets' hidden size
NUM_CASES = 1100
REFUSAL_SHARE = 0.1
LONG_NEW_TOKENS = 2500
_HAS = {name: hasattr(GenerationConfig(), name) for name in ("top_h", "use_mtp", "assistant_ensemble_weight")}
_TRANSFORMERS_5 = version.parse(transformers.__version__).release >= (5,)  # 4.x: inputs_embeds refused with a drafter

# settings drawn independently, each with its probability
SETTINGS = {
    "bad_words_ids": 0.2,
    "sequence_bias": 0.2,
    "suppress_tokens": 0.15,
    "suppress_draft_vocabulary": 0.08,  # every token of the draft vocabulary suppressed: no drafter proposal survives
    "begin_suppress_tokens": 0.15,
    "forced_eos_token_id": 0.15,
    "forced_bos_token_id": 0.1,
    "min_new_tokens": 0.2,
    "min_length": 0.1,
    "repetition_penalty": 0.25,
    "encoder_repetition_penalty": 0.1,
    "no_repeat_ngram_size": 0.2,
    "encoder_no_repeat_ngram_size": 0.1,
    "exponential_decay_length_penalty": 0.1,
    "remove_invalid_values": 0.1,
    "renormalize_logits": 0.1,
    "watermark": 0.1,
    "prefix_allowed_tokens_fn": 0.1,
    "user_processor": 0.1,
    "stop_token": 0.15,
    "stop_string": 0.1,
    "max_time": 0.05,
    "static_cache": 0.15,
    "return_scores": 0.15,
}
# drawn from a seed of their own, so that adding them left every other draw of every case as it was
EDGES = {
    "scores_criterion": 0.15,  # a stopping criterion that reads `scores` (return_dict_in_generate + output_scores)
    "continue_from_cache": 0.15,  # a stop at a drawn position, then plain generate continues from the returned cache
    "inputs_embeds": 0.12,  # the prompt's embeddings (exact, or a soft prompt) with its ids: the target reads them
    "output_attentions": 0.12,  # attentions returned per new token (eager targets: the weights; sdpa: none, as plain)
}
WARPERS = {"temperature": 0.5, "top_p": 0.3, "min_p": 0.2, "typical_p": 0.15, "epsilon_cutoff": 0.15,
           "eta_cutoff": 0.15, "top_h": 0.15}  # top_h: 5.x only (left out on 4.57; the draws stay the same)


def _refusals(prompt: torch.Tensor) -> dict[str, tuple[torch.Tensor, dict, str]]:
    """name -> (prompt, generate settings, what hf_retrace's error must say)."""
    padded = torch.ones_like(prompt)
    padded[0, 0] = 0
    table = {
        "num_beams": (prompt, dict(num_beams=2), "num_beams=2"),
        "num_return_sequences": (prompt, dict(do_sample=True, num_return_sequences=2), "num_return_sequences=2"),
        "guidance_scale": (prompt, dict(guidance_scale=1.5), "guidance_scale=1.5"),
        "synthid_watermark": (
            prompt, dict(watermarking_config=SynthIDTextWatermarkingConfig(keys=[7, 11, 13], ngram_len=3)), "SynthID",
        ),
        "use_cache": (prompt, dict(use_cache=False), "use_cache=False"),
        "dola_layers": (prompt, dict(dola_layers="high"), "dola_layers"),
        "prompt_lookup": (prompt, dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens=3"),
        "early_exit": (prompt, dict(assistant_early_exit=1), "assistant_early_exit=1"),
        "batch": (prompt.repeat(2, 1), dict(return_dict_in_generate=True, output_scores=True), "output_scores"),
        "padding": (prompt, dict(attention_mask=padded), "padding"),
        "inputs_embeds_only": (None, dict(inputs_embeds=torch.randn(1, prompt.shape[1], HIDDEN, dtype=torch.float64)),
                               "inputs_embeds without input_ids"),
        "empty_prompt": (prompt[:, :0], {}, "prompt is empty"),
    }
    # 5.x settings; transformers 4.57 refuses them itself, as unknown arguments, also before the target runs
    unknown = "not used by the model"
    table["use_mtp"] = (prompt, dict(use_mtp=True), "use_mtp=True" if _HAS["use_mtp"] else unknown)
    table["ensemble"] = (prompt, dict(do_sample=True, assistant_ensemble_weight=0.5),
                         "assistant_ensemble_weight=0.5" if _HAS["assistant_ensemble_weight"] else unknown)
    return table


REFUSAL_NAMES = sorted(_refusals(torch.zeros(1, 2, dtype=torch.long)))
_targets: dict = {}


def _target(family: str, seed: int, max_position_embeddings: int = 512, attention: str = "sdpa"):
    key = (family, seed, max_position_embeddings, attention)
    if key not in _targets:
        _targets[key] = tiny_target(family=family, vocab_size=VOCAB, num_layers=3, hidden_size=HIDDEN, seed=seed,
                                    logit_scale=4.0, max_position_embeddings=max_position_embeddings)
        _targets[key].set_attn_implementation(attention)
    return _targets[key]


def _case(index: int) -> dict:
    """Everything about case ``index`` that does not depend on the target's output (drawn from its own seed)."""
    rng = random.Random(index)
    block_size = rng.choice([2, 3, 4, 6, 8])
    do_sample = rng.random() < 0.3
    case = dict(
        index=index,
        refusal=rng.choice(REFUSAL_NAMES) if rng.random() < REFUSAL_SHARE else None,
        family=rng.choice(["qwen3", "llama"]),
        target_seed=rng.randrange(2),
        prompt_length=1 if rng.random() < 0.12 else rng.randint(2, 14),
        repeat_prompt=rng.random() < 0.25,  # gives context lookup n-gram matches
        block_size=block_size,
        policy=rng.choice(["drafter", "drafter", "all", "none", "partial"]),
        retrace=rng.choice([None, None, "untrained", "random"]),
        draft_vocab_size=rng.choice([None, None, 48]),
        confidence_threshold=rng.choice([None, None, 0.3, 0.7]),
        lookup=rng.random() < 0.3,
        lookup_min_ngram=rng.choice([1, 2]),
        lookup_num_tokens=rng.choice([2, 4, 10]),
        do_sample=do_sample,
        proposal_mode=rng.choice(["argmax", "sample"]),
        new_tokens=rng.choice([1, 2, max(1, block_size - 1), block_size, block_size + 1, rng.randint(3, 28)]),
        by_max_length=rng.random() < 0.3,
        eos=rng.choice([None, None, "one", "several"]),
        settings=sorted(name for name, p in SETTINGS.items() if rng.random() < p),
        warpers=sorted(name for name, p in WARPERS.items() if rng.random() < p) if do_sample else [],
    )
    edges = random.Random(f"edges-{index}")
    case["edges"] = sorted(name for name, p in EDGES.items() if edges.random() < p)
    inputs = random.Random(f"inputs-{index}")  # a seed of its own: every earlier draw stays as it was
    case["attention"] = inputs.choice(["sdpa", "eager"]) if "output_attentions" in case["edges"] else "sdpa"
    case["soft_prompt"] = "inputs_embeds" in case["edges"] and inputs.random() < 0.5
    if "exponential_decay_length_penalty" in case["settings"] and case["eos"] is None:
        case["eos"] = "one"  # the penalty raises the EOS logit: it needs one
    if "suppress_draft_vocabulary" in case["settings"]:
        case["draft_vocab_size"] = 48
    return case


class PenalizeSuccessor(LogitsProcessor):
    """A user's own stateless processor: lowers the token that would continue the last one (id + 1)."""

    def __init__(self, weight: float):
        self.weight = weight

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[torch.arange(scores.shape[0]), (input_ids[:, -1] + 1) % scores.shape[-1]] -= self.weight
        return scores


class AllowedByLastToken:
    """A pure ``prefix_allowed_tokens_fn``: the allowed set depends on the last token only."""

    def __init__(self, rng: random.Random):
        self.allowed = [sorted(rng.sample(range(VOCAB), 40)) for _ in range(3)]

    def __call__(self, batch_id, input_ids):
        return self.allowed[int(input_ids[-1]) % 3]


def _settings(case: dict, prompt: torch.Tensor, base: list[int], draft_vocab: list[int] | None) -> dict:
    """The case's ``generate`` kwargs; token-valued ones are mostly taken from ``base`` (plain output without them),
    so that they bite."""
    rng = random.Random(f"settings-{case['index']}")
    prompt_length = prompt.shape[1]

    def pick() -> int:
        return rng.choice(base) if base and rng.random() < 0.8 else rng.randrange(VOCAB)

    def bigram() -> list[int]:  # transformers 4.57 wants positive ids in bad words and sequence biases
        pair = base[(j := rng.randrange(len(base) - 1)) : j + 2] if len(base) >= 2 else [pick(), pick()]
        return [token or 1 for token in pair]

    new = case["new_tokens"]
    kwargs: dict = dict(do_sample=case["do_sample"])
    kwargs.update(max_length=prompt_length + new) if case["by_max_length"] else kwargs.update(max_new_tokens=new)
    if case["eos"] is not None:
        eos = [base[len(base) // 2]] if base and case["eos"] == "one" else [pick() for _ in range(rng.randint(2, 3))]
        kwargs.update(eos_token_id=eos[0] if case["eos"] == "one" else eos, pad_token_id=eos[0])
    if case["do_sample"]:
        kwargs["top_k"] = 1  # a one-hot processed law: sampling is deterministic and must equal plain
        draws = dict(temperature=rng.uniform(0.5, 1.5), top_p=rng.uniform(0.3, 0.95), min_p=rng.uniform(0.01, 0.2),
                     typical_p=rng.uniform(0.3, 0.95), epsilon_cutoff=rng.uniform(1e-4, 0.05),
                     eta_cutoff=rng.uniform(1e-4, 0.05), top_h=rng.uniform(0.3, 0.9))
        kwargs.update({name: draws[name] for name in case["warpers"] if name != "top_h" or _HAS["top_h"]})
    s = set(case["settings"])
    if "bad_words_ids" in s:
        kwargs["bad_words_ids"] = [bigram()[:1] if rng.random() < 0.5 else bigram() for _ in range(rng.randint(1, 3))]
    if "sequence_bias" in s:
        kwargs["sequence_bias"] = [[bigram()[1:], rng.uniform(-8, 8)], [bigram(), rng.uniform(-8, 8)]]
    if "suppress_tokens" in s:
        kwargs["suppress_tokens"] = sorted({pick() for _ in range(rng.randint(1, 4))})
    if "suppress_draft_vocabulary" in s and draft_vocab is not None:
        kwargs["suppress_tokens"] = sorted(set(kwargs.get("suppress_tokens", [])) | set(draft_vocab))
    if "begin_suppress_tokens" in s:
        kwargs["begin_suppress_tokens"] = sorted({base[0] if base else pick(), pick()})
    if "forced_eos_token_id" in s:
        kwargs["forced_eos_token_id"] = pick()
    if "forced_bos_token_id" in s:
        kwargs["forced_bos_token_id"] = pick()
    if "min_new_tokens" in s:
        kwargs["min_new_tokens"] = rng.randint(1, new + 2)
    if "min_length" in s:
        kwargs["min_length"] = prompt_length + rng.randint(1, new + 2)
    if "repetition_penalty" in s:
        kwargs["repetition_penalty"] = rng.uniform(0.7, 2.0)
    if "encoder_repetition_penalty" in s:
        kwargs["encoder_repetition_penalty"] = rng.uniform(0.7, 2.0)
    if "no_repeat_ngram_size" in s:
        kwargs["no_repeat_ngram_size"] = rng.randint(1, 3)
    if "encoder_no_repeat_ngram_size" in s:
        kwargs["encoder_no_repeat_ngram_size"] = rng.randint(1, 3)
    if "exponential_decay_length_penalty" in s:
        kwargs["exponential_decay_length_penalty"] = (rng.randint(0, new), rng.uniform(1.05, 2.0))
    if "remove_invalid_values" in s:
        kwargs["remove_invalid_values"] = True
    if "renormalize_logits" in s:
        kwargs["renormalize_logits"] = True
    if "watermark" in s:
        kwargs["watermarking_config"] = WatermarkingConfig(
            bias=rng.uniform(1, 6), seeding_scheme=rng.choice(["lefthash", "selfhash"]), context_width=rng.randint(1, 2)
        )
    if "prefix_allowed_tokens_fn" in s:
        kwargs["prefix_allowed_tokens_fn"] = AllowedByLastToken(rng)
    if "user_processor" in s:
        kwargs["logits_processor"] = LogitsProcessorList([PenalizeSuccessor(rng.uniform(1, 10))])
    forced = {kwargs.get("forced_eos_token_id"), kwargs.get("forced_bos_token_id")}
    for name in ("suppress_tokens", "begin_suppress_tokens"):  # generate refuses to force a suppressed token
        if name in kwargs:
            kwargs[name] = [token for token in kwargs[name] if token not in forced] or None
    if "stop_token" in s:
        kwargs["stopping_criteria"] = StoppingCriteriaList([StopAtToken(pick())])
    if "stop_string" in s and base:
        j = rng.randrange(len(base))
        kwargs.update(stop_strings=[_tokenizer().decode(base[max(0, j - 1) : j + 1])], tokenizer=_tokenizer())
    if "max_time" in s:
        kwargs["max_time"] = 600.0
    if "static_cache" in s:
        kwargs["cache_implementation"] = "static"
    if "return_scores" in s:
        kwargs.update(return_dict_in_generate=True, output_scores=True, output_logits=rng.random() < 0.5)
    edges = random.Random(f"edge-settings-{case['index']}")
    criteria = list(kwargs.get("stopping_criteria", []))
    if "scores_criterion" in case["edges"]:  # these tiny targets' top probabilities lie around 0.02-0.04
        criteria.append(StopWhenUnsure(prompt_length, edges.uniform(0.022, 0.04), min_tokens=edges.randint(1, 4)))
        kwargs.update(return_dict_in_generate=True, output_scores=True)
    if "continue_from_cache" in case["edges"]:  # after a stop at a drawn position: often inside a round
        criteria.append(StopAtLength(prompt_length + edges.randint(1, new)))
        kwargs["return_dict_in_generate"] = True
    if criteria:
        kwargs["stopping_criteria"] = StoppingCriteriaList(criteria)
    if "output_attentions" in case["edges"]:
        kwargs.update(return_dict_in_generate=True, output_attentions=True)
    return kwargs


def _inputs(case: dict, target, prompt: torch.Tensor) -> dict:
    """The prompt as ``generate`` takes it: its ids, or (``inputs_embeds``) its ids with its embeddings, exact or moved
    off every row of the table (a soft prompt)."""
    if "inputs_embeds" not in case["edges"]:
        return dict(input_ids=prompt)
    embeds = target.get_input_embeddings()(prompt).detach()
    if case["soft_prompt"]:
        noise = torch.randn(embeds.shape, generator=torch.Generator().manual_seed(case["index"]), dtype=embeds.dtype)
        embeds = embeds + 0.5 * noise
    return dict(input_ids=prompt, inputs_embeds=embeds)


_TOKENIZER: list = []


def _tokenizer():
    if not _TOKENIZER:
        _TOKENIZER.append(byte_level_tokenizer())
    return _TOKENIZER[0]


def _prompt(case: dict) -> torch.Tensor:
    generator = torch.Generator().manual_seed(case["index"])
    length = case["prompt_length"]
    if case["repeat_prompt"] and length >= 4:
        half = torch.randint(0, VOCAB - 1, (1, length // 2), generator=generator)
        return torch.cat([half, half], dim=1)
    return torch.randint(0, VOCAB - 1, (1, length), generator=generator)


def _drafter(case: dict, target):
    drafter = tiny_drafter(target, block_size=case["block_size"], retrace=case["retrace"], seed=case["index"],
                           draft_vocab_size=case["draft_vocab_size"])
    drafter.config.draft_confidence_threshold = case["confidence_threshold"]
    drafter.config.lookup = case["lookup"]
    drafter.config.lookup_min_ngram = case["lookup_min_ngram"]
    drafter.config.lookup_num_tokens = case["lookup_num_tokens"]
    drafter.proposal_mode = case["proposal_mode"]
    return drafter


def _sequences(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.sequences


def _describe(case: dict, kwargs: dict) -> str:
    plain = (int, float, str, list, tuple, bool)
    shown = {k: (v if isinstance(v, plain) else type(v).__name__) for k, v in kwargs.items()}
    return f"case {case}\nkwargs {shown}"


@pytest.mark.parametrize("index", range(NUM_CASES))
def test_kwargs_case(index, use_policy, count_forwards):
    case = _case(index)
    target = _target(case["family"], case["target_seed"], attention=case["attention"])
    prompt = _prompt(case)
    drafter = _drafter(case, target)

    if case["refusal"] is not None:
        inputs, kwargs, message = _refusals(prompt)[case["refusal"]]
        forwards = count_forwards(target)
        with pytest.raises(ValueError, match=message):
            target.generate(inputs, assistant_model=drafter, max_new_tokens=8, **kwargs)
        assert forwards["n"] == 0, f"the target ran before the refusal: {case}"
        return

    if "inputs_embeds" in case["edges"] and not _TRANSFORMERS_5:
        forwards = count_forwards(target)
        with pytest.raises(ValueError, match="inputs_embeds with a drafter needs transformers 5"):
            target.generate(assistant_model=drafter, max_new_tokens=4, **_inputs(case, target, prompt))
        assert forwards["n"] == 0, f"the target ran before the refusal: {case}"
        return
    length = dict(max_new_tokens=case["new_tokens"])
    base = target.generate(prompt, do_sample=False, **length)[0, prompt.shape[1] :].tolist()
    draft_vocab = None if drafter.draft_vocab is None else drafter.draft_vocab.tolist()
    kwargs = _settings(case, prompt, base, draft_vocab) | _inputs(case, target, prompt)
    try:
        reference = target.generate(**kwargs)
    except Exception as error:  # noqa: BLE001 - plain generate's own failure (e.g. 4.57's NaN exponential decay)
        with pytest.raises(Exception):  # noqa: B017 - it must fail with the drafter too, never return something
            target.generate(assistant_model=drafter, **kwargs)
        pytest.skip(f"plain generate fails on this combination ({type(error).__name__}: {error}); so does ours")
    if case["policy"] != "drafter":
        use_policy(ProposalPolicy(_sequences(reference), case["policy"], VOCAB, seed=index))
    out = target.generate(assistant_model=drafter, **kwargs)
    assert _sequences(out).tolist() == _sequences(reference).tolist(), _describe(case, kwargs)
    if kwargs.get("output_scores"):
        for name in ("scores", "logits") if kwargs.get("output_logits") else ("scores",):
            ours, theirs = getattr(out, name), getattr(reference, name)
            assert len(ours) == len(theirs), (name, _describe(case, kwargs))
            for step, (a, b) in enumerate(zip(ours, theirs)):  # NaN in both where 4.57's exponential decay meets
                message = f"{name}[{step}] {_describe(case, kwargs)}"  # a -inf EOS logit
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True, msg=message)
    if kwargs.get("output_attentions"):
        _assert_attentions_equal(out.attentions, reference.attentions, _describe(case, kwargs))
    stats = drafter.last_stats
    assert stats.new_tokens == _sequences(out).shape[1] - prompt.shape[1]
    assert sum(stats.acceptance_lengths) <= stats.new_tokens - 1 or stats.new_tokens == 1, "tau counts cut tokens"
    if "continue_from_cache" in case["edges"]:
        _assert_continues_as_plain(target, out, reference, _describe(case, kwargs))


def _assert_attentions_equal(ours: tuple, theirs: tuple, description: str) -> None:
    """One entry per new token, one per layer: the weights within float32 softmax rounding, or none where plain has
    none (sdpa)."""
    assert len(ours) == len(theirs), f"attentions: {len(ours)} steps, plain {len(theirs)}\n{description}"
    for step, (a_step, b_step) in enumerate(zip(ours, theirs)):
        assert (a_step is None) == (b_step is None), f"attentions[{step}]\n{description}"  # 4.57's sdpa: None
        a_step, b_step = a_step or (), b_step or ()
        assert len(a_step) == len(b_step), f"attentions[{step}]\n{description}"
        for a, b in zip(a_step, b_step):
            assert (a is None) == (b is None), f"attentions[{step}]\n{description}"
            if a is not None and not _TRANSFORMERS_5 and a.shape[-1] < b.shape[-1]:  # 4.57 swaps a drafted call's
                assert not b[..., a.shape[-1]:].any(), description  # static cache for a dynamic one: plain's
                b = b[..., : a.shape[-1]]  # extra columns are the static cache's empty slots
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"attentions[{step}]\n{description}")


def _assert_continues_as_plain(target, out, reference, description: str) -> None:
    """Plain greedy ``generate`` continuing our output from our returned cache gives what it gives continuing plain's
    output from plain's cache. Where plain's continuation fails (a static cache too short for it), ours fails too, or
    (4.57 swaps a drafted call's static cache for a dynamic one) gives plain's continuation of the sequence alone."""

    def continuation(output, cache=True):
        argument = {generate_cache_name(target): returned_cache(output)} if cache else {}
        return target.generate(output.sequences, **argument, max_new_tokens=4, do_sample=False).tolist()

    try:
        expected = continuation(reference)
    except Exception:  # noqa: BLE001 - plain's own continuation fails
        expected = None
    try:
        ours = continuation(out)
    except Exception:  # noqa: BLE001
        assert expected is None, f"only ours fails to continue from its returned cache\n{description}"
        return
    if expected is None:
        expected = continuation(reference, cache=False)
    assert ours == expected, f"continuation from the returned cache\n{description}"


def test_cases_cover_the_edges():
    """The drawn cases include every setting, warper, refusal, drafter policy and round shape, many times each."""
    cases = [_case(i) for i in range(NUM_CASES)]
    run = [c for c in cases if c["refusal"] is None]
    assert len(run) >= 950
    for name in SETTINGS:
        assert sum(name in c["settings"] for c in run) >= 40, name
    for name in WARPERS:
        assert sum(name in c["warpers"] for c in run) >= 25, name
    for name in EDGES:
        assert sum(name in c["edges"] for c in run) >= 100, name
    assert sum("static_cache" in c["settings"] and "continue_from_cache" in c["edges"] for c in run) >= 10
    assert sum(c["attention"] == "eager" for c in run) >= 40, "attention weights returned, not only sdpa's none"
    assert sum(c["soft_prompt"] for c in run) >= 40, "soft prompts: embeddings that are no row of the table"
    for name in REFUSAL_NAMES:
        assert sum(c["refusal"] == name for c in cases) >= 3, name
    assert {c["policy"] for c in run} == {"drafter", "all", "none", "partial"}
    assert {c["retrace"] for c in run} == {None, "untrained", "random"}
    assert sum(c["lookup"] for c in run) >= 200 and sum(c["confidence_threshold"] is not None for c in run) >= 300
    assert sum(c["draft_vocab_size"] is not None for c in run) >= 250
    masked = [c for c in run if "suppress_draft_vocabulary" in c["settings"]]
    assert sum(c["proposal_mode"] == "sample" and c["do_sample"] for c in masked) >= 5, "sampled drafts, none allowed"
    assert sum(c["do_sample"] and c["proposal_mode"] == "sample" for c in run) >= 120
    assert sum(c["do_sample"] and c["proposal_mode"] == "argmax" for c in run) >= 120
    assert sum(c["by_max_length"] for c in run) >= 250
    assert sum(c["eos"] == "several" for c in run) >= 200 and sum(c["eos"] == "one" for c in run) >= 200
    assert any(c["new_tokens"] == c["block_size"] + 1 for c in run) and any(c["new_tokens"] == 1 for c in run)
    assert sum(c["prompt_length"] == 1 for c in run) >= 80


def test_long_generation_equals_plain():
    """2,500 new tokens on a tiny target: the drafter's context cache, the lookup index and ReTrace's suffix stay
    exact over a long context (greedy, with a repetition penalty, the hybrid and the adaptive block on)."""
    target = _target("llama", 0, max_position_embeddings=4096)
    prompt = torch.randint(0, VOCAB - 1, (1, 12), generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=LONG_NEW_TOKENS, do_sample=False, repetition_penalty=1.05)
    reference = target.generate(prompt, **kwargs)
    assert reference.shape[1] == prompt.shape[1] + LONG_NEW_TOKENS
    drafter = tiny_drafter(target, block_size=6, retrace="random", seed=3)
    drafter.config.lookup = True
    drafter.config.draft_confidence_threshold = 0.3
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert out.tolist() == reference.tolist()
    stats = drafter.last_stats
    assert stats.new_tokens == LONG_NEW_TOKENS
    assert stats.rounds - stats.lookup_rounds > 0 and stats.lookup_rounds > 0, "both sources must draft"
    assert stats.mean_acceptance_length > 1


@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_processors_that_forbid_every_draft_token(mode):
    """``suppress_tokens`` covering the whole draft vocabulary: no drafter round has a token to propose, so the target
    steps alone (sampled proposals used to fail there on a NaN law), and the output is plain's."""
    target = _target("qwen3", 0)
    drafter = tiny_drafter(target, block_size=4, draft_vocab_size=48, seed=5)
    drafter.proposal_mode = mode
    prompt = torch.randint(0, VOCAB - 1, (1, 8), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=12, do_sample=True, top_k=1, temperature=0.8,
                  suppress_tokens=drafter.draft_vocab.tolist())
    reference = target.generate(prompt, **kwargs)
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert out.tolist() == reference.tolist()
    assert drafter.last_stats.rounds == 0 and drafter.last_stats.new_tokens == 12
