"""Every bad input of ``hf-retrace generate`` / ``tune`` is one line and a non-zero exit, no traceback, before any
model loads (issue 42): model paths that do not exist or hold a damaged model, ``HF_RETRACE_POLICY``,
``HF_RETRACE_CACHE``, ``tune --json`` into a missing folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_drafter, tiny_target, word_level_tokenizer

from hf_retrace import cli, loading
from hf_retrace.loading import ModelLoadError, load_drafter, load_target


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A tiny target (with its tokenizer) and drafter, saved as save_pretrained writes them."""
    root = tmp_path_factory.mktemp("models")
    target = tiny_target(dtype=torch.float32)
    target.save_pretrained(root / "target")
    word_level_tokenizer().save_pretrained(root / "target")
    tiny_drafter(target).save_pretrained(root / "drafter")
    return {"target": root / "target", "drafter": root / "drafter"}


def _truncate(path: Path, size: int | None = None) -> None:
    os.truncate(path, path.stat().st_size // 2 if size is None else size)


def _damaged(saved: dict[str, Path], kind: str, damage: str, tmp_path: Path) -> tuple[str, str]:
    """(path argument, what the message must say) for a ``kind`` folder with ``damage``."""
    import shutil

    folder = tmp_path / f"{kind}-{damage}"
    shutil.copytree(saved[kind], folder)
    weights = folder / "model.safetensors"
    if damage == "no such folder":
        return str(tmp_path / "no" / "such" / "folder"), r"no/such/folder: no such folder"
    if damage == "a file":
        return str(weights), "is a file: pass the folder"
    if damage == "empty folder":
        for path in folder.iterdir():
            path.unlink()
        return str(folder), rf"{folder.name} is not a saved {kind} \(it is empty\)"
    if damage == "no config.json":
        (folder / "config.json").unlink()
        return str(folder), r"it has no config.json"
    if damage == "corrupt config.json":
        (folder / "config.json").write_text("{not json")
        return str(folder), r"config.json cannot be read \(Expecting property name"
    if damage == "config.json not an object":
        (folder / "config.json").write_text("[1, 2]")
        return str(folder), rf"config.json holds no {kind} configuration"
    if damage == "weights missing":
        weights.unlink()
        return str(folder), rf"no weights in .*{folder.name} \(no model.safetensors"
    if damage == "weights cut short":
        _truncate(weights)
        return str(folder), r"model.safetensors cannot be read \(.*\): it is damaged or was cut short"
    if damage == "weights header cut":
        _truncate(weights, 4)
        return str(folder), r"model.safetensors cannot be read \(.*header too small"
    if damage == "a shard missing":
        index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00002-of-00002.safetensors"}}
        weights.rename(folder / "model-00001-of-00002.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return str(folder), r"model.safetensors.index.json lists model-00002-of-00002.safetensors, missing"
    raise AssertionError(damage)


DAMAGES = ["no such folder", "a file", "empty folder", "no config.json", "corrupt config.json",
           "config.json not an object", "weights missing", "weights cut short", "weights header cut", "a shard missing"]


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if any model starts loading."""
    for name in ("load_target", "load_drafter"):
        monkeypatch.setattr(loading, name, lambda *a, **k: pytest.fail("a model started loading"))
    monkeypatch.setattr(cli, "load_pair", lambda *a, **k: pytest.fail("a model started loading"))


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("kind", ["drafter", "target"])
def test_a_bad_model_path_is_one_line_before_anything_loads(kind, damage, saved, tmp_path, capsys, nothing_loads):
    argument, message = _damaged(saved, kind, damage, tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "hi", f"--{kind}", argument])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # argparse: the usage, then the one error line
    assert error.startswith(f"hf-retrace generate: error: argument --{kind}: ")
    assert re.search(message, error), error


@pytest.mark.parametrize("damage", ["no such folder", "weights cut short", "corrupt config.json"])
def test_the_library_loaders_name_the_same_problem(damage, saved, tmp_path):
    """bench, the demo and scripts load through loading.py: the same words, as a ModelLoadError (an OSError)."""
    for kind, load in (("drafter", load_drafter), ("target", load_target)):
        argument, message = _damaged(saved, kind, damage, tmp_path / kind)
        with pytest.raises(ModelLoadError, match=message):
            load(argument, "fp32")


def test_a_hub_drafter_that_cannot_load_fails_before_the_target_loads(saved, monkeypatch):
    """A Hub id cannot be checked on disk: its configuration is read first (offline here: not in the cache), and the
    error is one line."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(loading, "load_target", lambda *a, **k: pytest.fail("the target loaded before the drafter"))
    with pytest.raises(SystemExit, match=r"hf-retrace generate: could not load the drafter no-owner/no-such-drafter: "):
        cli.main(["generate", "hi", "--target", str(saved["target"]), "--drafter", "no-owner/no-such-drafter"])


def test_a_bad_policy_variable_fails_before_any_model_loads(monkeypatch, tmp_path, nothing_loads):
    monkeypatch.setenv("HF_RETRACE_POLICY", "garbage")
    with pytest.raises(SystemExit, match=r"hf-retrace generate: HF_RETRACE_POLICY=garbage: expected auto, shipped, "
                                         r"off, or the path of a JSON policy file"):
        cli.main(["generate", "hi"])
    broken = tmp_path / "policy.json"
    broken.write_text("{")
    monkeypatch.setenv("HF_RETRACE_POLICY", str(broken))
    with pytest.raises(SystemExit, match="hf-retrace generate: HF_RETRACE_POLICY=.*not JSON"):
        cli.main(["generate", "hi"])


def test_tune_refuses_a_json_path_it_could_not_write_before_tuning(tmp_path, nothing_loads):
    with pytest.raises(SystemExit, match=r"--json: the tuning result would go to .*missing.*does not exist.*Nothing "
                                         "was run"):
        cli.main(["tune", "--json", str(tmp_path / "missing" / "dir" / "x.json")])


@pytest.mark.parametrize("command", [["tune"], ["generate", "hi"]])
def test_a_cache_variable_that_is_no_folder_is_refused_in_words(command, tmp_path, monkeypatch, nothing_loads):
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("")
    monkeypatch.setenv("HF_RETRACE_CACHE", str(a_file))
    with pytest.raises(SystemExit, match=rf"hf-retrace {command[0]}: HF_RETRACE_CACHE=.*not-a-folder is not a folder.*"
                                         "set HF_RETRACE_CACHE to a folder"):
        cli.main(command)
    monkeypatch.setenv("HF_RETRACE_CACHE", str(a_file / "below"))
    with pytest.raises(SystemExit, match=r"below cannot be created \(.*not-a-folder is not a writable folder\)"):
        cli.main(command)


@pytest.mark.slow  # two processes
def test_the_command_prints_no_traceback(tmp_path):
    """As a user runs it: a non-zero exit and the error, never a traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_RETRACE_CACHE": str(tmp_path / "file")}
    (tmp_path / "file").write_text("")
    for argv, words in ((["generate", "hi", "--drafter", "/no/such/folder"], "/no/such/folder: no such folder"),
                        (["tune"], "is not a folder")):
        run = subprocess.run([sys.executable, "-m", "hf_retrace.cli", *argv], env=env, capture_output=True, text=True,
                             timeout=240)
        assert run.returncode != 0
        assert "Traceback" not in run.stderr and words in run.stderr, run.stderr
