"""The policy cache: its folder, atomic writes of its JSON entries, and this process's memo of the entries it has
read, with the lock that guards the process's tuning state (:mod:`.auto` tunes and reads entries, :mod:`.realized`
writes real calls' figures into them)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from ..atomic import write_text_atomically
from ..defaults import cache_root
from ..generation.policy import RoundPolicy

__all__ = ["policy_cache_dir", "write_atomically"]

_MEMO: dict[str, dict[str, RoundPolicy]] = {}  # digest -> temperature -> the policy this process resolved
_LOCK = threading.Lock()


def policy_cache_dir() -> Path:
    return cache_root() / "policies"


def write_atomically(path: Path, data: dict[str, Any]) -> None:
    """Write JSON to ``path`` through a temporary file in the same folder and one rename: a reader sees the old file or
    the new one, never a part; two writers at once leave one of their files whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(data, indent=1))
