"""Where the drafter runs (``generation/placement.py``): beside the target's input embeddings, moved there or refused
before the target runs; draft-vocabulary scores indexed on the ``lm_head``'s device; no copy of a full head when the
drafter's dtype differs from it; ``synchronize`` on the device that is timed.

No GPU here: the second device is the ``meta`` device (real tensors without data), and :class:`OneDevicePerOp` fails
an op whose tensor arguments sit on two devices, as CUDA does (torch on the CPU lets some of them through)."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import tiny_drafter, tiny_target
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LogitsProcessorList

import hf_retrace  # noqa: F401  (the generate hook)
from hf_retrace.generation import checks, placement
from hf_retrace.generation.candidate_generator import ReTraceCandidateGenerator
from hf_retrace.generation.drafter_source import DraftChooser
from hf_retrace.generation.policy import RoundPolicy
from hf_retrace.generation.proposal import Proposal, Verdict

MAX_NEW = 12


class OneDevicePerOp(TorchDispatchMode):
    """Fail any op whose tensor arguments are on more than one device (a 0-dim CPU scalar aside, as CUDA allows)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)}
        assert len(devices) <= 1, f"{func} mixes devices {sorted(map(str, devices))}"
        return func(*args, **kwargs)


@pytest.fixture
def target():
    return tiny_target(dtype=torch.float32, logit_scale=4.0)


@pytest.fixture
def prompt():
    return torch.tensor([[5, 17, 33, 2, 41, 8]])


def _generate(target, prompt, drafter=None):
    kwargs = {} if drafter is None else {"assistant_model": drafter}
    return target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW, do_sample=False,
                           **kwargs)


def _generator(target, drafter, prompt) -> ReTraceCandidateGenerator:
    config = target.generation_config
    config.max_length = prompt.shape[1] + MAX_NEW
    return ReTraceCandidateGenerator(drafter, target, config, None, prompt_length=prompt.shape[1])


# --- the drafter follows the target's input embeddings ---------------------------------------------------------------


def test_a_drafter_elsewhere_is_moved_to_the_input_embeddings_device_with_one_info_line(target, monkeypatch, caplog):
    drafter = tiny_drafter(target, draft_vocab_size=40)
    monkeypatch.setattr(placement, "embedding_device", lambda model: torch.device("meta"))  # the target's "GPU"
    with caplog.at_level(logging.INFO, logger=placement.__name__):
        assert placement.place_drafter(drafter, target) == torch.device("meta")
    assert placement.drafter_devices(drafter) == {torch.device("meta")}  # weights and the draft vocabulary buffer
    lines = [r.getMessage() for r in caplog.records if r.name == placement.__name__]
    assert lines == ["hf_retrace: moved the drafter from cpu to meta, the device of the target's input embeddings"]


def test_a_drafter_already_there_is_left_alone(target, caplog):
    drafter = tiny_drafter(target)
    weight = drafter.fc.weight
    with caplog.at_level(logging.INFO, logger=placement.__name__):
        assert placement.place_drafter(drafter, target) == torch.device("cpu")
    assert drafter.fc.weight is weight and not caplog.records


def test_placement_runs_in_the_validation_before_the_target(target, prompt, monkeypatch):
    events = []
    place = checks.place_drafter
    monkeypatch.setattr(checks, "place_drafter", lambda d, t: events.append("place") or place(d, t))
    handle = target.register_forward_pre_hook(lambda *_: events.append("target"))
    try:
        _generate(target, prompt, tiny_drafter(target))
    finally:
        handle.remove()
    assert events[0] == "place" and "target" in events


@pytest.mark.parametrize("make_immovable, reason", [
    (lambda d: setattr(d, "hf_quantizer", object()), "it is quantized"),
    (lambda d: d.hf_device_map.update({"layers": 0, "fc": 1}), "accelerate dispatched it over"),
])
def test_a_drafter_that_cannot_be_moved_is_refused_with_what_to_do(target, monkeypatch, make_immovable, reason):
    drafter = tiny_drafter(target)
    drafter.hf_device_map = {}
    make_immovable(drafter)
    monkeypatch.setattr(placement, "embedding_device", lambda model: torch.device("meta"))
    with pytest.raises(ValueError, match=reason) as refused:
        placement.place_drafter(drafter, target)
    assert "Load the drafter whole on meta" in str(refused.value)
    assert placement.drafter_devices(drafter) == {torch.device("cpu")}  # not half moved


def test_an_offloaded_drafter_is_refused_before_the_target_runs(target, prompt, count_forwards):
    drafter = tiny_drafter(target)
    drafter.fc.to("meta")  # what accelerate's offload leaves in the module
    forwards = count_forwards(target)
    with pytest.raises(ValueError, match="cannot be moved there: some of its weights are on the meta device"):
        _generate(target, prompt, drafter)
    assert forwards["n"] == 0


@pytest.mark.parametrize("module, what", [("lm_head", "lm_head"), ("model.embed_tokens", "input embeddings")])
def test_an_offloaded_lm_head_or_embedding_is_refused_before_the_target_runs(prompt, count_forwards, module, what):
    accelerate = pytest.importorskip("accelerate")
    target = tiny_target(dtype=torch.float32)
    accelerate.cpu_offload(target.get_submodule(module), execution_device="cpu")  # weights on meta, loaded per forward
    assert _generate(target, prompt).shape[1] == prompt.shape[1] + MAX_NEW  # plain decoding still runs offloaded
    forwards = count_forwards(target)
    with pytest.raises(ValueError, match=f"The target's {what} is offloaded.*a device_map that puts them on a GPU"):
        _generate(target, prompt, tiny_drafter(target))
    assert forwards["n"] == 0


# --- scores on the head's device; no copy of a full head -------------------------------------------------------------


def test_draft_vocabulary_scores_are_indexed_on_the_head_device_then_moved_to_the_inputs(target, prompt):
    """The head (and its draft vocabulary) on the CPU, the inputs on another device: every op stays on one device."""
    drafter = tiny_drafter(target, draft_vocab_size=40)
    source = _generator(target, drafter, prompt).drafter_source
    assert source.draft_head[0].device == target.lm_head.weight.device
    logits = source.draft_logits(torch.randn(1, 3, target.config.hidden_size))  # on the head's device
    assert logits.device == target.lm_head.weight.device
    inputs = prompt.to("meta")
    with OneDevicePerOp():
        tokens, scores = source.choose(inputs, logits)  # argmax proposals, no processors
    assert tokens.device == scores.device == inputs.device and tokens.shape == (1, 3)

    class NoValueChecks(DraftChooser):
        def process(self, ids, scores):  # a processor's -inf check reads values, which meta has none of
            return scores

    choose = NoValueChecks(drafter, LogitsProcessorList([lambda ids, scores: scores]), False, target.config.vocab_size)
    with OneDevicePerOp():
        tokens, scores = choose(inputs, logits)  # full-vocabulary scores for the processors
    assert tokens.device == scores.device == inputs.device and scores.shape == (1, 3, target.config.vocab_size)


def test_a_full_vocabulary_drafter_in_another_dtype_scores_with_the_head_itself(target, prompt):
    drafter = tiny_drafter(target, dtype=torch.float64)  # the target's head is float32
    source = _generator(target, drafter, prompt).drafter_source
    assert source.draft_head[0].data_ptr() == target.lm_head.weight.data_ptr()  # no per-call copy of the head
    logits = source.draft_logits(torch.randn(1, 3, target.config.hidden_size, dtype=torch.float64))
    assert logits.dtype == torch.float32 and logits.shape == (1, 3, target.config.vocab_size)
    assert torch.equal(_generate(target, prompt, drafter), _generate(target, prompt))


def test_retraces_kept_suffix_is_indexed_on_the_drafters_device(target, prompt):
    """The drafter on another device than the inputs (its hidden states there, the drafts and verify scores on the
    inputs'): keeping the rejected suffix and gathering the target's rows for it never mix devices (issue 37)."""
    drafter = tiny_drafter(target, block_size=6, retrace="random").to("meta")  # the drafter's "GPU"
    config = target.generation_config
    config.max_length = prompt.shape[1] + MAX_NEW
    source = ReTraceCandidateGenerator(drafter, target, config, None, prompt.shape[1], RoundPolicy(retrace=True)
                                       ).drafter_source
    hidden = torch.randn(1, 5, target.config.hidden_size, device="meta")
    proposal = Proposal("drafter", 5, torch.tensor([[7, 8, 9, 10, 11]]), [7, 8, 9, 10, 11], None, hidden)
    committed = torch.cat([prompt, torch.tensor([[7, 3]])], dim=1)  # one draft accepted, then the target's own
    scores = torch.randn(1, 6, target.config.vocab_size)
    with OneDevicePerOp():
        source.observe(proposal, Verdict(accepted=1, sequence=committed, scores=scores))
    carry = source.carry
    assert carry.positions.shape == carry.rejected_tokens.shape == (1, 3)  # slots 3..5 of the block at 5
    assert {t.device.type for t in (carry.positions, carry.drafter_hidden, carry.rejected_tokens,
                                    carry.target_tokens, carry.target_probs)} == {"meta"}
    window = torch.randn(1, 7, target.config.hidden_size * 2).to("meta")  # the next window, moved to the drafter
    with OneDevicePerOp():
        assert window[:, carry.window_rows].shape == (1, 3, window.shape[-1])


# --- synchronize ------------------------------------------------------------------------------------------------------


def test_synchronize_waits_on_the_given_accelerator_and_is_a_no_op_on_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("cuda", device)))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append(("mps", None)))
    for device in (None, "cpu", torch.device("cpu"), "meta"):
        placement.synchronize(device)
    assert calls == []
    placement.synchronize("cuda:1")
    placement.synchronize(torch.device("mps"))
    assert calls == [("cuda", torch.device("cuda:1")), ("mps", None)]
