"""A ``generate`` call with a drafter passes through the dispatch once (issue 38, item 6).

transformers reaches three hooks per call (the mode check, the generator builder, the assisted loop); the first opens
one ``DrafterCall`` and the others find it, so the mode check, the drafter/target check, the prompt's checks and the
policy's resolution each run once per call, at batch 1 and for a batch (one prompt check per row), on the installed
transformers. The resolver is the installed dispatch's, injected, never a module global.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import tiny_drafter, tiny_target

import hf_retrace
from hf_retrace.generation import dispatch
from hf_retrace.generation.batched import left_padded
from hf_retrace.generation.policy import shipped_policy

CHECKS = ("check_generation_mode", "check_target", "check_inputs")
PROMPTS = [[5, 9, 14, 2, 7, 7, 30, 9, 14], [11, 12, 13, 40, 2]]


@pytest.fixture
def counted(monkeypatch, use_dispatch):
    """``(counts, asked)``: how often each check ran, and the batch size of each resolver call."""
    counts: Counter = Counter()
    for name in CHECKS:
        def spy(*args, _name=name, _real=getattr(dispatch, name), **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(dispatch, name, spy)
    asked: list[int] = []

    def resolver(drafter, target, generation_config, **context):
        asked.append(context.get("rows", 1))
        return shipped_policy(drafter.config)

    use_dispatch(resolver=resolver)
    return counts, asked


@pytest.mark.parametrize("rows", [1, 2])
def test_each_rule_runs_once_per_call(rows, counted):
    counts, asked = counted
    target = tiny_target(seed=0, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=4)
    batch = left_padded(PROMPTS[:rows], pad=0)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    plain = target.generate(**batch, **kwargs)
    assert not counts and not asked, "a call without a drafter entered the dispatch"
    for call in (1, 2):  # nothing of the first call is found by the second
        out = target.generate(**batch, assistant_model=drafter, **kwargs)
        assert torch.equal(out, plain) and drafter.last_stats.rounds > 0
        assert counts == {"check_generation_mode": call, "check_target": call, "check_inputs": rows * call}
        assert asked == [rows] * call


def test_an_attached_target_under_the_global_hooks_runs_each_rule_once(counted):
    counts, asked = counted
    target = tiny_target(seed=0, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=4)
    prompt = torch.tensor([PROMPTS[0]])
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    seen = []
    dispatch.attach(target, resolver=lambda drafter, target, config, **_: seen.append(1) or shipped_policy(
        drafter.config))
    try:
        out = target.generate(prompt, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    finally:
        hf_retrace.detach(target)
    assert torch.equal(out, plain) and drafter.last_stats.rounds > 0
    assert counts == {"check_generation_mode": 1, "check_target": 1, "check_inputs": 1}
    assert seen == [1] and asked == [], "the attached model's resolver decides its calls"


def test_beam_search_is_refused_before_the_target_runs_and_leaves_no_open_call(counted, count_forwards):
    target = tiny_target(seed=0, logit_scale=4.0)
    forwards = count_forwards(target)
    with pytest.raises(ValueError, match="num_beams=1, or drop `assistant_model`"):
        target.generate(torch.tensor([PROMPTS[1]]), assistant_model=tiny_drafter(target), num_beams=2,
                        max_new_tokens=4)
    assert forwards["n"] == 0 and getattr(dispatch._OPEN, "call", None) is None
