"""The drafters a demo serves: "DFlash backbone" and "ReTrace" as two views of one drafter's weights, and drafter
folders a request names (loaded once, the two newest kept)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..generation.checks import check_target
from .limits import METHODS, DemoError


def drafter_view(drafter: Any, retrace: bool) -> Any:
    """The same drafter (shared weights and modules) whose calls run ReTrace on or off on top of their round policy
    (``drafter.with_policy``). Nothing is mutated per request."""
    return drafter.with_policy(retrace=retrace)


@dataclass(frozen=True)
class DrafterViews:
    """One loaded drafter as the methods see it.

    Example: ``DrafterViews.of(drafter, "my-drafter").for_method("dflash")``
    """

    source: str
    backbone: Any
    retrace: Any | None  # None: the drafter has no ReTrace module (a plain DFlash checkpoint)
    retrace_state: str  # absent / untrained / trained (ReTraceConfig.retrace)

    @classmethod
    def of(cls, drafter: Any, source: str) -> "DrafterViews":
        has_retrace = getattr(drafter, "retrace", None) is not None
        return cls(
            source=source,
            backbone=drafter_view(drafter, False),
            retrace=drafter_view(drafter, True) if has_retrace else None,
            retrace_state=drafter.config.retrace,
        )

    def for_method(self, method: str) -> Any:
        if method == "dflash":
            return self.backbone
        if self.retrace is None:
            raise DemoError(
                f"the drafter {self.source} has no ReTrace module (a plain DFlash checkpoint): choose "
                f"'{METHODS['dflash']}'."
            )
        return self.retrace


class DrafterFolders:
    """Drafter folders on the server, loaded for ``target`` on first use; the ``keep`` most recently used stay."""

    def __init__(self, target: Any, keep: int = 2):
        self.target, self.keep = target, keep
        self._loaded: OrderedDict[str, DrafterViews] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: str) -> DrafterViews:
        folder = Path(str(path).strip()).expanduser()
        if not folder.is_dir():
            raise DemoError(f"{str(path).strip()!r} is not a folder on the server; give the folder of a drafter "
                            "(config.json + model.safetensors).")
        key = str(folder.resolve())
        with self._lock:
            if key in self._loaded:
                self._loaded.move_to_end(key)
                return self._loaded[key]
            if not (folder / "config.json").is_file():
                raise DemoError(f"{key} is not a drafter folder: it has no config.json.")
            views = DrafterViews.of(self._load(key), key)
            self._loaded[key] = views
            while len(self._loaded) > self.keep:
                self._loaded.popitem(last=False)
            return views

    def _load(self, folder: str) -> Any:
        from ..loading import load_drafter

        try:
            drafter = load_drafter(folder, self.target.dtype).to(self.target.device)
            check_target(drafter, self.target)
        except Exception as exc:  # noqa: BLE001 - a wrong folder is the user's input, not a server failure
            raise DemoError(f"{folder} is not a drafter for this target: {exc}") from exc
        return drafter
