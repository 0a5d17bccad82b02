"""Where the drafter runs: beside the target's input embeddings, checked before the target runs.

The drafter embeds its block with the target's input embeddings, reads the target's tapped hidden states and scores
its drafts with the target's ``lm_head``. The rules, applied by the dispatch's validation (before the prefill):

- the target's input embeddings and ``lm_head`` must hold their weights on a device: an offloaded module (accelerate
  ``cpu``/``disk`` offload) keeps them on the ``meta`` device and loads them only inside its own forward, which the
  drafter never calls. Refused, with what to do;
- the drafter follows the device of the target's input embeddings: moved there (one info line in the log) when it can
  be moved; refused, with what to do, when it cannot (quantized, dispatched or offloaded by accelerate);
- draft-vocabulary scores are indexed on the ``lm_head``'s device (the candidate generator), so a target split over
  devices (``device_map="auto"``) needs no copy of the head.

Example::

    place_drafter(drafter, target)         # no-op when it is already there; else moved, or a ValueError
    synchronize(target.device)             # before reading a clock: the device's queued work is done
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

__all__ = ["drafter_devices", "embedding_device", "head_device", "place_drafter", "synchronize"]

logger = logging.getLogger(__name__)


def _weight_device(module: Any, what: str) -> torch.device:
    """The device of ``module.weight``; a ValueError when it is offloaded (on the meta device)."""
    device = module.weight.device
    if device.type == "meta":
        raise ValueError(
            f"The target's {what} is offloaded: its weights are on the meta device and are loaded only inside its "
            "own forward, but the drafter reads them directly. Load the target with its input embeddings and lm_head "
            "on a device: a device_map that puts them on a GPU or on 'cpu' (e.g. device_map='auto' with enough "
            "max_memory, or an explicit map), or drop `assistant_model`."
        )
    return device


def embedding_device(target: Any) -> torch.device:
    """The device of the target's input embeddings: where the drafter runs."""
    return _weight_device(target.get_input_embeddings(), "input embeddings")


def head_device(target: Any) -> torch.device:
    """The device of the target's ``lm_head``: where draft scores are computed and the draft vocabulary indexed."""
    return _weight_device(target.get_output_embeddings(), "lm_head")


def drafter_devices(drafter: Any) -> set[torch.device]:
    """Every device holding one of the drafter's weights or buffers."""
    return {t.device for t in itertools.chain(drafter.parameters(), drafter.buffers())}


def _why_immovable(drafter: Any, devices: set[torch.device]) -> str | None:
    """Why ``drafter.to(device)`` would not give a working drafter there (None: it would)."""
    if getattr(drafter, "is_quantized", False) or getattr(drafter, "hf_quantizer", None) is not None:
        return "it is quantized, and quantized weights are placed when they are loaded"
    if any(device.type == "meta" for device in devices):
        return "some of its weights are on the meta device (offloaded by accelerate, or never loaded)"
    device_map = getattr(drafter, "hf_device_map", None)
    if device_map and len(set(device_map.values())) > 1:
        return f"accelerate dispatched it over {sorted(map(str, set(device_map.values())))}"
    return None


def place_drafter(drafter: Any, target: Any) -> torch.device:
    """Put ``drafter`` on the device of ``target``'s input embeddings (moved once, with an info log line), or raise a
    ValueError saying what to do; also refuses an offloaded ``lm_head``. Returns that device."""
    device = embedding_device(target)
    head_device(target)
    devices = drafter_devices(drafter)
    if devices == {device}:
        return device
    reason = _why_immovable(drafter, devices)
    where = ", ".join(sorted(map(str, devices)))
    if reason is not None:
        raise ValueError(
            f"The drafter is on {where}, but the target's input embeddings are on {device}, and the drafter cannot "
            f"be moved there: {reason}. Load the drafter whole on {device}, e.g. "
            f"`ReTraceDrafter.from_pretrained(path).to('{device}')` or `hf_retrace.loading.load_drafter(path, "
            f"device='{device}')`."
        )
    logger.info("hf_retrace: moved the drafter from %s to %s, the device of the target's input embeddings", where,
                device)
    drafter.to(device)
    return device


def synchronize(device: torch.device | str | None) -> None:
    """Wait until ``device`` has run the work queued on it, so that a host clock read next times the work and not its
    launch. A no-op on the CPU (and for ``None``). Every timing of the benchmark and the calibration goes through it.

    For a target split over several GPUs, pass the device of its output (the last one to finish)."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type not in ("cpu", "meta"):
        backend = getattr(torch, device.type, None)  # xpu, mps: torch.<type>.synchronize()
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize()
