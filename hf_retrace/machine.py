"""What this machine's CPU can do: its model and the instruction-set flags that change a matmul's speed.

One place for the CPU facts that pick a default: the tuned round policies are keyed by them
(:func:`hf_retrace.tuning.auto.machine_key`) and ``--dtype auto`` follows them (:func:`hf_retrace.loading.resolve_dtype`).
"""

from __future__ import annotations

import contextlib
import functools
import platform
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86's AVX-512 BF16 and AMX, Arm's BF16 extension


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict[str, Any]:
    """The CPU's model and the instruction-set flags that change a matmul's speed (bf16, AMX, AVX-512, AVX2)."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    kept = sorted(f for f in flags
                  if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "avx", "asimd", "sve", "bf16"))
    return {"model": model, "flags": kept, "machine": platform.machine()}


def has_bf16_units() -> bool:
    """Whether the CPU computes bf16 natively. Without such units a bf16 matmul is emulated and batched fp32 runs
    3-4x faster (AVX2 EPYC); with them bf16 runs ~1.8x faster than fp32 (Xeon with AMX): docs/drafter-data.md."""
    return any(flag in cpu_info()["flags"] for flag in BF16_FLAGS)


class _OneDNNSwitch:
    """Torch's oneDNN (mkldnn) on/off switch, changed only through here (``torch.backends.mkldnn.flags`` would also
    reset its determinism and TF32 settings). The switch is process-wide in torch, not per thread: every change is a
    :meth:`push` closed by its :meth:`pop`, under one lock; the setting is always that of the latest push still open
    (the process's own once none is), whatever order threads close theirs in, so threads that switch at once never
    leave it changed. While two threads' pushes are open one thread's forward may run on the other's setting (other
    kernels: the same tokens up to bf16 near-ties; float32 runs the same kernels either way)."""

    lock = threading.Lock()
    base = True  # the process's own setting, read at the first push while none is open
    open: dict[int, bool] = {}  # push number -> enabled, in push order
    pushes = 0

    @classmethod
    def _apply(cls) -> None:
        import torch

        latest = next(reversed(cls.open.values()), True) if cls.open else True
        torch.backends.mkldnn.set_flags(bool(cls.base and latest), None, None, None)

    @classmethod
    def push(cls, enabled: bool) -> int:
        """Switch oneDNN to ``enabled`` (never on where the process had it off); returns the number to :meth:`pop`."""
        import torch

        with cls.lock:
            if not cls.open:
                cls.base = torch.backends.mkldnn.enabled
            cls.pushes += 1
            cls.open[cls.pushes] = bool(enabled)
            cls._apply()
            return cls.pushes

    @classmethod
    def pop(cls, number: int) -> None:
        with cls.lock:
            cls.open.pop(number, None)
            cls._apply()


@contextlib.contextmanager
def onednn_matmuls(enabled: bool) -> Iterator[None]:
    """Run the block with torch's oneDNN (mkldnn) kernels on or off, and put the process's setting back after.

    Only the on/off switch is touched. On a CPU with bf16 units torch sends bf16 matmuls to oneDNN, whose one-token
    forward can be far slower than torch's own kernels while a many-token one is far faster
    (docs/bench/2026-12-06-epyc-onednn/). ``enabled=True`` changes nothing (a process, or an enclosing block, that
    turned oneDNN off keeps it off) and costs nothing: a round asks for it thousands of times an answer. The switch
    is process-wide (:class:`_OneDNNSwitch`: threads that switch at once leave the process's setting as it was)."""
    if enabled:
        yield
        return
    number = _OneDNNSwitch.push(False)
    try:
        yield
    finally:
        _OneDNNSwitch.pop(number)


def forward_width(args: tuple, kwargs: dict[str, Any]) -> int | None:
    """The new tokens a model's forward runs, rows times positions (what a matmul's row count follows), read from its
    ``input_ids`` or ``inputs_embeds`` (keyword, else the first positional argument); None when neither is given."""
    value = kwargs.get("input_ids")
    if value is None and kwargs.get("inputs_embeds") is not None:
        return int(kwargs["inputs_embeds"].shape[:-1].numel())
    if value is None and args:
        value = args[0]
    return int(value.numel()) if hasattr(value, "numel") else None


@contextlib.contextmanager
def onednn_from_width(model: Any, width: int) -> Iterator[None]:
    """While the block runs, every forward of ``model`` over fewer than ``width`` new tokens (:func:`forward_width`)
    runs with torch's oneDNN off, wider ones with the process's setting; ``width`` of 0 or 1 changes nothing.

    Why: on an AMD EPYC with ``avx512_bf16`` a one-token bf16 forward of a 135M target took 40.7 ms with oneDNN and
    23.9 ms without, while a 9-token one took 46.6 against 83.3 ms (docs/bench/2026-12-06-epyc-onednn/); the tuner
    measures where the two cross on the machine at hand (:func:`hf_retrace.tuning.costs.measure_costs`). A hook on
    the model's own forward, so every caller's forward is covered (transformers' loops, ours, a prefill); the setting
    is put back after each forward, also when it raises. Process-wide, as the switch is: two threads generating at
    once may run a forward with the other's setting (a different kernel: the same tokens up to bf16 near-ties)."""
    if width <= 1:
        yield
        return
    owner = threading.get_ident()  # a call's hook switches its own thread's forwards, not another call's
    opened: list[int] = []

    def before(module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        if threading.get_ident() == owner:
            tokens = forward_width(args, kwargs)
            opened.append(_OneDNNSwitch.push(tokens is None or tokens >= width))

    def after(module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if threading.get_ident() == owner and opened:
            _OneDNNSwitch.pop(opened.pop())

    handles = [model.register_forward_pre_hook(before, with_kwargs=True),
               model.register_forward_hook(after, with_kwargs=True, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
