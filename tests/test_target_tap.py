"""The one target-feature tap (:func:`~hf_retrace.generation.target_features.extract_context_feature`): the features
the drafter reads inside ``generate`` (from the verification pass's outputs, or from forward hooks where transformers
has no ``requires_model_outputs``) are identical to those training computes for the same tokens."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_drafter, tiny_target

from hf_retrace.generation import target_features
from hf_retrace.generation.target_features import TargetTap
from hf_retrace.training.features import tapped_hidden_states


@pytest.fixture(params=["model_outputs", "hooks"])
def source(request, monkeypatch):
    if request.param == "hooks":
        monkeypatch.setattr(target_features, "loop_hands_model_outputs", lambda: False)
    elif not target_features.loop_hands_model_outputs():
        pytest.skip("this transformers has no requires_model_outputs protocol (the hooks run covers it)")
    return request.param


def test_generate_and_training_tap_identical_features(source, monkeypatch):
    target = tiny_target(seed=0, logit_scale=4.0)
    layer_ids = [0, 2, 3]  # the last layer too: read after the final norm on both paths
    drafter = tiny_drafter(target, target_layer_ids=layer_ids)
    windows = []
    window = TargetTap.window

    def recorded_window(self, model_outputs):
        windows.append(window(self, model_outputs))
        return windows[-1]

    monkeypatch.setattr(TargetTap, "window", recorded_window)
    prompt = torch.randint(0, 95, (1, 11), generator=torch.Generator().manual_seed(0))
    target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter, max_new_tokens=6,
                    do_sample=False)

    prefill = windows[0]  # the first window the drafter reads: the prefill's rows, every prompt token
    training = tapped_hidden_states(target, prompt, None, layer_ids)
    assert prefill.shape == training.shape == (1, prompt.shape[1], 3 * target.config.hidden_size)
    assert torch.equal(prefill, training)


def test_a_layer_the_target_lacks_is_refused_by_training_and_by_generate_alike():
    from hf_retrace.configuration import drafter_target_mismatches

    target = tiny_target(dtype=torch.float32)
    layers = target.config.num_hidden_layers
    with pytest.raises(ValueError, match=rf"target_layer_ids \[0, {layers}\] out of range for a {layers}-layer target"):
        tapped_hidden_states(target, torch.tensor([[1, 2, 3]]), None, [0, layers])
    drafter = tiny_drafter(target)
    drafter.config.target_layer_ids = [0, layers]
    assert any(f"target_layer_ids [{layers}] out of range" in p
               for p in drafter_target_mismatches(drafter.config, target.config))
