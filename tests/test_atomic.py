"""Tests for hf_retrace.atomic's folders (``atomic_folder``, ``temporary_folders``) and the writers that use them:
a folder appears whole or not at all, whatever happens inside the block."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hf_retrace import defaults
from hf_retrace.atomic import atomic_folder, atomic_path, stale_temporaries, temporary_folders


def _contents(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def _write(folder: Path, tag: str) -> None:
    (folder / "weights.bin").write_text(f"weights of {tag}")
    (folder / "nested").mkdir()
    (folder / "nested" / "config.json").write_text(json.dumps({"tag": tag}))


def _expected(tag: str) -> dict[str, str]:
    return {"nested/config.json": json.dumps({"tag": tag}), "weights.bin": f"weights of {tag}"}


def test_the_folder_appears_whole_when_the_block_ends(tmp_path):
    path = tmp_path / "step-4"
    with atomic_folder(path) as temporary:
        assert temporary.parent == tmp_path and temporary.name.startswith(".step-4.tmp-")
        assert not any(temporary.iterdir())
        _write(temporary, "new")
        assert not path.exists(), "nothing is visible under the final name before the block ends"
        assert temporary_folders(path) == [temporary]
    assert _contents(path) == _expected("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"], "the temporary folder is gone"


def test_an_error_inside_the_block_leaves_neither_the_folder_nor_a_temporary(tmp_path):
    path = tmp_path / "step-4"
    with pytest.raises(KeyboardInterrupt, match="killed"):  # BaseException: a Ctrl-C is cleaned up too
        with atomic_folder(path) as temporary:
            _write(temporary, "half")
            raise KeyboardInterrupt("killed mid-save")
    assert not list(tmp_path.iterdir())


def test_an_existing_folder_is_replaced_whole_and_kept_on_an_error(tmp_path):
    path = tmp_path / "step-4"
    path.mkdir()
    _write(path, "old")
    (path / "torn.bin").write_text("a file the new folder does not have")
    with pytest.raises(RuntimeError):
        with atomic_folder(path) as temporary:
            _write(temporary, "failed")
            raise RuntimeError("disk full")
    assert _contents(path) == {**_expected("old"), "torn.bin": "a file the new folder does not have"}

    with atomic_folder(path) as temporary:
        _write(temporary, "new")
    assert _contents(path) == _expected("new"), "no file of the old folder is left in the new one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"], "neither the old folder nor a temporary is left"


def test_the_old_folder_is_kept_when_the_new_one_cannot_be_renamed_in(tmp_path, monkeypatch):
    path = tmp_path / "step-4"
    path.mkdir()
    _write(path, "old")
    rename = os.rename

    def fails_for_the_new_folder(source, destination):
        if Path(source).name.startswith(".step-4.tmp-") and "old" not in Path(source).name:
            raise OSError("no space left on device")
        rename(source, destination)

    monkeypatch.setattr(os, "rename", fails_for_the_new_folder)
    with pytest.raises(OSError, match="no space"):
        with atomic_folder(path) as temporary:
            _write(temporary, "new")
    assert _contents(path) == _expected("old")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]


def test_a_temporary_left_under_this_writers_own_name_is_not_carried_into_the_folder(tmp_path):
    """A killed process with the same pid (a restarted container) left our temporary name: we start from empty."""
    path = tmp_path / "target"
    with atomic_folder(path) as temporary:
        name = temporary.name
    stale = tmp_path / name
    stale.mkdir()
    (stale / "torn.safetensors").write_text("torn")
    path.rename(tmp_path / "elsewhere")
    with atomic_folder(path) as temporary:
        assert temporary == stale and not any(temporary.iterdir())
        _write(temporary, "new")
    assert _contents(path) == _expected("new")


def test_two_threads_writing_different_folders_do_not_collide(tmp_path):
    both_inside = threading.Barrier(2, timeout=30)
    temporaries, errors = {}, []

    def writer(tag: str) -> None:
        try:
            with atomic_folder(tmp_path / tag) as temporary:
                temporaries[tag] = temporary
                both_inside.wait()  # both temporaries exist at once
                _write(temporary, tag)
                both_inside.wait()
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(tag,)) for tag in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert temporaries["a"] != temporaries["b"]
    assert _contents(tmp_path / "a") == _expected("a") and _contents(tmp_path / "b") == _expected("b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_two_threads_writing_one_folder_get_their_own_temporaries(tmp_path):
    """A failing writer of the same folder, inside its block at the same time, removes its own temporary only: the
    other's folder still appears whole."""
    path = tmp_path / "target"
    both_inside, failed = threading.Barrier(2, timeout=30), threading.Event()
    temporaries, errors = {}, []

    def writer(tag: str) -> None:
        try:
            with atomic_folder(path) as temporary:
                temporaries[tag] = temporary
                _write(temporary, tag)
                both_inside.wait()
                if tag == "fails":
                    raise RuntimeError("the failing writer")
                assert failed.wait(timeout=30)  # the failing writer has cleaned up
        except BaseException as error:  # noqa: BLE001 - checked below
            errors.append(error)
        finally:
            if tag == "fails":
                failed.set()

    threads = [threading.Thread(target=writer, args=(tag,)) for tag in ("fails", "succeeds")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [str(error) for error in errors] == ["the failing writer"]
    assert temporaries["fails"] != temporaries["succeeds"]
    assert _contents(path) == _expected("succeeds")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


def test_temporary_folders_are_the_named_folders_leftovers_only(tmp_path):
    path = tmp_path / "model[1]"  # glob characters in the name are taken literally
    others = (".model[1]0.tmp-x", "model[1].tmp", ".model1.tmp-y")  # another name; not hidden; `[1]` read as a glob
    for name in (".model[1].tmp-killed", ".model[1].tmp-old-12-34", *others):
        (tmp_path / name).mkdir()
    assert [p.name for p in temporary_folders(path)] == [".model[1].tmp-killed", ".model[1].tmp-old-12-34"]


def killed_writer(path: Path) -> None:
    """A process killed (SIGKILL: no clean-up runs) while it writes ``path`` through atomic_path."""
    code = ("import os, signal, sys; from hf_retrace.atomic import atomic_path\n"
            "with atomic_path(sys.argv[1]) as tmp:\n"
            "    tmp.write_bytes(b'half a shard')\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    assert subprocess.run([sys.executable, "-c", code, str(path)]).returncode == -9


def test_stale_temporaries_are_a_killed_writers_files_never_a_live_ones(tmp_path):
    path = tmp_path / "features[0].bin"  # glob characters in the name are taken literally
    killed_writer(path)
    (tmp_path / ".features[0].bin.123abc.tmp.bin").write_bytes(b"not a writer's name")
    (tmp_path / ".features0.bin.1-1.tmp.bin").write_bytes(b"another file's")
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".features[0].bin.") and "abc" not in p.name]
    assert len(left) == 1 and not path.exists()
    with atomic_path(path) as live:  # this process writes it too: running, so never listed
        live.write_bytes(b"being written")
        assert stale_temporaries(path) == left
    assert path.read_bytes() == b"being written" and stale_temporaries(path) == left


# --------------------------------------------------------------------------------------------------------------
# the default target's conversion: a killed one's temporaries are removed by the next one
# --------------------------------------------------------------------------------------------------------------


def test_the_conversion_removes_the_temporaries_an_interrupted_one_left(tmp_path):
    dest = tmp_path / defaults.DEFAULT_TARGET_DIRNAME
    for name in (f".{dest.name}.tmp-killed", f".{dest.name}.tmp-old-{os.getpid()}-1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"torn")
    (tmp_path / "other-model").mkdir()
    defaults._remove_leftovers(dest, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["other-model"]
