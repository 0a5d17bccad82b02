"""Loading below the entry points: the one dtype vocabulary, target/drafter loading and the target path rule.

``cli``, ``bench``, ``demo`` and ``training`` all load through here (none of them imports another entry point).
Dtypes are named ``bf16`` / ``fp16`` / ``fp32``; the torch spellings ``bfloat16`` / ``float16`` / ``float32`` are
accepted everywhere as the same names.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a model is loaded, so that `hf-retrace --help` stays instant
    import torch

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # short name -> torch spelling
_TORCH_SPELLINGS = {long: short for short, long in DTYPE_NAMES.items()}
MAX_NEW_TOKENS = 8192  # the most new tokens the command-line tools accept per answer
SHORT_DTYPES = tuple(DTYPE_NAMES)  # the choices a --dtype flag shows (``dtype_arg`` maps the torch spellings onto them)
DTYPE_CHOICES = SHORT_DTYPES + tuple(_TORCH_SPELLINGS)  # every accepted spelling


def dtype_name(name: str | torch.dtype) -> str:
    """The short name (``bf16`` / ``fp16`` / ``fp32``) of ``name`` (either spelling, or a torch dtype)."""
    if not isinstance(name, str):
        name = str(name).removeprefix("torch.")
    short = _TORCH_SPELLINGS.get(name, name)
    if short not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(DTYPE_CHOICES)}.")
    return short


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of ``name`` (either spelling)."""
    import torch

    return getattr(torch, DTYPE_NAMES[dtype_name(name)])


def dtype_arg(text: str) -> str:
    """``argparse`` type of every ``--dtype``-like flag: either spelling in, the short name out."""
    try:
        return dtype_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def portable_path(text: str) -> str:
    """``text`` with the user's home folder written ``~``: what reports and model cards record instead of a machine's
    absolute paths."""
    from pathlib import Path

    return str(text).replace(str(Path.home()), "~")


def resolve_target(target: str | None) -> str:
    """A loadable target path or Hub id: ``None`` / "default" is the embedded default (converted once, offline)."""
    if target in (None, "default"):
        from . import defaults

        print(f"[hf-retrace] target: {defaults.describe_default_target_source()}", file=sys.stderr)
        return str(defaults.ensure_default_target())
    return target


def load_target(target: str | None, dtype: str | torch.dtype = "bf16", quantization: str | None = None,
                frozen: bool = False):
    """(target model in eval mode, tokenizer) from a Hub id / folder, or the embedded default for ``None``/"default".

    ``quantization``: None, "8bit" or "4bit" (bitsandbytes). ``frozen`` turns off the weights' gradients (training).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_target(target)
    dt = torch_dtype(dtype)
    kwargs: dict[str, Any] = {"dtype": dt}
    if quantization:
        from transformers import BitsAndBytesConfig

        bits = {"8bit": dict(load_in_8bit=True), "4bit": dict(load_in_4bit=True, bnb_4bit_compute_dtype=dt)}
        kwargs |= {"quantization_config": BitsAndBytesConfig(**bits[quantization]), "device_map": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    if frozen:
        for p in model.parameters():
            p.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(path)


def load_drafter(drafter: str | None, dtype: str | torch.dtype = "bf16"):
    """A drafter from a Hub id / folder, or the one shipped for the embedded default when ``None``/"default"."""
    from . import defaults
    from .modeling import ReTraceDrafter

    path = defaults.default_drafter_path() if drafter in (None, "default") else drafter
    return ReTraceDrafter.from_pretrained(path, dtype=torch_dtype(dtype)).eval()


def load_pair(target: str | None, drafter: str | None, dtype: str | torch.dtype = "bf16",
              quantization: str | None = None):
    """(target, tokenizer, drafter); ``None`` or "default" picks the embedded default for either."""
    if drafter in (None, "default"):
        from . import defaults

        defaults.default_drafter_path()  # fail before the target is loaded when no drafter ships
    model, tokenizer = load_target(target, dtype, quantization)
    return model, tokenizer, load_drafter(drafter, dtype)
