"""examples/check_flagged.py: a bf16 request flagged "bug" re-checked in float32 on the real default target and the
shipped drafter (40 tokens: past its bf16 parting at token 31), and a prompt id the set lacks refused with the ids it
has."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "check_flagged.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_a_flagged_request_is_rechecked_in_float32():
    done = _run("--dataset", "math500", "--prompt-id", "test/intermediate_algebra/1197.json", "--max-new-tokens", "40")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("float32")]
    assert len(lines) == 2 and all(line.endswith("token for token: True") for line in lines), done.stdout
    assert "oneDNN matmuls on and off, identical:" in done.stdout


def test_an_unknown_prompt_id_is_refused_with_the_ids_there_are():
    done = _run("--dataset", "math500", "--prompt-id", "no-such-id")
    assert done.returncode != 0
    assert "no prompt 'no-such-id'" in done.stderr and "intermediate_algebra/1197" in done.stderr
