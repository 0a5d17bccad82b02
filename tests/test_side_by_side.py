"""``hf-retrace generate`` (:mod:`hf_retrace.side_by_side`): it names what ran, and where plain and drafted answers
part it says where, with which tokens, and whether that is a bf16 near-tie or a bug (the benchmark's classifier),
never a bare ``False``."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from helpers import tiny_drafter, tiny_target, word_level_tokenizer

import hf_retrace.side_by_side as side_by_side
from hf_retrace.cli import main
from hf_retrace.divergence import find_divergence
from hf_retrace.generation.policy import RoundPolicy
from hf_retrace.side_by_side import Run, SideBySide, compare, describe_round

README = Path(__file__).resolve().parents[1] / "README.md"
PROMPT = "the a of to and is in it"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny float32 target with its tokenizer, and a drafter with context lookup and a confidence cut, on disk."""
    root = tmp_path_factory.mktemp("pair")
    target = tiny_target("llama", vocab_size=96, dtype=torch.float32, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=6, dtype=torch.float32)
    drafter.config.lookup = True
    drafter.config.draft_confidence_threshold = 0.5
    target.save_pretrained(root / "target")
    word_level_tokenizer(96).save_pretrained(root / "target")
    drafter.save_pretrained(root / "drafter")
    return root


def _generate(pair, capsys, *extra):
    assert main(["generate", PROMPT, "--target", str(pair / "target"), "--drafter", str(pair / "drafter"),
                 "--max-new-tokens", "12", *extra]) == 0
    return capsys.readouterr().out


def _assert_names_what_ran(out: str):
    ran = next(line for line in out.splitlines() if line.startswith("ran: "))
    # the facts, in the README's words ("What ran"), whichever describes them (the call's policy or the config)
    for words in ("DFlash drafter", "confidence cut 0.5", "context lookup 2-4-grams, budget 2..10", "ReTrace off",
                  "policy: shipped"):
        assert words in ran, ran
    assert "ReTrace drafter" not in out


def test_generate_says_the_outputs_are_identical_and_names_what_ran(pair, capsys):
    out = _generate(pair, capsys, "--dtype", "fp32")
    assert "outputs: identical to plain generate, token for token (12 tokens)." in out
    assert "False" not in out and "True" not in out
    _assert_names_what_ran(out)


def test_a_divergence_is_located_decoded_and_classified_by_the_benchmark_rule(pair, capsys, monkeypatch):
    """The drafted run is made to leave plain's answer at token 3: fp32 must call that a bug, with both tokens."""
    real = side_by_side.timed_generate
    injected = {}

    def timed_generate(target, tokenizer, input_ids, **kwargs):
        run = real(target, tokenizer, input_ids, **kwargs)
        if "assistant_model" in kwargs and len(run.token_ids) > 3:
            injected["plain"] = run.token_ids[3]
            run.token_ids[3] = (run.token_ids[3] + 1) % 96
            injected["drafted"] = run.token_ids[3]
        return run

    monkeypatch.setattr(side_by_side, "timed_generate", timed_generate)
    out = _generate(pair, capsys, "--dtype", "fp32")
    tokenizer = word_level_tokenizer(96)
    plain_words = f"{tokenizer.decode([injected['plain']])!r} (id {injected['plain']})"
    drafted_words = f"{tokenizer.decode([injected['drafted']])!r} (id {injected['drafted']})"
    assert (f"outputs: identical for the first 3 tokens, then part at token 3: plain {plain_words}, "
            f"drafted {drafted_words}.") in out
    assert "the target's top-2 logit gap there (one forward over plain's tokens) is " in out
    assert "in fp32 every divergence counts" in out and "This is a bug" in out
    assert "False" not in out


class _FixedLogitsTarget(torch.nn.Module):
    """A 'target' whose logits are fixed at every position, in bf16: only the classification is under test."""

    dtype = torch.bfloat16
    device = torch.device("cpu")

    def __init__(self, logits: list[float]):
        super().__init__()
        self.fixed = torch.tensor(logits)

    def forward(self, input_ids, attention_mask=None):
        return types.SimpleNamespace(logits=self.fixed.expand(1, input_ids.shape[1], -1))


@pytest.mark.parametrize("logits, verdict, words", [
    ([10.0, 10.0625, 3.0], "near-tie", "a near-tie (within 2 ulps), so bf16 rounding, not a bug"),  # 1 ulp at 10
    ([10.0, 12.0, 3.0], "bug", "above 2 ulps, so not rounding. This is a bug"),  # 32 ulps
])
def test_compare_classifies_a_bf16_divergence_as_the_benchmark_does(monkeypatch, logits, verdict, words):
    runs = iter([Run([5, 1, 7], "", 1.0), Run([5, 0, 7], "", 1.0)])
    monkeypatch.setattr(side_by_side, "timed_generate", lambda *args, **kwargs: next(runs))
    tokenizer = word_level_tokenizer(96)
    drafter = types.SimpleNamespace(config=tiny_drafter(tiny_target(), block_size=4).config)
    result = compare(_FixedLogitsTarget(logits), tokenizer, drafter, PROMPT, warmup=False)
    expected = find_divergence(_FixedLogitsTarget(logits), side_by_side.chat_input_ids(tokenizer, PROMPT),
                               [5, 1, 7], [5, 0, 7], "bf16")
    assert result.dtype == "bf16" and result.divergence == expected and result.divergence.verdict == verdict
    lines = result.outcome_lines(tokenizer)
    assert lines[0] == (f"outputs: identical for the first 1 tokens, then part at token 1: plain "
                        f"{tokenizer.decode([1])!r} (id 1), drafted {tokenizer.decode([0])!r} (id 0).")
    assert "16 bf16 ulps" not in lines[1] and words in lines[1]
    assert result.as_dict()["divergence"]["verdict"] == verdict


def test_outputs_are_not_compared_at_a_temperature_and_a_stopped_run_is_named():
    sampled = SideBySide("p", Run([1, 2], "", 1.0), Run([3], "", 1.0), temperature=1.0)
    assert sampled.outcome_lines(None)[0].startswith("outputs: not compared token for token: at temperature 1 ")
    assert sampled.as_dict()["compared_to_plain"] is False

    shorter = find_divergence(_FixedLogitsTarget([1.0, 3.0]), torch.tensor([[1]]), [1, 0, 1], [1, 0], "bf16")
    stopped = SideBySide("p", Run([1, 0, 1], "", 1.0), Run([1, 0], "", 1.0), dtype="bf16", divergence=shorter)
    assert "drafted (had stopped)." in stopped.outcome_lines(word_level_tokenizer(96))[0]


def test_the_ran_line_is_the_calls_round_policy():
    drafter = tiny_drafter(tiny_target(), block_size=4, retrace="untrained")
    drafter.config.lookup, drafter.config.lookup_start_tokens, drafter.config.lookup_num_tokens = True, 1, 4
    drafter = drafter.with_policy()  # the untrained module with the shipped policy's choice (off)
    drafter.config.draft_confidence_threshold = 0.65
    # no policy recorded (a call that never ran): the drafter's shipped one, from its config.json
    assert describe_round(drafter) == ("DFlash drafter, confidence cut 0.65; context lookup 2-4-grams, budget 1..4; "
                                       "ReTrace off (policy: shipped)")
    drafter.config.retrace = "trained"
    assert describe_round(drafter).endswith("ReTrace on (policy: shipped)")
    tuned = RoundPolicy(confidence_cut=None, source="tuned", expected_speedup=1.31)
    assert describe_round(drafter, {"policy": tuned.describe()}) == (
        "DFlash drafter, full blocks; no context lookup; ReTrace off (policy: tuned, replayed 1.31 tokens per step-cost)")
    plain = RoundPolicy(speculate=False, reason="nothing beats plain here", source="tuned")
    assert describe_round(drafter, {"policy": plain.describe()}) == "plain decoding (no drafting): nothing beats plain here"


def test_every_word_of_the_ran_line_is_explained_in_the_readme():
    what_ran = README.read_text().split("## What ran", 1)[1].split("\n## ", 1)[0]
    for words in ("DFlash drafter", "confidence cut X", "full blocks", "context lookup n-m-grams", "budget a..b",
                  "no context lookup", "ReTrace on / off", "sample proposals", "plain decoding (no drafting)",
                  "policy: shipped", "replayed X tokens per step-cost"):
        assert words in what_ran, words
