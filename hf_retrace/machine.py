"""What this machine's CPU can do: its model and the instruction-set flags that change a matmul's speed.

One place for the CPU facts that pick a default: the tuned round policies are keyed by them
(:func:`hf_retrace.tuning.auto.machine_key`) and ``--dtype auto`` follows them (:func:`hf_retrace.loading.resolve_dtype`).
"""

from __future__ import annotations

import contextlib
import functools
import platform
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


@contextlib.contextmanager
def onednn_matmuls(enabled: bool) -> Iterator[None]:
    """Run the block with torch's oneDNN (mkldnn) kernels on or off, and put the process's setting back after.

    Only the on/off switch is touched (``torch.backends.mkldnn.flags`` would also reset its determinism and TF32
    settings). On a CPU with bf16 units torch sends bf16 matmuls to oneDNN, whose one-token forward can be far slower
    than torch's own kernels while a many-token one is far faster (docs/bench/2026-12-06-epyc-onednn/). The switch is
    process-wide, not per thread. ``enabled=True`` leaves a process that turned oneDNN off as it is."""
    import torch

    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.set_flags(enabled and before, None, None, None)
    try:
        yield
    finally:
        torch.backends.mkldnn.set_flags(before, None, None, None)
