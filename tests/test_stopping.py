"""Stop strings, custom stopping criteria and streamers stop exactly where plain `generate` stops, although a round
commits several tokens at once (float64, drafters that accept everything or part of each block)."""

from __future__ import annotations

import pytest
import torch
from helpers import ProposalPolicy, StopAtToken, byte_level_tokenizer, tiny_drafter, tiny_target
from transformers import StoppingCriteriaList

VOCAB = 96
NEW = 40


@pytest.fixture(scope="module")
def models():
    target = tiny_target(family="llama", vocab_size=VOCAB, logit_scale=4.0)
    return target, tiny_drafter(target, block_size=6), byte_level_tokenizer()


def _prompt(seed: int) -> torch.Tensor:
    return torch.randint(4, VOCAB, (1, 7), generator=torch.Generator().manual_seed(seed))


class Collector:
    """A streamer that records what it was given."""

    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens += value.reshape(-1).tolist()

    def end(self):
        self.ended = True


def _stop_token(target, prompt, seed):
    """A token plain greedy decoding emits in the middle of its answer (so stopping there cuts the answer)."""
    reference = target.generate(prompt, max_new_tokens=NEW, do_sample=False)
    new = reference[0, prompt.shape[1]:]
    position = 5 + seed % 20
    return reference, int(new[position])


@pytest.mark.parametrize("mode", ["all", "partial"])
@pytest.mark.parametrize("seed", range(4))
def test_stop_strings_stop_where_plain_stops(models, use_policy, mode, seed):
    target, drafter, tokenizer = models
    prompt = _prompt(seed)
    reference, _ = _stop_token(target, prompt, seed)
    position = prompt.shape[1] + 5 + seed % 20
    stop = tokenizer.decode(reference[0, position - 1 : position + 1])  # may span two tokens
    kwargs = dict(max_new_tokens=NEW, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    plain = target.generate(prompt, **kwargs)
    assert plain.shape[1] < reference.shape[1], "the stop string must cut plain's answer for the test to mean anything"
    use_policy(ProposalPolicy(reference, mode, VOCAB, seed))
    plain_stream, ours_stream = Collector(), Collector()
    target.generate(prompt, streamer=plain_stream, **kwargs)
    ours = target.generate(prompt, assistant_model=drafter, streamer=ours_stream, **kwargs)
    assert torch.equal(ours, plain)
    assert ours_stream.tokens == plain_stream.tokens and ours_stream.ended
    if mode == "all":  # whole blocks accepted: the stop fell inside a block, which the per-round check misses
        assert drafter.last_stats.rounds < plain.shape[1] - prompt.shape[1]


@pytest.mark.parametrize("mode", ["all", "partial"])
def test_custom_stopping_criteria_and_scores_stop_where_plain_stops(models, use_policy, mode):
    target, drafter, _ = models
    for seed in range(4, 8):
        prompt = _prompt(seed)
        reference, token = _stop_token(target, prompt, seed)
        kwargs = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_scores=True,
                      stopping_criteria=StoppingCriteriaList([StopAtToken(token)]))
        plain = target.generate(prompt, **kwargs)
        assert plain.sequences.shape[1] < reference.shape[1]
        use_policy(ProposalPolicy(reference, mode, VOCAB, seed))
        ours = target.generate(prompt, assistant_model=drafter, **kwargs)
        assert torch.equal(ours.sequences, plain.sequences)
        assert len(ours.scores) == len(plain.scores) == plain.sequences.shape[1] - prompt.shape[1]
        for a, b in zip(ours.scores, plain.scores):
            assert torch.allclose(a, b, atol=1e-9)


def test_classifier_free_guidance_is_refused_before_the_target_runs(models, count_forwards):
    target, drafter, _ = models
    forwards = count_forwards(target)
    with pytest.raises(ValueError, match="guidance_scale"):
        target.generate(_prompt(0), assistant_model=drafter, max_new_tokens=5, guidance_scale=1.5)
    assert forwards["n"] == 0


@pytest.mark.parametrize("criterion", ["custom", "stop_string"])
def test_a_prompt_that_already_meets_a_criterion_still_gets_its_tokens(models, use_policy, criterion):
    """Plain decoding checks the criteria on generated tokens only: a prompt ending in the stop token or stop string
    still gets its answer (transformers 4.57's loop checks the undrafted prefill's candidate, i.e. the prompt)."""
    target, drafter, tokenizer = models
    prompt = _prompt(9)
    if criterion == "custom":
        kwargs = dict(stopping_criteria=StoppingCriteriaList([StopAtToken(int(prompt[0, -1]))]))
    else:
        kwargs = dict(stop_strings=[tokenizer.decode(prompt[0, -2:])], tokenizer=tokenizer)
    kwargs.update(max_new_tokens=12, do_sample=False)
    plain = target.generate(prompt, **kwargs)
    assert plain.shape[1] > prompt.shape[1] + 1, "plain must generate past the prompt for the test to mean anything"
    use_policy(ProposalPolicy(plain, "partial", VOCAB, seed=1))
    ours = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert ours.tolist() == plain.tolist()
    assert drafter.last_stats.new_tokens == plain.shape[1] - prompt.shape[1]
