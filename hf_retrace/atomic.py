"""Write a file or a folder whole or not at all: through a temporary sibling renamed over it, so a reader (or a resume
after a crash) never sees half of it. One rule for every writer of the package.

Example::

    with atomic_path(out / "manifest.json") as temporary:
        temporary.write_text(text)          # renamed over manifest.json when the block ends without an error
    write_text_atomically(out / "ids.json", "[1, 2]")
    with atomic_folder(out / "step-100") as temporary:
        model.save_pretrained(temporary)    # renamed to step-100 (replacing an older one) when the block ends
    temporary_folders(out / "step-100")     # what a killed writer left: out/.step-100.tmp-*
    stale_temporaries(out / "ids.json")     # the temporary files of writers of ids.json no longer running here
"""

from __future__ import annotations

import glob
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_folder", "atomic_path", "stale_temporaries", "temporary_folders", "write_text_atomically"]


def _writer_tag() -> str:
    """Unique per process and thread: concurrent writers never share a temporary name."""
    return f"{os.getpid()}-{threading.get_ident()}"


def _temporary_file(path: Path, tag: str) -> Path:
    return path.with_name(f".{path.name}.{tag}.tmp{path.suffix}")


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write, renamed over ``path`` when the block ends; removed if it raises.

    The name is unique per process and thread (concurrent writers never share one) and keeps ``path``'s suffix
    (``np.save`` adds ``.npy`` to a name without it)."""
    path = Path(path)
    temporary = _temporary_file(path, _writer_tag())
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_text_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all."""
    with atomic_path(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


def _folder_prefix(path: Path) -> str:
    return f".{path.name}.tmp-"


@contextmanager
def atomic_folder(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh, empty temporary sibling folder of ``path`` to fill, renamed to ``path`` when the block ends; removed
    (with what was written into it) if the block raises.

    An existing ``path`` is replaced whole: moved aside, the new folder renamed in, the old one removed (a kill between
    the two renames leaves no ``path``, never a mix of both). The parent folder must exist; writers of one ``path``
    must take turns (a lock, or one writing process): two finishing at once may fail. Temporary names (the old
    folder's aside too) start with ``.{name}.tmp-`` and are unique per process and thread: :func:`temporary_folders`
    finds what a killed writer left. Flushing the files to disk before the rename (against a power loss) is the
    caller's choice."""
    path = Path(path)
    temporary = path.with_name(_folder_prefix(path) + _writer_tag())
    shutil.rmtree(temporary, ignore_errors=True)  # this name is ours: only a killed process that had our pid left it
    temporary.mkdir()
    try:
        yield temporary
        _rename_over(temporary, path)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _rename_over(folder: Path, path: Path) -> None:
    """Rename ``folder`` to ``path``; an existing ``path`` is moved aside first and removed after."""
    if not os.path.lexists(path):
        os.rename(folder, path)
        return
    aside = path.with_name(f"{_folder_prefix(path)}old-{_writer_tag()}")
    os.rename(path, aside)
    try:
        os.rename(folder, path)
    except BaseException:
        os.rename(aside, path)
        raise
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside)
    else:
        aside.unlink()


def temporary_folders(path: str | os.PathLike[str]) -> list[Path]:
    """The temporary folders :func:`atomic_folder` made for ``path`` that are still there: a killed writer's, or a live
    one's (call it where writers of ``path`` are serialised, e.g. under their lock, before removing what it finds)."""
    path = Path(path)
    return sorted(path.parent.glob(glob.escape(_folder_prefix(path)) + "*"))


def _running(pid: int) -> bool:
    if os.name == "nt":  # os.kill there terminates the process: never call it, take every writer as running
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def stale_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """The temporary files :func:`atomic_path` made for ``path`` whose writing process no longer runs on this machine:
    what a killed writer left (a kill skips the block's clean-up), safe to remove. A live writer's are never listed,
    so writers of one file need not take turns to call it (on Windows, where no process is probed, none is listed)."""
    path = Path(path)
    head, tail = _temporary_file(path, "*").name.split("*")
    stale = []
    for temporary in path.parent.glob(glob.escape(head) + "*" + glob.escape(tail)):
        pid = temporary.name[len(head) : -len(tail)].split("-")[0]
        if pid.isdigit() and not _running(int(pid)):
            stale.append(temporary)
    return sorted(stale)
