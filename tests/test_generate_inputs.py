"""Every input of a ``generate`` call with a drafter is lossless or refused in words before any work (issue 42).

Prompts given as embeddings, empty and malformed prompts, ids outside the vocabulary: refused by
``checks.check_inputs`` before the target's first forward and before the round policy is resolved (first-use tuning
measures the machine for seconds; no refusal needs it). Embeddings with their ids, and ``output_attentions``, give
what plain ``generate`` gives (float64 tiny targets).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import ProposalPolicy, StopAtLength, tiny_drafter, tiny_target
from packaging import version
from transformers import DynamicCache, StoppingCriteriaList

from hf_retrace.generation import policy as round_policy

VOCAB = 96
TRANSFORMERS_5 = version.parse(transformers.__version__).release >= (5,)  # 4.x refuses inputs_embeds, position_ids
EOS = 5  # the embedded target has an EOS; the prompt-as-embeddings crash needed one


@pytest.fixture(scope="module")
def target():
    model = tiny_target(seed=0, logit_scale=4.0)
    model.generation_config.eos_token_id = EOS
    return model


def _prompt(length: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(6, VOCAB - 1, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def resolver_calls(use_dispatch):
    """Count how often a call's round policy is resolved (where first-use tuning runs); the drafter's shipped policy."""
    calls = {"n": 0}

    def resolver(drafter, target, generation_config, **context):
        calls["n"] += 1
        return round_policy.shipped_policy(drafter.config)

    use_dispatch(resolver=resolver)
    return calls


def _cases(target) -> dict[str, tuple[dict, str]]:
    """name -> (generate inputs, what the refusal says)."""
    prompt = _prompt()
    embeds = target.get_input_embeddings()(prompt).detach()
    padded = torch.ones_like(prompt)
    padded[0, 0] = 0
    cache = DynamicCache()
    with torch.no_grad():
        target(prompt[:, :3], past_key_values=cache, use_cache=True)
    return {
        "inputs_embeds only": (dict(inputs_embeds=embeds),
                               r"inputs_embeds without input_ids \(7 embedded positions\).*Pass the prompt's token ids "
                               r"as input_ids"),
        "inputs_embeds longer than input_ids": (dict(input_ids=prompt[:, :3], inputs_embeds=embeds),
                                                "inputs_embeds covers 7 positions but input_ids 3"),
        "empty prompt": (dict(input_ids=prompt[:, :0]),
                         r"prompt is empty \(input_ids of shape \[1, 0\]\).*at least one"),
        "empty embeddings": (dict(inputs_embeds=embeds[:, :0]), r"prompt is empty"),
        "3-D input_ids": (dict(input_ids=prompt[None]), r"2-D tensor \[1, prompt tokens\], got shape \[1, 1, 7\]"),
        "float input_ids": (dict(input_ids=prompt.float()), "must hold token ids .*got torch.float32"),
        "id past the vocabulary": (dict(input_ids=torch.tensor([[7, VOCAB + 4, 9]])),
                                   rf"token id {VOCAB + 4}, outside the target's vocabulary \(ids 0..{VOCAB - 1}\)"),
        "negative id": (dict(input_ids=torch.tensor([[7, -1, 9]])), "token id -1, outside the target's vocabulary"),
        "right-padded batch of 2": (dict(input_ids=prompt.repeat(2, 1), attention_mask=torch.tensor(  # issue 39
            [[1] * 7, [1] * 6 + [0]])), r"not left padding.*padding_side='left'"),
        "left-padded batch of 1": (dict(input_ids=prompt, attention_mask=padded), r"padding \(1 of 7 positions "
                                   r"masked\).*input_ids\[:, attention_mask\[0\].bool\(\)\]"),
        "pre-filled cache": (dict(input_ids=prompt, past_key_values=cache), "pre-filled cache"),
        "attention_mask of another prompt": (dict(input_ids=prompt, attention_mask=torch.ones(1, 4, dtype=torch.long)),
                                             "(attention_mask has shape|position_ids cover 4 positions but the prompt "
                                             "has 7 tokens)"),
        "position_ids of another prompt": (dict(input_ids=prompt, position_ids=torch.arange(5)[None]),
                                           "position_ids cover 5 positions but the prompt has 7 tokens"),
    }


CASE_NAMES = sorted(_cases(tiny_target(seed=0)))


@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_inputs_are_refused_in_words_before_any_forward_and_before_tuning(case, target, count_forwards,
                                                                               resolver_calls):
    inputs, message = _cases(target)[case]
    drafter = tiny_drafter(target, block_size=4)
    target_forwards, drafter_forwards = count_forwards(target), count_forwards(drafter)
    with pytest.raises(ValueError, match=message):
        target.generate(**inputs, assistant_model=drafter, max_new_tokens=6, do_sample=False)
    assert target_forwards["n"] == drafter_forwards["n"] == 0, "a forward ran before the refusal"
    assert resolver_calls["n"] == 0, "the round policy (first-use tuning) was resolved before the refusal"
    good = target.generate(_prompt(), assistant_model=drafter, max_new_tokens=6, do_sample=False)  # the control
    assert resolver_calls["n"] == 1 and good.shape[1] == 7 + 6


@pytest.mark.skipif(not TRANSFORMERS_5,
                    reason="4.x refuses inputs_embeds with a drafter (tests/test_kwargs_fuzz.py checks the refusal)")
@pytest.mark.parametrize("soft", [False, True])
def test_inputs_embeds_with_their_ids_equal_plain(soft, target, use_policy):
    """The target reads the embeddings, the drafter the ids: plain's output, also for a soft prompt (embeddings that
    are no row of the table), with multi-token rounds accepted."""
    prompt = _prompt(9, seed=3)
    embeds = target.get_input_embeddings()(prompt).detach()
    if soft:
        noise = torch.randn(embeds.shape, generator=torch.Generator().manual_seed(1), dtype=embeds.dtype)
        embeds = embeds + 0.5 * noise
    kwargs = dict(input_ids=prompt, inputs_embeds=embeds, max_new_tokens=16, do_sample=False)
    reference = target.generate(**kwargs)
    assert reference.shape[1] == prompt.shape[1] + 16
    if soft:
        assert reference.tolist() != target.generate(prompt, max_new_tokens=16, do_sample=False).tolist(), \
            "the soft prompt does not change the output: nothing tested"
    use_policy(ProposalPolicy(reference, "partial", VOCAB, seed=2))
    drafter = tiny_drafter(target, block_size=4)
    out = target.generate(**kwargs, assistant_model=drafter)
    assert out.tolist() == reference.tolist()
    assert max(drafter.last_stats.acceptance_lengths) > 1


def _attention_kwargs(prompt_length: int, stop_at: int | None = None) -> dict:
    kwargs = dict(max_new_tokens=14, do_sample=False, return_dict_in_generate=True, output_attentions=True,
                  output_hidden_states=True)
    if stop_at is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList([StopAtLength(prompt_length + stop_at)])
    return kwargs


@pytest.mark.parametrize("stop_at, cache", [(None, None), (5, None), (None, "static")])
def test_output_attentions_equal_plain(stop_at, cache, use_policy):
    """Attention weights (an eager target) come back per new token as plain returns them, also when a stopping
    criterion ends the call inside an accepted block (the steps past the stop are cut, as the sequence is), and over
    a static cache (plain's rows span the whole cache, zeros past the position)."""
    if cache == "static" and not TRANSFORMERS_5:
        pytest.skip("4.57 swaps a drafted call's static cache for a dynamic one (the fuzzer checks the columns)")
    target = tiny_target(seed=2, logit_scale=4.0)
    target.set_attn_implementation("eager")
    prompt = _prompt(8, seed=4)
    kwargs = _attention_kwargs(prompt.shape[1], stop_at)
    if cache is not None:
        kwargs["cache_implementation"] = cache
    plain = target.generate(prompt, **kwargs)
    use_policy(ProposalPolicy(plain.sequences, "all", VOCAB))  # whole blocks accepted: a stop falls inside one
    drafter = tiny_drafter(target, block_size=4)
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert out.sequences.tolist() == plain.sequences.tolist()
    assert max(drafter.last_stats.acceptance_lengths) > 2
    new_tokens = plain.sequences.shape[1] - prompt.shape[1]
    assert new_tokens == (stop_at or 14)
    for name in ("attentions", "hidden_states"):
        ours, theirs = getattr(out, name), getattr(plain, name)
        assert len(ours) == len(theirs) == new_tokens, name
        for step, (a_step, b_step) in enumerate(zip(ours, theirs)):
            assert len(a_step) == len(b_step), (name, step)
            for layer, (a, b) in enumerate(zip(a_step, b_step)):
                assert a is not None and a.shape == b.shape, (name, step, layer)
                # eager attention takes its softmax in float32: a many-token verify rounds apart by ~3e-8
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{name}[{step}][{layer}]")


def test_output_attentions_without_weights_have_plains_shape(target):
    """An sdpa target computes no attention weights: plain returns one tuple of None per layer per new token (and
    transformers warns); the drafter's call returns the same, not an empty tuple."""
    prompt = _prompt(8, seed=5)
    kwargs = dict(max_new_tokens=9, do_sample=False, return_dict_in_generate=True, output_attentions=True)
    plain = target.generate(prompt, **kwargs)
    # 5.x: one empty tuple per new token; 4.57: one None per new token
    assert len(plain.attentions) == 9 and not any(w is not None for step in plain.attentions for w in step or ())
    drafter = tiny_drafter(target, block_size=4)
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert out.sequences.tolist() == plain.sequences.tolist()
    assert drafter.last_stats.rounds > 0
    assert out.attentions == plain.attentions


def _other_inputs(prompt: torch.Tensor) -> dict[str, dict]:
    """Inputs and settings plain greedy ``generate`` accepts that no other test draws."""
    return {
        "position_ids": dict(position_ids=torch.arange(prompt.shape[1])[None]),
        "bool attention_mask": dict(attention_mask=torch.ones_like(prompt, dtype=torch.bool)),
        "float attention_mask": dict(attention_mask=torch.ones(prompt.shape, dtype=torch.float64)),
        "stock assistant settings": dict(num_assistant_tokens=2, num_assistant_tokens_schedule="heuristic",
                                         assistant_confidence_threshold=0.9, assistant_lookbehind=3,
                                         target_lookbehind=3),
        "beam-only settings": dict(length_penalty=2.0, early_stopping=True),
        "negative_prompt_ids without guidance": dict(negative_prompt_ids=prompt[:, :3]),
        "warpers under greedy": dict(temperature=0.5, top_k=3, top_p=0.5),
        "return_dict_in_generate": dict(return_dict_in_generate=True),
        "low_memory": dict(low_memory=True),
        "disable_compile": dict(disable_compile=True),
        "bos_token_id, no prompt": dict(bos_token_id=7),
    }


@pytest.mark.parametrize("name", sorted(_other_inputs(torch.zeros(1, 3, dtype=torch.long))))
def test_other_inputs_equal_plain(name, target, use_policy):
    prompt = _prompt(9, seed=6)
    inputs = {} if name == "bos_token_id, no prompt" else dict(input_ids=prompt)
    kwargs = dict(max_new_tokens=14, do_sample=False, **inputs, **_other_inputs(prompt)[name])
    reference = target.generate(**kwargs)
    sequences = reference if isinstance(reference, torch.Tensor) else reference.sequences
    use_policy(ProposalPolicy(sequences, "partial", VOCAB, seed=3))
    drafter = tiny_drafter(target, block_size=4)
    if name == "position_ids" and not TRANSFORMERS_5:
        with pytest.raises(ValueError, match="position_ids with a drafter needs transformers 5"):
            target.generate(**kwargs, assistant_model=drafter)
        return
    out = target.generate(**kwargs, assistant_model=drafter)
    assert type(out) is type(reference)
    assert (out if isinstance(out, torch.Tensor) else out.sequences).tolist() == sequences.tolist()
    assert max(drafter.last_stats.acceptance_lengths) > 1, "no multi-token round: nothing was drafted"


def test_the_surface_table_names_only_tests_that_exist():
    """docs/generate-surface.md backs each row with a test: every ``file::test`` and ``fuzz[setting]`` it names
    exists, so the table cannot drift from the suite."""
    import re
    from pathlib import Path

    import test_kwargs_fuzz as fuzz

    tests = Path(__file__).resolve().parent
    table = (tests.parent / "docs" / "generate-surface.md").read_text(encoding="utf-8")
    named = re.findall(r"(test_\w+\.py)::(test_\w+)", table)
    assert len(named) >= 40
    for file, test in named:
        assert re.search(rf"^def {test}\(", (tests / file).read_text(encoding="utf-8"), re.M), f"{file}::{test}"
    cases = set(CASE_NAMES) | set(_other_inputs(torch.zeros(1, 3, dtype=torch.long)))
    for case in re.findall(r"test_generate_inputs\.py::(?:\w+|\.\.\.)\[([^\]]+)\]", table):
        assert case in cases, case
    drawn = set(fuzz.SETTINGS) | set(fuzz.EDGES) | set(fuzz.REFUSAL_NAMES) | {"*", "warpers", "<name>", "setting"}
    for setting in re.findall(r"fuzz\[([^\]]+)\]", table):
        assert setting in drawn, f"fuzz[{setting}]"
