"""examples/paired_tau.py pairs two benchmark reports prompt by prompt: the difference's mean and standard error come
from the pairs, requests in one report only are left out and counted, and a row the reports lack is refused."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from hf_retrace.bench.records import BenchRow, RequestSummary

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "paired_tau.py"


def _report(path: Path, taus: dict[tuple[str, int], float | None], method: str = "dflash-full-block") -> Path:
    requests = [RequestSummary(prompt_id=p, turn=t, seed=0, input_tokens=10, new_tokens=8, generate_seconds=1.0,
                               prefill_seconds=0.1, tau=tau) for (p, t), tau in taus.items()]
    numbers = {f.name: 0 for f in dataclasses.fields(BenchRow)}
    row = BenchRow(**{**numbers, "dataset": "gsm8k", "method": method, "temperature": 0.0,
                      "per_position_acceptance": [], "acceptance_length_histogram": {}, "divergences": [],
                      "per_request": requests})
    path.write_text(json.dumps({"rows": [row.to_dict()]}))
    return path


def _run(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_the_difference_is_taken_prompt_by_prompt(tmp_path):
    # b is a + 0.1 on every shared prompt, though the prompts themselves differ by a whole token of tau: the paired
    # difference is exact with no spread, where the means' own spread is large
    a = _report(tmp_path / "a.json", {("p1", 0): 2.0, ("p2", 0): 3.0, ("p2", 1): 1.5, ("p3", 0): 2.5, ("p4", 0): None})
    # b lists its requests in another order: pairing by position instead of by (prompt, turn, seed) fails this
    b = _report(tmp_path / "b.json", {("p2", 1): 1.6, ("p5", 0): 9.0, ("p1", 0): 2.1, ("p2", 0): 3.1})
    out = tmp_path / "t.json"
    done = _run(a, b, "--json", out)
    assert done.returncode == 0, done.stderr
    table = json.loads(out.read_text())["sets"]["gsm8k"]
    assert table["pairs"] == 3 and table["unpaired"] == 2  # p3 in a only, p5 in b only; p4 drafted nothing
    assert abs(table["tau_a"] - 6.5 / 3) < 1e-12 and abs(table["tau_b"] - 6.8 / 3) < 1e-12
    assert abs(table["diff"] + 0.1) < 1e-12 and table["se"] < 1e-12
    assert "-0.100" in done.stdout and "2 unpaired left out" in done.stdout

    uneven = _report(tmp_path / "c.json", {("p1", 0): 2.3, ("p2", 0): 3.1, ("p2", 1): 1.6})
    table = json.loads((_run(a, uneven, "--json", out), out.read_text())[1])["sets"]["gsm8k"]
    assert abs(table["diff"] + 0.5 / 3) < 1e-12 and abs(table["se"] - 1 / 15) < 1e-9  # differences -0.3, -0.1, -0.1


def test_a_row_the_report_lacks_is_refused_with_what_it_has(tmp_path):
    a = _report(tmp_path / "a.json", {("p1", 0): 2.0})
    b = _report(tmp_path / "b.json", {("p1", 0): 2.0}, method="default")
    refused = _run(a, b)
    assert refused.returncode != 0 and "has no dflash-full-block row at T=0; it has default at T=0" in refused.stderr
    (tmp_path / "bad.json").write_text("{}")
    refused = _run(tmp_path / "bad.json", b, "--method", "default")
    assert refused.returncode != 0 and "is not an `hf-retrace bench --json` report" in refused.stderr
