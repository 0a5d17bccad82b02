"""Inputs refused early (issue 26): each error names what is wrong and what to do, comes before any model loads or any
long work starts, and leaves every file as it was. A prompt past the target's context, a calibration that could not
write its result, damaged checkpoints and drafter weights, an export onto its own source; and tau after a stop."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_drafter, tiny_target, word_level_tokenizer

import hf_retrace  # noqa: F401  (installs the generate hook)
from hf_retrace import ReTraceDrafter
from hf_retrace.generation.checks import check_context
from hf_retrace.stats import GenerationStats

CONTEXT = 32


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _truncate(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(max(1, path.stat().st_size // 2))


@pytest.fixture
def short_context_pair():
    target = tiny_target(family="llama", max_position_embeddings=CONTEXT, logit_scale=4.0)
    return target, tiny_drafter(target, block_size=4)


# --------------------------------------------------------------------------------------------------------------
# a prompt longer than the target's context
# --------------------------------------------------------------------------------------------------------------


def test_a_prompt_past_the_context_is_refused_before_the_target_runs(short_context_pair, count_forwards):
    target, drafter = short_context_pair
    forwards = count_forwards(target)
    prompt = torch.randint(0, 95, (1, CONTEXT + 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=rf"prompt of {CONTEXT + 8} tokens exceeds .* {CONTEXT} positions "
                                         r"\(max_position_embeddings\), 8 too many.*shorten it to at most 32 tokens"):
        target.generate(prompt, assistant_model=drafter, max_new_tokens=4, do_sample=False)
    assert forwards["n"] == 0
    fits = prompt[:, :CONTEXT]  # a prompt that fills the context exactly still gets its next token, as plain does
    out = target.generate(fits, assistant_model=drafter, max_new_tokens=1, do_sample=False)
    assert out.tolist() == target.generate(fits, max_new_tokens=1, do_sample=False).tolist()


def test_the_demo_counts_the_new_tokens_with_the_same_rule(short_context_pair):
    from hf_retrace.demo.engine import DemoEngine
    from hf_retrace.demo.limits import DemoError

    target, _ = short_context_pair
    check_context(target, 20, 12)  # exactly the context: fits
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\) \+ 13 new tokens = 33 exceeds .* 32 positions"):
        check_context(target, 20, 13)
    with pytest.raises(DemoError, match="at most 19 tokens or ask for fewer new tokens"):
        DemoEngine._check_context(SimpleNamespace(target=target), torch.zeros(1, 20, dtype=torch.long), 13)


def test_the_generate_command_refuses_a_prompt_past_the_context_before_generating(tmp_path, monkeypatch):
    from hf_retrace import side_by_side
    from hf_retrace.cli import main

    target = tiny_target(family="llama", max_position_embeddings=CONTEXT, dtype=torch.float32)
    target.save_pretrained(tmp_path / "target")
    word_level_tokenizer().save_pretrained(tmp_path / "target")
    tiny_drafter(target).save_pretrained(tmp_path / "drafter")
    monkeypatch.setattr(side_by_side, "compare", lambda *a, **k: pytest.fail("generated past the context"))
    prompt = " ".join(["the"] * 40)
    with pytest.raises(SystemExit, match=r"hf-retrace generate: The prompt of \d+ tokens exceeds .* 32 positions"):
        main(["generate", prompt, "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
              "--dtype", "fp32"])


# --------------------------------------------------------------------------------------------------------------
# calibrate --write / --json into a place it cannot write
# --------------------------------------------------------------------------------------------------------------


def _unwritable(path: Path, monkeypatch) -> None:
    """``path`` read-only; where the user is root (who writes anyway) os.access stands in for a read-only mount."""
    path.chmod(0o555 if path.is_dir() else 0o444)
    if os.access(path, os.W_OK):
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: (not mode & os.W_OK or Path(p) != path)
                            and real(p, mode, *a, **k))


@pytest.mark.parametrize("flag", ["--write", "--json"])
def test_calibrate_refuses_an_output_it_cannot_write_before_any_model_loads(tmp_path, monkeypatch, flag):
    from hf_retrace.training.cli import commands

    drafter = tmp_path / "drafter"
    tiny_drafter(tiny_target(dtype=torch.float32)).save_pretrained(drafter)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    monkeypatch.setattr(commands, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(commands, "load_drafter", lambda *a, **k: pytest.fail("a model was loaded"))
    base = ["calibrate", "--target", "default", "--drafter", str(drafter), "--prompts", str(prompts)]
    if flag == "--write":
        before = _snapshot(drafter)
        _unwritable(drafter, monkeypatch)
        with pytest.raises(SystemExit, match=f"--write: .* cannot write {drafter} .*Nothing was run"):
            commands.main([*base, "--write"])
        drafter.chmod(0o755)
        assert _snapshot(drafter) == before
    else:
        with pytest.raises(SystemExit, match=r"--json: .* the folder .*missing does not exist"):
            commands.main([*base, "--json", str(tmp_path / "missing" / "table.json")])
        (tmp_path / "out").mkdir()
        _unwritable(tmp_path / "out", monkeypatch)
        with pytest.raises(SystemExit, match=r"--json: the table would go to .* cannot write"):
            commands.main([*base, "--json", str(tmp_path / "out" / "table.json")])
        (tmp_path / "out").chmod(0o755)
        assert not list((tmp_path / "out").iterdir())


# --------------------------------------------------------------------------------------------------------------
# train --resume on a damaged newest checkpoint
# --------------------------------------------------------------------------------------------------------------


class _OneProcess:
    is_main_process = True

    def wait_for_everyone(self):
        pass

    def unwrap_model(self, model):
        return model


def _run_with_checkpoints(out: Path, steps=(2, 4)) -> None:
    """``out`` as a run leaves it: run_settings.json and intact checkpoints at ``steps``."""
    from hf_retrace.training.checkpoints import RUN_SETTINGS, write_checkpoint

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    out.mkdir()
    (out / RUN_SETTINGS).write_text(json.dumps({"stage": "backbone", "lr": 0.001}))
    for step in steps:
        write_checkpoint(_OneProcess(), model, optimizer, {"step": step, "micro_step": 2 * step}, out, keep=5)


@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.pt", "trainer_state.json"])
def test_resume_passes_over_a_damaged_newest_checkpoint_naming_the_file(tmp_path, capsys, damaged):
    from hf_retrace.training.checkpoints import checkpoint_problem, latest_checkpoint, read_checkpoint
    from hf_retrace.training.cli.checks import check_resume_files

    out = tmp_path / "run"
    _run_with_checkpoints(out)
    newest = out / "checkpoints" / "step-4"
    assert checkpoint_problem(newest) is None
    _truncate(newest / damaged)
    before = _snapshot(out)
    assert damaged in checkpoint_problem(newest)
    assert check_resume_files(out) == out / "checkpoints" / "step-2" == latest_checkpoint(out)
    warning = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged ({damaged}" in warning and "resuming from step-2" in warning
    assert _snapshot(out) == before, "checking changes nothing on disk"
    model = torch.nn.Linear(4, 4)  # read anyway (e.g. named by hand): the error names the file and what to do
    with pytest.raises(RuntimeError, match=f"{newest / damaged} cannot be read .*Delete that folder"):
        read_checkpoint(_OneProcess(), model, torch.optim.AdamW(model.parameters()), newest)


def test_a_checkpoint_rewritten_over_a_damaged_one_holds_the_new_files_only(tmp_path):
    """The step a resume passed over is written again: replaced whole, and a killed save's temporary is removed."""
    from hf_retrace.training.checkpoints import CHECKPOINTS, checkpoint_problem, write_checkpoint

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    step = tmp_path / CHECKPOINTS / "step-4"
    step.mkdir(parents=True)
    (step / "optimizer.pt").write_bytes(b"torn")
    (step / "optimizer.bin").write_bytes(b"an older layout's file")
    killed = tmp_path / CHECKPOINTS / ".step-4.tmp-999-1"  # a save killed before its rename
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"torn")
    assert write_checkpoint(_OneProcess(), model, optimizer, {"step": 4, "micro_step": 8}, tmp_path, keep=5) == step
    assert checkpoint_problem(step) is None
    assert sorted(p.name for p in step.iterdir()) == ["model.safetensors", "optimizer.pt", "trainer_state.json"]
    assert json.loads((step / "trainer_state.json").read_text()) == {"step": 4, "micro_step": 8}
    assert [p.name for p in (tmp_path / CHECKPOINTS).iterdir()] == ["step-4"]


def test_resume_is_refused_when_no_checkpoint_or_the_settings_cannot_be_read(tmp_path):
    from hf_retrace.training.cli.checks import RUN_SETTINGS, check_resume_files

    out = tmp_path / "run"
    _run_with_checkpoints(out)
    for step in (2, 4):
        _truncate(out / "checkpoints" / f"step-{step}" / "optimizer.pt")
    before = _snapshot(out)
    with pytest.raises(SystemExit, match=r"no checkpoint in .* can be loaded \(step-4: optimizer.pt cannot be read.*"
                                         r"step-2: optimizer.pt.*--overwrite"):
        check_resume_files(out)
    out2 = tmp_path / "run2"
    _run_with_checkpoints(out2)
    _truncate(out2 / RUN_SETTINGS)
    with pytest.raises(SystemExit, match=f"{out2 / RUN_SETTINGS} cannot be read .*delete it to resume"):
        check_resume_files(out2)
    assert _snapshot(out) == before


# --------------------------------------------------------------------------------------------------------------
# a drafter folder whose weights were cut short; export onto the drafter's own folder
# --------------------------------------------------------------------------------------------------------------


def test_a_truncated_drafter_weights_file_is_named(tmp_path):
    folder = tmp_path / "drafter"
    tiny_drafter(tiny_target(dtype=torch.float32)).save_pretrained(folder)
    _truncate(folder / "model.safetensors")
    before = _snapshot(folder)
    with pytest.raises(OSError, match=f"weights file {folder / 'model.safetensors'} cannot be read .*cut short.*"
                                      "copy the folder again"):
        ReTraceDrafter.from_pretrained(folder)
    assert _snapshot(folder) == before


def test_export_refuses_to_overwrite_the_drafter_it_reads(tmp_path):
    from hf_retrace.cli import main

    folder = tmp_path / "drafter"
    tiny_drafter(tiny_target(dtype=torch.float32)).save_pretrained(folder)
    before = _snapshot(folder)
    with pytest.raises(SystemExit, match="is the folder the drafter was loaded from.*Pick another --out"):
        main(["export", "--drafter", str(folder), "--out", str(folder), "--overwrite"])
    with pytest.raises(SystemExit, match="is the folder the drafter was loaded from"):  # the same folder, spelled apart
        main(["export", "--drafter", str(folder), "--out", str(folder / ".." / "drafter"), "--overwrite"])
    assert _snapshot(folder) == before


# --------------------------------------------------------------------------------------------------------------
# tau after a stop inside a round
# --------------------------------------------------------------------------------------------------------------


def test_a_cut_at_a_stop_takes_the_cut_tokens_out_of_the_last_rounds_acceptance_length():
    stats = GenerationStats(new_tokens=13)
    stats.record_round(drafted=5, accepted=5, fused=False)  # 6 tokens
    stats.record_round(drafted=5, accepted=5, fused=False)  # 6 tokens, the stop after its 2nd
    stats.cut_at(9)
    assert stats.new_tokens == 9 and stats.acceptance_lengths == [6, 2]
    assert stats.mean_acceptance_length == 4.0
    assert stats.accepted_at_position == [2] * 5, "the drafts the target accepted stay counted per position"
    stats.cut_at(12)  # a cut past the tokens kept changes nothing
    assert stats.new_tokens == 9 and stats.acceptance_lengths == [6, 2]
