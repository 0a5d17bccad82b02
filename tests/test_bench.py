"""``hf-retrace bench`` on tiny models saved to tmp folders: schema, fp32 losslessness, divergence detection,
input errors before any model load, Markdown/PNG output, and the CLI end to end."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import sys
import types

import pytest
import torch
from helpers import tiny_drafter, tiny_target, word_level_tokenizer

from hf_retrace import cli
from hf_retrace.bench import loop, runner
from hf_retrace.bench.divergence import find_divergence
from hf_retrace.bench.methods import ALL_METHODS
from hf_retrace.bench.native import build_native_assistant, convert_state_dict
from hf_retrace.bench.plan import BenchInputError, BenchSpec, plan_benchmark
from hf_retrace.bench.records import BenchRow
from hf_retrace.bench.report import markdown_report, write_markdown, write_plots

VOCAB = 96
ROW_FIELDS = (
    "dataset", "method", "temperature", "prompts", "requests", "new_tokens", "decode_tokens", "generate_seconds",
    "prefill_seconds", "decode_seconds", "decode_seconds_per_token", "tokens_per_second", "speedup", "tau",
    "tau_per_request", "tau_per_round", "rounds", "per_position_acceptance", "acceptance_length_histogram",
    "draft_cost_c", "verify_cost_epsilon", "ideal_speedup", "speedup_over_ideal", "kept_suffix_rate",
    "kept_token_commit_rate", "mismatches", "mismatch_bugs", "mismatch_near_ties", "compared_requests",
    "uncompared_requests", "divergences", "per_request",
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Folders: a tiny Llama target with its tokenizer, a drafter with a (random, trained-flagged) ReTrace module,
    a drafter without ReTrace, a drafter for another target, and a multi-turn JSONL."""
    root = tmp_path_factory.mktemp("bench")
    target = tiny_target(family="llama", vocab_size=VOCAB, dtype=torch.float32, logit_scale=4.0)
    target.save_pretrained(root / "target")
    word_level_tokenizer(VOCAB).save_pretrained(root / "target")
    tiny_drafter(target, block_size=6, retrace="random").save_pretrained(root / "drafter")
    tiny_drafter(target, block_size=4, retrace=None, learned_mask_embedding=True).save_pretrained(root / "dflash_only")
    tiny_drafter(target, block_size=4, retrace="random", seed=5).save_pretrained(root / "no_gate_drafter")
    other = tiny_target(family="llama", vocab_size=VOCAB, hidden_size=32, dtype=torch.float32)
    tiny_drafter(other, retrace="random").save_pretrained(root / "other_drafter")
    chat = root / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"id": f"c{i}", "turns": [f"how do you make {w} ?", "and then what ?"]})
                              for i, w in enumerate(["time", "sound"])) + "\n")
    return {"root": root, "target": str(root / "target"), "drafter": str(root / "drafter"),
            "dflash_only": str(root / "dflash_only"), "no_gate_drafter": str(root / "no_gate_drafter"),
            "other_drafter": str(root / "other_drafter"), "chat": str(chat)}


@pytest.fixture(scope="module")
def report(assets):
    """One fp32 run: two datasets (one multi-turn), every method, T=0 and T=1."""
    torch.set_num_threads(1)
    spec = BenchSpec(datasets=["gsm8k", assets["chat"]], methods=list(ALL_METHODS), temperatures=[0.0, 1.0],
                     max_new_tokens=12, limit=2, seeds=[0], target=assets["target"],
                     drafters={"default": assets["drafter"]}, dtype="fp32", progress=False)
    return runner.run_benchmark(spec)


@pytest.fixture
def cli_without_training_commands(monkeypatch):
    """cli.build_parser also registers `train`; stand in for hf_retrace.training.cli.commands until it exists."""
    try:
        importlib.import_module("hf_retrace.training.cli.commands")
    except ImportError:
        stub = types.ModuleType("hf_retrace.training.cli.commands")
        stub.register = lambda subparsers: None
        monkeypatch.setitem(sys.modules, "hf_retrace.training.cli.commands", stub)


def test_json_has_every_field_for_every_dataset_and_method(report):
    assert set(report["results"]) == {"gsm8k", "chat"}
    for dataset, methods in report["results"].items():
        assert set(methods) == set(ALL_METHODS), f"{dataset}: methods {sorted(methods)}"
        for method, by_temperature in methods.items():
            assert set(by_temperature) == {"T=0", "T=1"}
            for row in by_temperature.values():
                missing = [f for f in ROW_FIELDS if f not in row]
                assert not missing, f"{dataset}/{method} lacks {missing}"
                assert row["tau"] >= 1.0 and row["speedup"] > 0 and row["tokens_per_second"] > 0
    assert json.loads(json.dumps(report)) == report  # plain JSON, nothing left as a tensor or dataclass


def test_rows_are_bench_row_records_written_as_the_json_rows(report):
    for row in report["rows"]:
        assert list(row) == [f.name for f in dataclasses.fields(BenchRow)]  # the JSON's key order is the record's
        assert BenchRow.from_dict(row).to_dict() == row
        assert report["results"][row["dataset"]][row["method"]][f"T={row['temperature']:g}"] == row


def test_fp32_greedy_outputs_equal_plain_for_every_method(report):
    greedy = [r for r in report["rows"] if r["temperature"] == 0 and r["method"] != "plain"]
    assert {r["method"] for r in greedy} == set(ALL_METHODS) - {"plain"}
    for row in greedy:
        assert row["mismatches"] == 0, (row["dataset"], row["method"], row["divergences"])
        assert row["compared_requests"] == row["requests"] > 0  # every request, every turn, really compared
    sampled = [r for r in report["rows"] if r["temperature"] == 1]
    assert all(r["mismatches"] is None for r in sampled)  # T=1 outputs legitimately differ: never compared


def test_multi_turn_prompts_run_every_turn(report):
    chat = report["results"]["chat"]["retrace"]["T=0"]
    assert chat["requests"] == 2 * chat["prompts"] == 4
    second_turns = [r for r in chat["per_request"] if r["turn"] == 1]
    first_turns = {r["prompt_id"]: r for r in chat["per_request"] if r["turn"] == 0}
    for second in second_turns:  # the answer to turn 1 is part of turn 2's input
        first = first_turns[second["prompt_id"]]
        assert second["input_tokens"] > first["input_tokens"] + first["new_tokens"] - 1


def test_native_dflash_rounds_are_recorded_like_ours(report):
    for dataset in report["results"]:
        native = report["results"][dataset]["dflash-native"]["T=0"]
        ours = report["results"][dataset]["dflash"]["T=0"]
        assert native["rounds"] == ours["rounds"] > 0
        assert native["acceptance_length_histogram"] == ours["acceptance_length_histogram"]
        assert native["draft_cost_c"] > 0 and native["kept_suffix_rate"] is None
        assert ours["kept_suffix_rate"] is not None


def test_mismatch_detector_reports_position_and_gap(assets, monkeypatch):
    real_generate = loop.timed_generate

    def corrupt_dflash(target, tokenizer, input_ids, **kwargs):
        run = real_generate(target, tokenizer, input_ids, **kwargs)
        drafter = kwargs.get("assistant_model")
        if hasattr(drafter, "retrace") and drafter.policy_changes.get("retrace") is False:  # the dflash method only
            run.token_ids[3] = (run.token_ids[3] + 1) % VOCAB  # a wrong token at new-token position 3
        return run

    monkeypatch.setattr(loop, "timed_generate", corrupt_dflash)
    spec = BenchSpec(datasets=["gsm8k"], methods=["plain", "dflash", "retrace"], max_new_tokens=8, limit=2,
                     target=assets["target"], drafters={"default": assets["drafter"]}, dtype="fp32",
                     warmup=False, progress=False)
    result = runner.run_benchmark(spec)["results"]["gsm8k"]
    assert result["retrace"]["T=0"]["mismatches"] == 0
    row = result["dflash"]["T=0"]
    assert row["mismatches"] == row["mismatch_bugs"] == 2  # fp32: every divergence is a bug
    for divergence in row["divergences"]:
        assert divergence["position"] == 3
        assert divergence["plain_token"] != divergence["method_token"]
        assert math.isfinite(divergence["top2_gap"]) and divergence["top2_gap"] >= 0
        assert divergence["chosen_gap"] > 0  # plain's token is the target's argmax there; the injected one is not
        assert divergence["verdict"] == "bug"


class _FixedLogits(torch.nn.Module):
    """A 'target' whose last-position logits are fixed: only find_divergence's verdict is under test."""

    def __init__(self, logits: list[float]):
        super().__init__()
        self.logits = torch.tensor(logits)
        self.device = torch.device("cpu")

    def forward(self, input_ids, attention_mask=None):
        return types.SimpleNamespace(logits=self.logits.expand(1, input_ids.shape[1], -1))


@pytest.mark.parametrize(
    "logits, dtype, verdict",
    [
        ([10.0, 10.0625, 3.0], "bf16", "near-tie"),  # one bf16 ulp at 10: numerics
        ([10.0, 10.0625, 3.0], "fp32", "bug"),  # fp32 must be exact whatever the gap
        ([10.0, 12.0, 3.0], "bf16", "bug"),  # 32 ulps: not a near-tie
    ],
)
def test_divergence_verdict_uses_bf16_ulps_of_the_logit(logits, dtype, verdict):
    prompt = torch.tensor([[1, 2, 3]])
    divergence = find_divergence(_FixedLogits(logits), prompt, plain_output=[5, 1, 7], output=[5, 0, 7], dtype=dtype)
    assert divergence.position == 1
    assert (divergence.plain_token, divergence.method_token) == (1, 0)
    assert divergence.top2_gap == pytest.approx(abs(logits[1] - logits[0]))
    assert divergence.bf16_ulp == 0.0625
    assert divergence.verdict == verdict
    assert find_divergence(_FixedLogits(logits), prompt, [5, 1, 7], [5, 1, 7], dtype) is None


@pytest.mark.parametrize(
    "case, expected",
    [
        ("unknown_dataset", "unknown dataset 'gsm9k'"),
        ("unusable_jsonl", "no usable prompt field"),
        ("unknown_method", "unknown method(s) 'medusa'"),
        ("wrong_target", "was built for another target"),
        ("unknown_drafter_name", "unknown drafter name 'eagle'"),
    ],
)
def test_bad_input_fails_before_any_model_loads(case, expected, assets, monkeypatch, cli_without_training_commands):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(runner, "load_models", no_load)
    monkeypatch.setattr(cli, "load_target", no_load)
    monkeypatch.setattr(cli, "load_drafter", no_load)
    bad = assets["root"] / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no prompt field here"}) + "\n")
    args = {"dataset": "gsm8k", "methods": "plain,dflash", "drafter": assets["drafter"]}
    args |= {
        "unknown_dataset": {"dataset": "gsm9k"},
        "unusable_jsonl": {"dataset": str(bad)},
        "unknown_method": {"methods": "plain,medusa"},
        "wrong_target": {"drafter": assets["other_drafter"]},
        "unknown_drafter_name": {"drafter": f"eagle={assets['drafter']}"},
    }[case]
    argv = ["bench", "--target", assets["target"], "--dataset", args["dataset"], "--methods", args["methods"],
            "--drafter", args["drafter"], "--no-progress"]
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert expected in str(raised.value.code)


def test_retrace_methods_are_skipped_with_a_reason_when_the_drafter_has_no_module(assets):
    plan = plan_benchmark(BenchSpec(datasets=["gsm8k"], methods=["dflash", "retrace", "retrace-no_gate"], limit=1,
                                    target=assets["target"], drafters={"default": assets["dflash_only"]}))
    assert [m.name for m in plan.methods] == ["plain", "dflash"]
    assert set(plan.skipped) == {"retrace", "retrace-no_gate"}
    assert all("no ReTrace module" in reason for reason in plan.skipped.values())


def test_a_separately_trained_ablation_drafter_replaces_the_main_one(assets):
    plan = plan_benchmark(BenchSpec(datasets=["gsm8k"], methods=["retrace", "retrace-no_gate", "retrace-no_correction"],
                                    limit=1, target=assets["target"],
                                    drafters={"default": assets["drafter"], "no_gate": assets["no_gate_drafter"]}))
    assert plan.drafter_paths == {"retrace": assets["drafter"], "retrace-no_gate": assets["no_gate_drafter"],
                                  "retrace-no_correction": assets["drafter"]}


def test_an_ablation_drafter_serves_its_full_block_method_too(assets):
    plan = plan_benchmark(BenchSpec(datasets=["gsm8k"], methods=["retrace-full-block", "retrace-no_gate-full-block"],
                                    limit=1, target=assets["target"],
                                    drafters={"default": assets["drafter"], "no_gate": assets["no_gate_drafter"]}))
    assert plan.drafter_paths == {"retrace-full-block": assets["drafter"],
                                  "retrace-no_gate-full-block": assets["no_gate_drafter"]}
    assert {m.name: (m.ablation, m.full_block) for m in plan.methods if m.kind == "drafter"} == {
        "retrace-full-block": ("full", True), "retrace-no_gate-full-block": ("no_gate", True)}
    with pytest.raises(BenchInputError, match="no method in --methods uses it; add retrace-no_gate"):
        plan_benchmark(BenchSpec(datasets=["gsm8k"], methods=["retrace-no_correction-full-block"], limit=1,
                                 target=assets["target"], drafters={"no_gate": assets["no_gate_drafter"]}))


@pytest.mark.parametrize("learned_mask", [False, True])
def test_native_assistant_computes_what_the_drafter_computes(learned_mask):
    target = tiny_target(family="llama", vocab_size=VOCAB, dtype=torch.float64)
    drafter = tiny_drafter(target, block_size=6, retrace="random", learned_mask_embedding=learned_mask)
    assistant = build_native_assistant(drafter)
    assert not any(k.startswith("retrace.") or k == "mask_embedding" for k in convert_state_dict(drafter.state_dict()))
    torch.manual_seed(0)
    context = torch.randn(1, 7, len(drafter.config.target_layer_ids) * target.config.hidden_size, dtype=torch.float64)
    anchor = torch.tensor([17])
    positions = torch.arange(7 + drafter.config.block_size)[None]
    embed = target.get_input_embeddings()
    with torch.no_grad():
        ours = drafter(target_hidden=context, noise_embedding=drafter.block_embeddings(anchor, embed),
                       position_ids=positions)
        mask_row = 0 if learned_mask else drafter.config.mask_token_id  # the native generator embeds this row
        noise_ids = torch.tensor([[17] + [mask_row] * (drafter.config.block_size - 1)])
        native = assistant(noise_embeds=embed(noise_ids), context_hidden_states=context, position_ids=positions)
    torch.testing.assert_close(native.last_hidden_state, ours, rtol=1e-5, atol=1e-5)


def test_markdown_and_pngs_are_written(report, tmp_path):
    markdown = write_markdown(report, tmp_path / "out.md").read_text()
    for method in ALL_METHODS:
        assert f"| {method} |" in markdown
    assert "Per-position acceptance" in markdown
    for png in write_plots(report, tmp_path / "plots"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000


def test_cli_end_to_end(assets, tmp_path, capsys, cli_without_training_commands):
    out = tmp_path / "out.json"
    argv = ["bench", "--target", assets["target"], "--drafter", assets["drafter"], "--dataset", "gsm8k",
            "--dataset", assets["chat"], "--methods", "plain,prompt-lookup,dflash,retrace", "--temperature", "0",
            "--max-new-tokens", "8", "--limit", "1", "--dtype", "fp32", "--json", str(out), "--markdown",
            str(tmp_path / "out.md"), "--plots", str(tmp_path / "plots"), "--no-progress", "--fail-on-mismatch"]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    for dataset in ("gsm8k", "chat"):
        for method in ("plain", "prompt-lookup", "dflash", "retrace"):
            row = report["results"][dataset][method]["T=0"]
            assert {"tau", "speedup", "mismatches", "tokens_per_second"} <= set(row)
            assert row["mismatches"] == 0
    stdout = capsys.readouterr().out
    assert stdout.strip() == markdown_report(report).strip()
    assert (tmp_path / "out.md").is_file() and (tmp_path / "plots" / "tau.png").is_file()


def test_repeats_time_every_request_again_in_alternating_order_and_keep_the_median_call(assets, monkeypatch):
    """--repeats R on the per-request benchmark: each method's call runs R times a turn, seeded alike (the same
    tokens), the methods' order reversed every other repeat, and the call with the median decode time is reported."""
    order, original = [], loop.timed_generate
    scripted = iter([5.0, 1.0, 9.0, 3.0, 7.0, 2.0])  # seconds of each call, in the order they run

    def timed(*args, **kwargs):
        run = original(*args, **kwargs)
        order.append("prompt-lookup" if "prompt_lookup_num_tokens" in kwargs else "plain")
        return dataclasses.replace(run, seconds=100.0 + next(scripted))  # (far above any prefill)

    monkeypatch.setattr(loop, "timed_generate", timed)
    spec = BenchSpec(datasets=["gsm8k"], methods=["plain", "prompt-lookup"], temperatures=[0.0], max_new_tokens=6,
                     limit=1, seeds=[0], target=assets["target"], dtype="fp32", progress=False, warmup=False,
                     repeats=3)
    report = runner.run_benchmark(spec)
    assert order == ["plain", "prompt-lookup", "prompt-lookup", "plain", "plain", "prompt-lookup"]
    plain, lookup = (report["results"]["gsm8k"][m]["T=0"] for m in ("plain", "prompt-lookup"))
    assert plain["per_request"][0]["generate_seconds"] == 105.0  # plain's calls 5, 3, 7: the median
    assert lookup["per_request"][0]["generate_seconds"] == 102.0  # prompt lookup's 1, 9, 2
    assert lookup["mismatches"] == 0 and lookup["compared_requests"] == 1
    assert report["settings"]["repeats"] == 3 and "timed 3 times" in report["settings"]["timing"]
    with pytest.raises(BenchInputError, match="1 or more timings"):
        plan_benchmark(dataclasses.replace(spec, repeats=0))


def test_plain_without_onednn_runs_its_call_and_prefill_with_onednn_off_and_puts_it_back(assets, monkeypatch):
    """plain-no-onednn: the call and the prefill timed for it run with torch's oneDNN switched off (its speed-up is
    over plain with oneDNN as the process has it); plain and the others run as the process has it; the switch is put
    back after each call, even one that raises."""
    from hf_retrace.machine import onednn_matmuls

    seen: dict[str, list[bool]] = {}
    original = loop.timed_generate
    method_of = iter([])

    def recording(*args, **kwargs):
        seen.setdefault(next(method_of), []).append(torch.backends.mkldnn.enabled)
        return original(*args, **kwargs)

    monkeypatch.setattr(loop, "timed_generate", recording)
    spec = BenchSpec(datasets=["gsm8k"], methods=["plain", "plain-no-onednn", "prompt-lookup"], temperatures=[0.0],
                     max_new_tokens=6, limit=1, seeds=[0], target=assets["target"], dtype="fp32", progress=False)
    method_of = iter(["plain", "plain-no-onednn", "prompt-lookup"] * 4)  # the warm-up's turn, then the prompt's
    before = torch.backends.mkldnn.enabled
    report = runner.run_benchmark(spec)
    assert before is True and torch.backends.mkldnn.enabled is True
    assert set(seen) == {"plain", "plain-no-onednn", "prompt-lookup"}
    assert seen["plain-no-onednn"] and not any(seen["plain-no-onednn"])
    assert all(seen["plain"]) and all(seen["prompt-lookup"])
    row = report["results"]["gsm8k"]["plain-no-onednn"]["T=0"]
    assert row["tau"] == 1.0 and row["rounds"] is None and row["draft_cost_c"] is None
    assert row["mismatches"] == 0 and row["compared_requests"] == row["requests"] > 0  # fp32: the same tokens
    with pytest.raises(RuntimeError, match="inside"):
        with onednn_matmuls(False):
            assert torch.backends.mkldnn.enabled is False
            raise RuntimeError("inside")
    assert torch.backends.mkldnn.enabled is True
    torch.backends.mkldnn.set_flags(False, None, None, None)
    try:
        with onednn_matmuls(True):  # a process that turned oneDNN off keeps it off
            assert torch.backends.mkldnn.enabled is False
    finally:
        torch.backends.mkldnn.set_flags(True, None, None, None)
