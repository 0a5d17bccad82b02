"""``examples/device_check.py --smoke``: the GPU device check's whole path on the CPU with tiny random models, in
seconds (what CI runs; docs/gpu.md). It checks greedy equality in fp32, counts host syncs per loop step, measures the
costs, counts the overhead per loop step, replays the shipped drafter's recorded rounds under the measured costs (the
projection), runs the Qwen3-8B-shaped section on a tiny Qwen3, and times plain, the default, the shipped policy and
full blocks, then prints the tables and writes the JSON. One smoke run serves the tests that read its report."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "device_check.py"
PARTS = ("drafter", "verify", "remainder")


def _device_check():
    spec = importlib.util.spec_from_file_location("device_check", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(exit status, the JSON report, what it printed) of one ``--smoke`` run."""
    folder = tmp_path_factory.mktemp("device_check")
    out, printed = folder / "check.json", io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setenv("HF_RETRACE_CACHE", str(folder / "cache"))  # the default policy may be tuned at first use
        status = _device_check().main(["--smoke", "--out", str(out)])
    return status, json.loads(out.read_text()), printed.getvalue()


def test_the_smoke_run_checks_equality_counts_syncs_and_times_every_row(smoke):
    status, report, printed = smoke
    assert status == 0 and report["errors"] == {} and report["skipped"] == {}
    assert report["environment"]["device"] == "cpu"
    assert {name: (row["identical"], row["of"]) for name, row in report["equality_fp32"].items()} == {
        "shipped": (2, 2), "full blocks": (2, 2)}
    for row in report["host_syncs"].values():
        assert row["steps"] > row["rounds"] > 0 and row["conversions"] >= 0 and row["cuda_syncs_per_step"] is None
        assert row["stop_check_per_step"] <= 1 and row["most_in_a_step"] >= row["conversions_per_step"]
    # the CPU order reads the lookup's new tokens and the confidences of each head chunk on the host (free on a CPU);
    # on a GPU the accelerator order reads once per step (tests/test_host_syncs.py forces it on the CPU)
    assert report["host_syncs"]["default"]["conversions"] > 0
    assert report["host_syncs"]["full blocks"]["most_in_a_step"] <= 1
    assert report["host_syncs"]["default, accelerator order (forced)"]["most_in_a_step"] <= 1
    costs = report["costs_bf16"]
    assert costs["verify_costs"][0] == 1 and len(costs["verify_costs"]) == 17 and costs["step_seconds"] > 0
    rows = report["timings_bf16"]
    assert [row["method"] for row in rows] == ["plain", "default", "shipped", "full blocks"]
    assert rows[0]["speedup"] == 1 and all(row["tokens_per_second"] > 0 for row in rows)
    assert rows[-1]["policy"].startswith("DFlash drafter, full blocks; no context lookup")
    assert "| full blocks |" in printed and "host syncs per loop step, default (T=0)" in printed


def _ran_rows(report):
    rows = {f"small {name}": row for name, row in report["overhead_bf16"].items()}
    rows.update({f"qwen3 {name}": row for name, row in report["qwen3_8b"]["overhead"].items()})
    return rows


def test_the_overhead_breakdown_parts_are_finite_and_add_up_to_each_steps_total(smoke):
    _, report, printed = smoke
    rows = _ran_rows(report)
    assert {"small plain", "small default", "small full blocks", "small dflash-native", "qwen3 plain",
            "qwen3 full blocks", "qwen3 dflash-native"} <= set(rows)
    for name, row in rows.items():
        if not row["ran"]:  # transformers without its own DFlash path: said so, not timed
            assert name.endswith("dflash-native") and row["reason"].startswith("did not run: "), name
            continue
        ms = row["ms_per_step"]
        assert all(math.isfinite(ms[part]) and ms[part] >= 0 for part in PARTS), (name, ms)
        assert ms["drafter"] + ms["verify"] + ms["remainder"] == pytest.approx(ms["total"], rel=1e-9), name
        assert row["steps"] > 0 and ms["verify"] > 0 and math.isfinite(row["unhooked_ms_per_step"]), name
        assert row["tokens_per_step"] >= 1, name
        # plain runs no drafter; every drafting row spends time in its drafter's forward and head
        assert (ms["drafter"] == 0) == name.endswith("plain"), (name, ms)
    assert "| per loop step (ms) | drafter | verify | remainder | total |" in printed


def test_the_projection_equals_the_tuners_replay_under_the_reported_costs(smoke):
    from hf_retrace import ReTraceConfig
    from hf_retrace.defaults import default_drafter_path
    from hf_retrace.generation.policy import RoundPolicy, shipped_policy
    from hf_retrace.tuning.costs import MachineCosts
    from hf_retrace.tuning.records import RoundRecords
    from hf_retrace.tuning.replay import replay
    from hf_retrace.tuning.search import choose_policies

    _, report, printed = smoke
    result = report["projection"]
    records = RoundRecords.load(default_drafter_path())
    base = shipped_policy(ReTraceConfig.from_pretrained(default_drafter_path()))
    host = result["host_work_ms"]
    overhead = report["overhead_bf16"]
    assert host["per_drafting_round"] == pytest.approx(overhead["full blocks"]["ms_per_step"]["remainder"])
    assert host["per_plain_step"] == pytest.approx(overhead["plain"]["ms_per_step"]["remainder"])
    measured = MachineCosts.from_dict(report["costs_bf16"])
    with_host = MachineCosts.from_dict(result["with_host_work_costs"])
    added = _device_check().with_host_work(measured, host["per_drafting_round"] / 1e3, host["per_plain_step"] / 1e3)
    assert with_host.verify_costs == pytest.approx(added.verify_costs, abs=1e-4)
    assert with_host.draft_cost_full == pytest.approx(added.draft_cost_full)
    for variant, costs in (("forwards_only", measured), ("with_host_work", with_host)):
        choice = choose_policies(records, costs, base)
        for name, answers in (("greedy", records.greedy), ("sampled", records.sampled)):
            row = result[variant][name]
            assert math.isfinite(row["speedup"]) and row["speedup"] >= 1, (variant, name)
            assert row["policy_dict"] == choice[name].to_dict(), (variant, name)
            walked = replay(answers, RoundPolicy.from_dict(row["policy_dict"]), records.block_size - 1)
            assert row["speedup"] == pytest.approx(walked["tokens_per_cost"], rel=1e-12), (variant, name)
    assert "projected speed-up of the default (T=0, recorded rounds replayed under the measured costs)" in printed


def test_host_work_makes_each_drafting_round_cost_its_seconds_over_a_plain_step():
    from hf_retrace.tuning.costs import MachineCosts

    check = _device_check()
    costs = MachineCosts((1.0, 1.2, 1.5), 0.3, 0.6, 0.010, True)
    assert check.with_host_work(costs, 0.0, 0.0) == costs
    more = check.with_host_work(costs, round_host_s=0.004, plain_host_s=0.001)
    # a step as generate runs it is 11 ms: a 2-draft verify is 15 ms of forward + 4 ms of host work
    assert more.step_seconds == pytest.approx(0.011) and more.verify_costs[0] == 1.0
    assert more.verify_costs[2] == pytest.approx((1.5 * 0.010 + 0.004) / 0.011)
    assert more.draft_cost_full == pytest.approx(0.6 * 0.010 / 0.011) and more.drafter_first


def test_the_qwen3_section_projects_at_dflashs_published_tau(smoke):
    from hf_retrace.generation.policy import verify_cost

    check = _device_check()
    _, report, printed = smoke
    large = report["qwen3_8b"]
    assert large["drafter_shape"]["layers"] == 5 and large["drafter_shape"]["block_size"] == 16
    costs = large["costs"]
    assert len(costs["verify_costs"]) == 17 and costs["draft_cost_full"] > 0
    published = large["published"]
    rows = large["overhead"]
    round_over_plain = rows["full blocks"]["unhooked_ms_per_step"] / rows["plain"]["unhooked_ms_per_step"]
    assert published["round_over_plain_step"] == pytest.approx(round_over_plain)
    forwards = verify_cost(costs["verify_costs"], 15) + costs["draft_cost_full"]
    assert published["drafts_per_round"] == 15 and published["round_forwards_in_steps"] == pytest.approx(forwards)
    assert set(published["datasets"]) == set(check.DFLASH_QWEN3_8B["datasets"])
    for name, row in published["datasets"].items():
        speedup, tau = check.DFLASH_QWEN3_8B["datasets"][name]
        assert (row["published_speedup"], row["published_tau"]) == (speedup, tau)
        assert row["projected_speedup"] == pytest.approx(tau / round_over_plain)
        assert row["forwards_only"] == pytest.approx(tau / forwards)
        assert row["ratio_to_published"] == pytest.approx(row["projected_speedup"] / speedup)
    assert "| gsm8k | 6.55 | 5.20x |" in printed and "bb48ef9" in printed


def test_a_spent_budget_skips_the_sections_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_RETRACE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "check.json"
    assert _device_check().main(["--smoke", "--sections", "costs,projection", "--budget-s", "0",
                                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["skipped"]) == {"costs_bf16", "projection"} and report["errors"] == {}
    assert "costs_bf16" not in report and "time budget" in report["skipped"]["projection"]


def test_a_section_running_past_the_budget_is_stopped():
    check = _device_check()
    started = time.perf_counter()
    with pytest.raises(check.OverBudget, match="time budget"):
        with check.deadline(0.05):
            while time.perf_counter() - started < 5:
                time.sleep(0.01)
    assert time.perf_counter() - started < 2


def test_an_unknown_section_is_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        _device_check().main(["--smoke", "--sections", "costs,speed"])
    assert "unknown section(s) ['speed']; choose from equality, syncs, costs" in capsys.readouterr().err


def test_the_counter_counts_conversions_inside_the_round_methods_only_and_restores_torch():
    import torch

    from hf_retrace.generation.candidate_generator import ReTraceCandidateGenerator

    class VerdictOnly(ReTraceCandidateGenerator):  # a generator whose verdict reads the host once
        def get_candidates(self, input_ids, *args, **kwargs):
            return super().get_candidates(input_ids, *args, **kwargs)

        def update_candidate_strategy(self, input_ids, scores, num_matches):
            return int(num_matches) + len(input_ids[0].tolist()) * 0

    check = _device_check()
    before = {name: torch.Tensor.__dict__.get(name) for name in check.HOST_CONVERSIONS}
    methods = {name: VerdictOnly.__dict__[name] for name in ("get_candidates", "update_candidate_strategy")}
    generator = object.__new__(VerdictOnly)
    with check.counting_host_syncs(cuda=False, methods=tuple((VerdictOnly, name) for name in methods)) as counts:
        torch.ones(2).tolist(), bool(torch.ones(1))  # outside a round: not counted
        assert generator.update_candidate_strategy(torch.ones(1, 3), None, torch.tensor(2)) == 2
    assert counts == {"steps": 0, "conversions": 2, "cuda_syncs": 0, "per_step": []}
    assert {name: torch.Tensor.__dict__.get(name) for name in check.HOST_CONVERSIONS} == before
    assert {name: VerdictOnly.__dict__[name] for name in methods} == methods  # the round methods restored
