"""With a drafter, the rest of ``generate``'s surface behaves as without one (float64 tiny targets).

Streamers, ``return_dict_in_generate`` outputs (scores, logits, the user's own hidden states), greedy logits
processors, ``max_new_tokens``; the drafter's stats (consistent, per thread); other assistants untouched by
``import hf_retrace``; the opt-in ``attach``/``detach`` path; the forward-hook path used where transformers has no
``requires_model_outputs`` protocol (4.57); and the target runs exactly one forward per round (no extra forward).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import ProposalPolicy, scripted_source, tiny_drafter, tiny_target
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from hf_retrace.generation import target_features
from hf_retrace.generation.candidate_generator import ReTraceCandidateGenerator

VOCAB = 96
PATHS = ["model_outputs", "hooks"]



@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0, logit_scale=4.0)


@pytest.fixture
def path(request, monkeypatch):
    """Run the test on the protocol path (where this transformers has it) and on the forward-hook path."""
    if request.param == "hooks":
        monkeypatch.setattr(target_features, "loop_hands_model_outputs", lambda: False)
    elif not target_features.loop_hands_model_outputs():
        pytest.skip("this transformers has no requires_model_outputs protocol (the hooks run covers it)")
    return request.param


def _prompt(length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (1, length), generator=torch.Generator().manual_seed(seed))


def _forward_hooks(model: torch.nn.Module) -> set[tuple[str, int]]:
    """(module name, hook id) of every forward hook (transformers' own output capturing installs some, for good)."""
    return {(name, key) for name, module in model.named_modules() for key in module._forward_hooks}


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


# --- outputs --------------------------------------------------------------------------------------------------------
def test_streamer_receives_exactly_the_output(target, use_policy):
    prompt = _prompt()
    plain_streamer, streamer = RecordingStreamer(), RecordingStreamer()
    reference = target.generate(prompt, max_new_tokens=20, do_sample=False, streamer=plain_streamer)
    use_policy(ProposalPolicy(reference, "partial", VOCAB, seed=3))
    drafter = tiny_drafter(target, block_size=5)
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=20, do_sample=False, streamer=streamer)
    assert out.tolist() == reference.tolist()
    assert streamer.puts[0] == prompt[0].tolist()  # the prompt first, as without a drafter
    assert sum(streamer.puts, []) == out[0].tolist() == sum(plain_streamer.puts, [])
    assert streamer.ended == 1
    assert any(len(chunk) > 1 for chunk in streamer.puts[1:]), "no multi-token put: no draft was ever accepted"


def test_return_dict_scores_and_logits_equal_plain(target, use_policy):
    prompt = _prompt(seed=1)
    kwargs = dict(max_new_tokens=18, do_sample=False, return_dict_in_generate=True, output_scores=True)
    kwargs.update(output_logits=True, repetition_penalty=1.3)  # the penalty: processed scores differ from raw logits
    plain = target.generate(prompt, **kwargs)
    use_policy(ProposalPolicy(plain.sequences, "partial", VOCAB, seed=1))  # multi-token rounds to split per token
    drafter = tiny_drafter(target, block_size=4, seed=2)
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert out.sequences.tolist() == plain.sequences.tolist()
    new_tokens = out.sequences.shape[1] - prompt.shape[1]
    assert max(drafter.last_stats.acceptance_lengths) > 2
    for name in ("scores", "logits"):
        ours, theirs = getattr(out, name), getattr(plain, name)
        assert len(ours) == len(theirs) == new_tokens, name
        for step, (a, b) in enumerate(zip(ours, theirs)):
            assert a.shape == b.shape == (1, VOCAB), (name, step)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-9, msg=f"{name}[{step}]")
    assert not torch.equal(out.scores[3], out.logits[3])


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_users_own_hidden_states_with_return_dict(target, path, use_policy):
    """The known trap: the drafter's layer selection must not strip the user's ``output_hidden_states=True``."""
    prompt = _prompt(seed=2)
    kwargs = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_hidden_states=True)
    plain = target.generate(prompt, **kwargs)
    use_policy(ProposalPolicy(plain.sequences, "partial", VOCAB, seed=2))
    drafter = tiny_drafter(target, block_size=4)
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert out.sequences.tolist() == plain.sequences.tolist()
    assert max(drafter.last_stats.acceptance_lengths) > 1
    num_layers = target.config.num_hidden_layers
    assert len(out.hidden_states) == len(plain.hidden_states) == 12
    for step, (ours, theirs) in enumerate(zip(out.hidden_states, plain.hidden_states)):
        assert len(ours) == len(theirs) == num_layers + 1
        for layer, (a, b) in enumerate(zip(ours, theirs)):
            assert a is not None and a.shape == b.shape, (step, layer)
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"hidden_states[{step}][{layer}]")


# --- logits processors and lengths (greedy) -------------------------------------------------------------------------
@pytest.mark.parametrize("processor", ["repetition_penalty", "min_new_tokens", "no_repeat_ngram_size"])
def test_greedy_logits_processors_match_plain(processor, target):
    prompt = _prompt(seed=4)
    base = target.generate(prompt, max_new_tokens=24, do_sample=False)
    if processor == "min_new_tokens":
        eos = int(base[0, prompt.shape[1] + 2])  # the target would stop at its 3rd new token
        kwargs = dict(max_new_tokens=24, eos_token_id=eos, pad_token_id=eos)
        assert target.generate(prompt, do_sample=False, **kwargs).shape[1] == prompt.shape[1] + 3
        kwargs["min_new_tokens"] = 10
    else:
        kwargs = dict(max_new_tokens=24, **{processor: 1.3 if processor == "repetition_penalty" else 2})
    reference = target.generate(prompt, do_sample=False, **kwargs)
    assert reference.tolist() != base.tolist(), "the processor does not change this output: nothing tested"
    drafter = tiny_drafter(target, block_size=5, retrace="random")
    out = target.generate(prompt, assistant_model=drafter, do_sample=False, **kwargs)
    assert out.tolist() == reference.tolist()
    assert drafter.last_stats.rounds > 0
    if processor == "min_new_tokens":
        assert out.shape[1] - prompt.shape[1] >= 10
    if processor == "no_repeat_ngram_size":
        pairs = list(zip(out[0, :-1].tolist(), out[0, 1:].tolist()))
        assert len(pairs) == len(set(pairs))


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("case", ["eos_next", "continues"])
def test_prompt_ending_in_eos(case, path, target):
    """A prompt whose last token is the EOS still gets the target's first token (transformers 4.57's loop used to
    commit nothing when the undrafted prefill's candidate already ended in EOS)."""
    # cut a greedy text where the target's next token repeats the prompt's last one (eos_next), or does not (continues)
    for seed in range(14, 40):
        greedy = target.generate(_prompt(6, seed=seed), max_new_tokens=20, do_sample=False)[0].tolist()
        cuts = [c for c in range(6, len(greedy)) if (greedy[c] == greedy[c - 1]) == (case == "eos_next")]
        if cuts:
            cut = cuts[0]
            break
    else:
        pytest.fail(f"no place to build the {case} case from")
    prompt = torch.tensor([greedy[:cut]])
    eos = greedy[cut - 1]
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    reference = target.generate(prompt, **kwargs)
    assert (reference.shape[1] == cut + 1) == (case == "eos_next")
    drafter = tiny_drafter(target, block_size=4)
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert out.tolist() == reference.tolist()
    assert drafter.last_stats.new_tokens == reference.shape[1] - cut
    for mode in ("argmax", "sample"):  # sampled: the first token is still the target's own, drawn once
        drafter.proposal_mode = mode
        torch.manual_seed(0)
        one = dict(max_new_tokens=1, do_sample=True, eos_token_id=eos, pad_token_id=eos)
        sampled = target.generate(prompt, assistant_model=drafter, **one)
        torch.manual_seed(0)
        plain = target.generate(prompt, **one)
        assert sampled.tolist() == plain.tolist()


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 6, 7, 13])
def test_max_new_tokens(max_new_tokens, target, use_policy):
    prompt = _prompt(seed=5)
    reference = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
    assert reference.shape[1] == prompt.shape[1] + max_new_tokens
    use_policy(ProposalPolicy(reference, "all", VOCAB))  # full blocks run right into the length limit
    drafter = tiny_drafter(target, block_size=6)
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
    assert out.tolist() == reference.tolist()
    assert drafter.last_stats.new_tokens == max_new_tokens


# --- stats ----------------------------------------------------------------------------------------------------------
def test_stats_fields_are_consistent(target, use_policy):
    prompt = _prompt(seed=6)
    reference = target.generate(prompt, max_new_tokens=40, do_sample=False)
    use_policy(ProposalPolicy(reference, "partial", VOCAB, seed=4))
    drafter = tiny_drafter(target, block_size=5)
    assert drafter.last_stats is None
    started = time.perf_counter()
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False)
    wall = time.perf_counter() - started
    assert out.tolist() == reference.tolist()
    s = drafter.last_stats
    assert s.new_tokens == 40
    assert s.rounds == len(s.acceptance_lengths) == len(s.draft_lengths) == len(s.round_log) > 0
    assert all(1 <= a <= d + 1 for a, d in zip(s.acceptance_lengths, s.draft_lengths))
    assert all(d <= drafter.config.block_size - 1 for d in s.draft_lengths)
    undrafted = s.new_tokens - 1 - sum(s.acceptance_lengths)  # the prefill's token, then rounds, then last steps
    assert undrafted in (0, 1)
    assert s.mean_acceptance_length == pytest.approx(sum(s.acceptance_lengths) / s.rounds)
    assert 1 < s.mean_acceptance_length < drafter.config.block_size  # the partial policy: some, not all
    # per position: slot i was drafted in every round that drafted >= i tokens, accepted when >= i were accepted
    max_drafts = max(s.draft_lengths)
    assert len(s.per_position_acceptance) == len(s.drafted_at_position) == len(s.accepted_at_position) == max_drafts
    for i in range(max_drafts):
        assert s.drafted_at_position[i] == sum(d > i for d in s.draft_lengths)
        assert s.accepted_at_position[i] == sum(a - 1 > i for a in s.acceptance_lengths)
        assert s.per_position_acceptance[i] == pytest.approx(s.accepted_at_position[i] / s.drafted_at_position[i])
    assert all(a >= b for a, b in zip(s.accepted_at_position, s.accepted_at_position[1:]))
    assert sum(s.accepted_at_position) == sum(s.acceptance_lengths) - s.rounds
    assert [(a, d) for a, d, _ in s.round_log] == [(a - 1, d) for a, d in zip(s.acceptance_lengths, s.draft_lengths)]
    assert 0 < s.draft_seconds and 0 < s.verify_seconds and s.draft_seconds + s.verify_seconds < wall
    summary = s.as_dict()
    assert summary["rounds"] == s.rounds and summary["new_tokens"] == s.new_tokens
    assert summary["mean_acceptance_length"] == s.mean_acceptance_length
    assert summary["acceptance_lengths"] == s.acceptance_lengths

    # a second call replaces the stats; an empty drafting budget leaves a clean zero-round record
    target.generate(prompt, assistant_model=drafter, max_new_tokens=1, do_sample=False)
    assert drafter.last_stats is not s
    assert (drafter.last_stats.rounds, drafter.last_stats.new_tokens) == (0, 1)
    assert drafter.last_stats.mean_acceptance_length == 0.0


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_last_stats_are_per_thread(target, path):
    """Two threads share one drafter and one target: each sees its own stats, identical to running alone."""
    drafter = tiny_drafter(target, block_size=5, seed=3)
    jobs = {"a": (_prompt(11, seed=7), 30), "b": (_prompt(6, seed=8), 17)}
    alone = {}
    for name, (prompt, n) in jobs.items():
        reference = target.generate(prompt, max_new_tokens=n, do_sample=False)
        out = target.generate(prompt, assistant_model=drafter, max_new_tokens=n, do_sample=False)
        assert out.tolist() == reference.tolist()
        alone[name] = (reference, drafter.last_stats.acceptance_lengths)
    main_stats = drafter.last_stats

    barrier, results, errors = threading.Barrier(2), {}, []

    def work(name):
        try:
            torch.set_num_threads(1)
            prompt, n = jobs[name]
            barrier.wait()
            for _ in range(3):  # several rounds of interleaving
                out = target.generate(prompt, assistant_model=drafter, max_new_tokens=n, do_sample=False)
                results.setdefault(name, []).append((out, drafter.last_stats))
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append((name, error))

    threads = [threading.Thread(target=work, args=(name,)) for name in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    for name, (prompt, n) in jobs.items():
        reference, acceptance = alone[name]
        for out, stats in results[name]:
            assert out.tolist() == reference.tolist()
            assert stats.new_tokens == n
            assert stats.acceptance_lengths == acceptance, "another thread's call leaked into this one"
    assert drafter.last_stats is main_stats  # the threads never touched this thread's slot
    all_stats = [stats for runs in results.values() for _, stats in runs]
    assert len({id(stats) for stats in all_stats}) == len(all_stats)


# --- other assistants and the opt-in path ---------------------------------------------------------------------------
def test_other_assistants_keep_stock_behaviour(target):
    built = []

    def watch(frame, event, arg):  # observes calls of the generator's constructor (a profiler patches nothing)
        if event == "call" and frame.f_code is ReTraceCandidateGenerator.__init__.__code__:
            built.append(frame)

    prompt = torch.cat([_prompt(8, seed=9)] * 3, dim=1)  # repeats: prompt lookup finds n-gram matches
    # an EOS the output never reaches: transformers 4.57's prompt lookup crashes on eos_token_id=None (its own bug)
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1)
    reference = target.generate(prompt, **kwargs)
    assert VOCAB - 1 not in reference[0].tolist()
    assistant = tiny_target(family="llama", num_layers=1, seed=5, logit_scale=4.0)  # a plain small LM assistant
    sys.setprofile(watch)
    try:
        out = target.generate(prompt, assistant_model=assistant, **kwargs)
        assert out.tolist() == reference.tolist()
        out = target.generate(prompt, prompt_lookup_num_tokens=3, **kwargs)
        assert out.tolist() == reference.tolist()
        target.generate(prompt, assistant_model=tiny_drafter(target, block_size=3), max_new_tokens=2)
    finally:
        sys.setprofile(None)
    assert len(built) == 1, "hf_retrace's generator must serve its own drafters only"


OPT_IN_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, TESTS_DIR)
    torch.set_num_threads(1)
    import hf_retrace
    from transformers import GenerationMixin
    from helpers import tiny_drafter, tiny_target

    assert hf_retrace.GLOBAL_DISPATCH is False
    assert not hasattr(GenerationMixin._get_candidate_generator, "_hf_retrace_wrapped"), "patched globally"
    attached, other = tiny_target(seed=0, logit_scale=4.0), tiny_target(seed=1, logit_scale=4.0)
    prompt = torch.arange(3, 12)[None]
    kwargs = dict(max_new_tokens=16, do_sample=False)

    def refused(model, drafter):
        try:
            model.generate(prompt, assistant_model=drafter, **kwargs)
        except Exception as error:
            return type(error).__name__ + ": " + str(error)[:200]
        return None

    drafter = tiny_drafter(attached)
    assert hf_retrace.attach(attached) is attached
    reference = attached.generate(prompt, **kwargs)
    out = attached.generate(prompt, assistant_model=drafter, **kwargs)
    assert out.tolist() == reference.tolist(), "attached target: output differs from plain greedy"
    assert drafter.last_stats is not None and drafter.last_stats.rounds > 0, "attached target: drafter unused"
    error = refused(other, tiny_drafter(other))
    assert error is not None, "a target that was never attached used the drafter"
    assert "hf_retrace.attach(target)" in error, error  # the message says what to do
    print("NOT ATTACHED:", error)
    stats = drafter.last_stats
    assert hf_retrace.detach(attached) is attached
    error = refused(attached, drafter)
    assert error is not None, "a detached target still used the drafter"
    assert drafter.last_stats is stats
    print("DETACHED:", error)
    print("OPT-IN OK")
    """
)


def test_opt_in_attach_detach_without_global_patch():
    tests_dir = str(Path(__file__).resolve().parent)
    env = {**os.environ, "HF_RETRACE_NO_GLOBAL_PATCH": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    script = f"TESTS_DIR = {tests_dir!r}\n" + OPT_IN_SCRIPT
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OPT-IN OK" in result.stdout


# --- the hook path and the forward count ----------------------------------------------------------------------------
def test_hooks_path_equals_greedy_and_removes_its_hooks(target, monkeypatch):
    monkeypatch.setattr(target_features, "loop_hands_model_outputs", lambda: False)
    gc.collect()
    before = _forward_hooks(target)
    hooks_during = []

    class CountsHooks(scripted_source()):
        def propose(self, inputs):
            hooks_during.append(_forward_hooks(target) - before)
            return super().propose(inputs)

    drafter = tiny_drafter(target, block_size=5, target_layer_ids=[0, 2, 3], retrace="random")
    generator = ReTraceCandidateGenerator(drafter, target, GenerationConfig(max_length=40), None, prompt_length=8)
    assert not generator.requires_model_outputs and generator.model_kwargs_overrides == {}
    generator.close()
    drafter = drafter.with_drafter_source(CountsHooks)
    for seed, max_new in [(10, 30), (11, 9)]:
        prompt = _prompt(seed=seed)
        reference = target.generate(prompt, max_new_tokens=max_new, do_sample=False)
        out = target.generate(prompt, assistant_model=drafter, max_new_tokens=max_new, do_sample=False)
        assert out.tolist() == reference.tolist()
        assert drafter.last_stats.rounds > 0
        gc.collect()
        assert _forward_hooks(target) == before, "the generator's hooks outlived its generate call"
    # one hook on each tapped layer while a call runs, never accumulated across rounds or calls
    tapped = {"model.layers.0", "model.layers.2", "model.layers.3"}
    assert hooks_during and all(len(added) == 3 and {name for name, _ in added} == tapped for added in hooks_during)


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_a_layer_tapped_twice(path, target):
    """``target_layer_ids`` may name a layer twice (e.g. [0, L-2] on a 2-layer target): the drafter still drafts."""
    drafter = tiny_drafter(target, block_size=4, target_layer_ids=[1, 1, 2])
    prompt = _prompt(seed=13)
    reference = target.generate(prompt, max_new_tokens=12, do_sample=False)
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    assert out.tolist() == reference.tolist()
    assert drafter.last_stats.rounds > 0, "the tap never reported a complete window: nothing was drafted"


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("policy", ["drafter", "partial", "all", "none"])
def test_one_target_forward_per_round(policy, path, target, count_forwards, use_policy):
    """Target forwards == 1 (prefill) + drafting rounds + undrafted last steps; one drafter forward per round."""
    prompt = _prompt(seed=12)
    max_new = 25
    reference = target.generate(prompt, max_new_tokens=max_new, do_sample=False)
    if policy != "drafter":
        use_policy(ProposalPolicy(reference, policy, VOCAB, seed=5))
    drafter = tiny_drafter(target, block_size=4, retrace="random")
    target_calls, decoder_calls = count_forwards(target), count_forwards(target.get_decoder())
    drafter_calls = count_forwards(drafter)
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=max_new, do_sample=False)
    assert out.tolist() == reference.tolist()
    s = drafter.last_stats
    undrafted = s.new_tokens - 1 - sum(s.acceptance_lengths)
    assert undrafted in (0, 1)
    assert target_calls["n"] == decoder_calls["n"] == 1 + s.rounds + undrafted
    assert drafter_calls["n"] == s.rounds
    if policy == "all":
        assert target_calls["n"] <= 1 + -(-(max_new - 1) // drafter.config.block_size) + 1
    if policy == "none":
        assert target_calls["n"] == max_new
