"""Write a file whole or not at all: through a temporary sibling renamed over it, so a reader (or a resume after a
crash) never sees half a file. One rule for every writer of the package.

Example::

    with atomic_path(out / "manifest.json") as temporary:
        temporary.write_text(text)          # renamed over manifest.json when the block ends without an error
    write_text_atomically(out / "ids.json", "[1, 2]")
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path", "write_text_atomically"]


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write, renamed over ``path`` when the block ends; removed if it raises.

    The name is unique per process and thread (concurrent writers never share one) and keeps ``path``'s suffix
    (``np.save`` adds ``.npy`` to a name without it)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp{path.suffix}")
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_text_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all."""
    with atomic_path(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
