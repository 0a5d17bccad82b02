"""Every unsupported call fails with a message that says what was wrong and what to do, before any target work."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_drafter, tiny_target
from transformers import DynamicCache, GenerationConfig


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


def test_right_padded_batch(target, count_forwards):  # a left-padded batch runs (issue 39, tests/test_batched.py)
    drafter = tiny_drafter(target)
    batch, mask = torch.randint(0, 95, (2, 6)), torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    _refused(target, count_forwards, "not left padding", input_ids=batch, attention_mask=mask, assistant_model=drafter)


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


def test_assistant_tokenizer_is_refused_by_transformers_in_words(target, prompt, count_forwards):
    """A drafter shares the target's vocabulary (checked): transformers itself says to drop the tokenizer pair."""
    _refused(target, count_forwards, "`assistant_tokenizer` is not required", input_ids=prompt,
             assistant_model=tiny_drafter(target), assistant_tokenizer=object(), tokenizer=object(), max_new_tokens=4)


def test_drafter_generate_called_directly(target, prompt):
    drafter = tiny_drafter(target)
    with pytest.raises(TypeError, match="cannot generate on its own.*assistant_model=drafter"):
        drafter.generate(prompt)


def test_bad_proposal_mode(target):
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match=r"proposal_mode must be one of \('argmax', 'sample'\), got 'beam'"):
        drafter.proposal_mode = "beam"
    assert drafter.proposal_mode == "argmax"
    drafter.config.proposal_mode = "beam"  # a hand-edited config.json is refused when a drafter is built from it
    with pytest.raises(ValueError, match="proposal_mode must be one of"):
        type(drafter)(drafter.config)


_V5 = hasattr(GenerationConfig(), "use_mtp")  # settings transformers 4.57 does not have


@pytest.mark.parametrize("setting", [{"prompt_lookup_num_tokens": 10}, {"assistant_early_exit": 2}]
                         + ([{"use_mtp": True}] if _V5 else [])
                         + ([{"speculation_type": "mtp"}] if hasattr(GenerationConfig(), "speculation_type") else []))
def test_drafter_with_another_speculation_setting(target, prompt, count_forwards, setting):
    """A drafter plus another speculation setting is refused (it used to be silently preferred)."""
    drafter = tiny_drafter(target)
    name = next(iter(setting))
    _refused(target, count_forwards, f"another speculation setting \\({name}=", input_ids=prompt,
             assistant_model=drafter, max_new_tokens=4, **setting)


@pytest.mark.parametrize("setting, match", [
    ({"use_cache": False}, "use_cache=False: .*verifies each drafted block against the target's KV cache"),
    ({"dola_layers": "high"}, "dola_layers='high': .*silently ignored"),
] + ([({"do_sample": True, "assistant_ensemble_weight": 0.5}, "assistant_ensemble_weight=0.5: .*lossless")] if _V5 else []))
def test_settings_that_a_drafter_would_ignore_or_make_lossy(target, prompt, count_forwards, setting, match):
    """Without the refusal, transformers fails late (use_cache), ignores the setting (DoLa), or departs from the
    target's law (ensemble verification)."""
    _refused(target, count_forwards, match, input_ids=prompt, assistant_model=tiny_drafter(target), max_new_tokens=4,
             **setting)


def test_uninstall_removes_only_our_own_layer(target, prompt):
    """A third-party wrapper made with functools.wraps (which copies our marker) survives uninstall()."""
    import functools

    from transformers import GenerationMixin

    from hf_retrace.generation import dispatch

    name = "_get_candidate_generator"
    ours = GenerationMixin.__dict__[name]
    installed = dispatch.installed()
    dependencies = dict(resolver=installed.resolver, observer=installed.observer)
    calls = {"n": 0}

    @functools.wraps(ours)
    def third_party(self, *args, **kwargs):
        calls["n"] += 1
        return ours(self, *args, **kwargs)

    setattr(GenerationMixin, name, third_party)
    try:
        with pytest.warns(UserWarning, match="wrapped by another library"):
            assert dispatch.uninstall() is False
        assert GenerationMixin.__dict__[name] is third_party, "uninstall removed another library's wrapper"
        drafter = tiny_drafter(target)
        reference = target.generate(prompt, max_new_tokens=8, do_sample=False)
        out = target.generate(prompt, assistant_model=drafter, max_new_tokens=8, do_sample=False)
        assert out.tolist() == reference.tolist() and calls["n"] == 1 and drafter.last_stats is not None
    finally:
        setattr(GenerationMixin, name, ours)
        dispatch.install(**dependencies)
    assert dispatch.uninstall() is True
    assert not hasattr(GenerationMixin.__dict__[name], dispatch._WRAPPED)
    dispatch.install(**dependencies)
    assert GenerationMixin.__dict__[name] is not ours and id(GenerationMixin.__dict__[name]) in dispatch._OURS
    assert dispatch.installed() == installed


@pytest.mark.parametrize("where", ["drafter", "target"])
def test_an_exception_at_round_k_leaves_no_hooks_and_the_next_call_is_plain(where, monkeypatch):
    """On the hooks path (transformers 4.57), hooks go in a finally on every exit path, not at garbage collection."""
    import gc

    from hf_retrace.generation import target_features

    monkeypatch.setattr(target_features, "loop_hands_model_outputs", lambda: False)
    target = tiny_target(seed=7, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=4)
    prompt = torch.randint(0, 95, (1, 8), generator=torch.Generator().manual_seed(1))
    reference = target.generate(prompt, max_new_tokens=30, do_sample=False)
    layers = target_features.decoder_layers(target)
    module = drafter if where == "drafter" else target
    calls = {"n": 0}
    original = module.forward

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom at round 3")
        return original(*args, **kwargs)

    module.forward = failing
    gc.disable()  # hooks must not depend on the generator being collected
    try:
        with pytest.raises(RuntimeError, match="boom at round 3") as raised:
            target.generate(prompt, assistant_model=drafter, max_new_tokens=30, do_sample=False)
        # the caller still holds the traceback (and with it the generator): the hooks must be gone anyway
        assert raised.tb is not None
        assert all(len(layer._forward_hooks) == 0 for layer in layers), "hooks survived the exception"
    finally:
        gc.enable()
        del module.forward
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=30, do_sample=False)
    assert out.tolist() == reference.tolist()
    assert all(len(layer._forward_hooks) == 0 for layer in layers)


def test_absurd_drafter_dimensions_are_refused_before_allocation(target):
    from hf_retrace import ReTraceDrafter

    config = tiny_drafter(target).config
    config.hidden_size, config.intermediate_size = 1_000_000, 4_000_000
    with pytest.raises(ValueError, match="corrupt or not a drafter"):
        ReTraceDrafter(config)
    config.hidden_size = -3
    with pytest.raises(ValueError, match="invalid dimensions"):
        ReTraceDrafter(config)


def test_drafter_loads_safetensors_only(target, tmp_path):
    from hf_retrace import ReTraceDrafter

    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "st")
    assert ReTraceDrafter.from_pretrained(tmp_path / "st") is not None
    drafter.save_pretrained(tmp_path / "bin", safe_serialization=False)
    if not (tmp_path / "bin" / "pytorch_model.bin").exists():
        pytest.skip("this transformers version writes safetensors only")
    with pytest.raises(OSError):
        ReTraceDrafter.from_pretrained(tmp_path / "bin")
