"""``examples/device_check.py --smoke``: the GPU device check's whole path on the CPU with tiny random models, in
seconds (what CI runs; docs/gpu.md). It checks greedy equality in fp32, counts host syncs per loop step, measures the
costs and times plain, the default, the shipped policy and full blocks, then prints the table and writes the JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "device_check.py"


def _device_check():
    spec = importlib.util.spec_from_file_location("device_check", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_smoke_run_checks_equality_counts_syncs_and_times_every_row(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_RETRACE_CACHE", str(tmp_path / "cache"))  # the default policy may be tuned at first use
    out = tmp_path / "check.json"
    assert _device_check().main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["errors"] == {} and report["environment"]["device"] == "cpu"
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
    printed = capsys.readouterr().out
    assert "| full blocks |" in printed and "host syncs per loop step, default (T=0)" in printed


def test_the_counter_counts_conversions_inside_the_round_methods_only_and_restores_torch(monkeypatch):
    import torch

    from hf_retrace.generation.candidate_generator import ReTraceCandidateGenerator

    def verdict(self, input_ids, scores, num_matches):  # a round method reading its verdict to the host once
        return int(num_matches) + len(input_ids[0].tolist()) * 0

    monkeypatch.setattr(ReTraceCandidateGenerator, "update_candidate_strategy", verdict)
    check = _device_check()
    before = {name: torch.Tensor.__dict__.get(name) for name in check.HOST_CONVERSIONS}
    generator = object.__new__(ReTraceCandidateGenerator)
    with check.counting_host_syncs(cuda=False) as counts:
        torch.ones(2).tolist(), bool(torch.ones(1))  # outside a round: not counted
        assert generator.update_candidate_strategy(torch.ones(1, 3), None, torch.tensor(2)) == 2
    assert counts == {"steps": 0, "conversions": 2, "cuda_syncs": 0, "per_step": []}
    assert {name: torch.Tensor.__dict__.get(name) for name in check.HOST_CONVERSIONS} == before
    assert ReTraceCandidateGenerator.__dict__["update_candidate_strategy"] is verdict
