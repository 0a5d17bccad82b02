"""A run's checkpoints: written atomically, found again on resume, exported as a drafter folder.

``out_dir/checkpoints/step-N/`` holds ``model.safetensors`` (the objective's trainable module: ``drafter.*``),
``optimizer.pt`` (tensors and numbers only) and ``trainer_state.json`` (steps, micro-steps, tokens: the data order and
the schedule are pure functions of them). A checkpoint is written into a temporary sibling, flushed, then renamed
(:func:`~hf_retrace.atomic.atomic_folder`), so a kill never leaves a torn one; only the newest ``keep`` are kept. One
damaged later (a file cut short by a full disk or an interrupted copy) is found by :func:`checkpoint_problem`, which
names the file, and passed over on resume.

Example::

    latest_checkpoint("runs/drafter")  # runs/drafter/checkpoints/step-1500
    export_checkpoint("runs/drafter", "runs/drafter/export")  # a from_pretrained folder of a run stopped early
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..atomic import atomic_folder, temporary_folders
from ..configuration import ReTraceConfig
from ..loading import torch_dtype

__all__ = ["checkpoint_problem", "export_checkpoint", "latest_checkpoint", "read_checkpoint", "save_in_dtype",
           "step_checkpoints", "truncate_log", "write_checkpoint"]

CHECKPOINTS = "checkpoints"
CHECKPOINT_MODEL = "model.safetensors"
CHECKPOINT_OPTIMIZER = "optimizer.pt"  # tensors and numbers only: loaded with weights_only=True
TRAINER_STATE = "trainer_state.json"
DRAFTER_INIT = "drafter_init.json"  # the run's drafter config: what export_checkpoint builds the weights into
RUN_SETTINGS = "run_settings.json"  # the run's settings (stage, data, schedule): what --resume must find unchanged


def _fsync_folder(folder: Path) -> None:
    """Flush every file of ``folder`` and the folder itself, so a rename after it never exposes torn files."""
    for path in folder.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_checkpoints(out_dir: str | os.PathLike[str]) -> list[Path]:
    """Every ``out_dir/checkpoints/step-N`` folder, newest first, intact or not."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := re.fullmatch(r"step-(\d+)", p.name)) and p.is_dir()]
    return [path for _, path in sorted(found, reverse=True)]


def _optimizer_file(path: Path) -> Path:
    optimizer_file = path / CHECKPOINT_OPTIMIZER
    return optimizer_file if optimizer_file.exists() else path / "optimizer.bin"  # accelerate's save_state name


def checkpoint_problem(path: Path, optimizer_state: bool = True) -> str | None:
    """What keeps checkpoint ``path`` from loading (a file missing, cut short or unreadable), naming the file; None
    when it is intact. Cheap, no tensor is read: the weights' safetensors header (safetensors checks that the file
    covers it), the optimizer archive's index (a zip's index is at its end: a cut file has none; not checked with
    ``optimizer_state=False``, for an export, which reads the weights only), the trainer state."""
    from safetensors import safe_open

    model, optimizer, state = path / CHECKPOINT_MODEL, _optimizer_file(path), path / TRAINER_STATE
    needed = ((model, CHECKPOINT_MODEL), (optimizer, CHECKPOINT_OPTIMIZER), (state, TRAINER_STATE))
    for file, name in needed if optimizer_state else (needed[0], needed[2]):
        if not file.is_file():
            return f"{name} is missing"
    try:
        with safe_open(str(model), framework="pt"):
            pass
    except Exception as error:  # noqa: BLE001 - SafetensorError and OSError alike: the file cannot be read
        return f"{model.name} cannot be read: {error}"
    try:
        if optimizer_state:
            zipfile.ZipFile(optimizer).close()  # torch.save writes a zip archive
    except (zipfile.BadZipFile, OSError) as error:
        return f"{optimizer.name} cannot be read: {error}"
    try:
        step = json.loads(state.read_text()).get("step")
    except (ValueError, OSError, AttributeError) as error:
        return f"{state.name} cannot be read: {error}"
    return None if isinstance(step, int) else f"{state.name} has no step"


def latest_checkpoint(out_dir: str | os.PathLike[str], optimizer_state: bool = True) -> Path | None:
    """The newest intact ``out_dir/checkpoints/step-N`` (:func:`checkpoint_problem` finds nothing), or None."""
    return next((p for p in step_checkpoints(out_dir) if checkpoint_problem(p, optimizer_state) is None), None)


def write_checkpoint(accelerator: Any, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                     out_dir: Path, keep: int) -> Path:
    """Write ``out_dir/checkpoints/step-N`` (N = ``state["step"]``) and keep the newest ``keep``.

    Every process calls it; the main one writes."""
    root = out_dir / CHECKPOINTS
    final = root / f"step-{state['step']}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        for stale in temporary_folders(final):  # a killed save's: the main process is this run's only writer
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:  # weights and optimizer are replicated across processes: one copy, no pickle
        from safetensors.torch import save_file

        with atomic_folder(final) as tmp:  # replaces a damaged step-N that a resume passed over
            model_state = accelerator.unwrap_model(model).state_dict()
            save_file({k: v.detach().contiguous() for k, v in model_state.items()}, str(tmp / CHECKPOINT_MODEL))
            torch.save(optimizer.state_dict(), tmp / CHECKPOINT_OPTIMIZER)
            (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2))
            _fsync_folder(tmp)
        kept = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := re.fullmatch(r"step-(\d+)", p.name)))
        for _, old in kept[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def read_checkpoint(accelerator: Any, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> dict[str, Any]:
    """Load a checkpoint's weights and optimizer state in place; return its trainer state."""
    from safetensors.torch import load_file

    weights = _read(path / CHECKPOINT_MODEL, lambda file: load_file(str(file)))
    optimizer_file = _optimizer_file(path)
    optimizer_state = _read(optimizer_file, lambda file: torch.load(file, map_location="cpu", weights_only=True))
    state = _read(path / TRAINER_STATE, lambda file: json.loads(file.read_text()))
    accelerator.unwrap_model(model).load_state_dict(weights)
    optimizer.load_state_dict(optimizer_state)
    return state


def _read(file: Path, reader: Any) -> Any:
    """``reader(file)``; a file that cannot be read raises an error naming it and what to do."""
    try:
        return reader(file)
    except Exception as error:  # noqa: BLE001 - SafetensorError, torch's RuntimeError, JSONDecodeError, OSError
        raise RuntimeError(f"{file} cannot be read ({type(error).__name__}: {error}): the checkpoint {file.parent} is "
                           f"damaged. Delete that folder to resume from the checkpoint before it.") from error


def truncate_log(path: Path, step: int) -> None:
    """Drop the lines of a JSONL training log after ``step`` (a resumed run redoes those steps)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a kill mid-write: drop it
            continue
        if record.get("step", 0) <= step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


def save_in_dtype(drafter: nn.Module, out_dir: str | os.PathLike[str], dtype: str) -> None:
    """``save_pretrained`` (safetensors) with the weights and ``config.dtype`` in ``dtype`` (either spelling)."""
    drafter.to(torch_dtype(dtype))
    drafter.config.dtype = str(torch_dtype(dtype)).removeprefix("torch.")
    drafter.save_pretrained(out_dir, safe_serialization=True)


def export_checkpoint(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                      checkpoint: str | os.PathLike[str] | None = None, dtype: str = "bfloat16") -> Path:
    """Save the drafter of a run's checkpoint (default: the latest) as a ``from_pretrained`` folder.

    For a run stopped before its end (killed, or cut short on purpose): the architecture comes from the run's
    ``drafter_init.json``, the weights from ``checkpoints/step-N/model.safetensors``.
    """
    from safetensors.torch import load_file

    from ..modeling import ReTraceDrafter

    run_dir = Path(run_dir)
    checkpoint = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir, optimizer_state=False)
    if checkpoint is None:
        raise FileNotFoundError(f"{run_dir} has no complete checkpoint to export.")
    config = ReTraceConfig.from_dict(json.loads((run_dir / DRAFTER_INIT).read_text())["config"])
    state = {k.removeprefix("drafter."): v for k, v in load_file(str(checkpoint / CHECKPOINT_MODEL)).items()}
    if any(k.startswith("retrace.") for k in state) and config.retrace == "absent":
        config.retrace = "untrained"
    settings = run_dir / RUN_SETTINGS
    if settings.is_file() and json.loads(settings.read_text()).get("stage") == "retrace":
        config.retrace = "trained"  # the run trained the module (on in the shipped policy), as in its own final save
    drafter = ReTraceDrafter(config)
    drafter.load_state_dict(state, strict=True)
    save_in_dtype(drafter, out_dir, dtype)
    return Path(out_dir)
