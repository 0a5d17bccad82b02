"""examples/plot_learning_curve.py reads the logs `hf-retrace train` writes: the evaluation before training (step 0),
the periodic ones, a torn last line; several runs on one plot at equal tokens or equal minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "plot_learning_curve.py"


def _run(folder: Path, rows: list[dict], torn: bool = False) -> Path:
    folder.mkdir()
    text = "".join(json.dumps(row) + "\n" for row in rows) + ('{"step": 9, "lo' if torn else "")
    (folder / "train_log.jsonl").write_text(text)
    return folder


def test_curves_start_at_step_zero_and_compare_at_equal_minutes(tmp_path):
    start = {"step": 0, "tokens": 0, "labels": 0, "seconds": 0.0, "tau": 1.8, "eval_prompts": 12}
    steps = [{"step": s, "loss": 2.0 / s, "tokens": 1000 * s, "seconds": 60.0 * s, "tau_proxy": 1.5 + s / 10}
             for s in (1, 2, 3, 4)]
    continued = _run(tmp_path / "a", [start, *steps[:2], {**steps[1], "tau": 2.0}, *steps[2:],
                                      {**steps[3], "tau": 2.1}], torn=True)
    scratch = _run(tmp_path / "b", [*steps[:2], {**steps[1], "tau": 1.2}])
    out = tmp_path / "curve"
    done = subprocess.run([sys.executable, str(SCRIPT), str(continued), str(scratch), "--label", "continue",
                           "scratch", "--x", "minutes", "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    curves = json.loads(out.with_suffix(".json").read_text())
    assert [(p["step"], p["tokens_seen"], p["minutes"], p["tau"]) for p in curves["continue"]] == [
        (0, 0, 0.0, 1.8), (2, 2000, 2.0, 2.0), (4, 4000, 4.0, 2.1)]
    assert curves["continue"][0]["tau_proxy_last_step"] is None and curves["continue"][2]["tau_proxy_last_step"] == 1.9
    assert [p["tau"] for p in curves["scratch"]] == [1.2] and out.with_suffix(".png").stat().st_size > 0

    refused = subprocess.run([sys.executable, str(SCRIPT), str(continued), "--label", "a", "b", "--out", str(out)],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "one label per run" in refused.stderr
