"""Loading below the entry points: the one dtype vocabulary, target/drafter loading and the target path rule, and
the flags that say where the models run (``--device`` / ``--device-map``, ``--compile``: :func:`add_device_arguments`).

``cli``, ``bench``, ``demo`` and ``training`` all load through here (none of them imports another entry point).
Dtypes are named ``bf16`` / ``fp16`` / ``fp32``; the torch spellings ``bfloat16`` / ``float16`` / ``float32`` are
accepted everywhere as the same names.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: `import hf_retrace` has already imported torch (through transformers)
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


AUTO_DTYPE = "auto"  # --dtype auto: the faster of bf16 and fp32 where the model runs (resolve_dtype)
AUTO_DTYPES = SHORT_DTYPES + (AUTO_DTYPE,)  # the choices of the batched data commands' --dtype
AUTO_DTYPE_HELP = ("the target's dtype; auto (default): bf16 on an accelerator or on a CPU with bf16 units "
                   "(avx512_bf16, amx_bf16), fp32 on a CPU without them, where batched fp32 runs 3-4x faster")


def dtype_arg(text: str) -> str:
    """``argparse`` type of every ``--dtype``-like flag: either spelling in, the short name out (``auto`` kept, for
    the flags whose choices offer it)."""
    if text == AUTO_DTYPE:
        return text
    try:
        return dtype_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def resolve_dtype(name: str, device: Any = None, device_map: Any = None) -> str:
    """The short dtype name for ``name``; ``auto`` becomes bf16 on an accelerator (``device`` other than the CPU, or a
    ``device_map``) or on a CPU with bf16 units, fp32 on a CPU without them, where bf16 is emulated (measured 3-4x
    slower batched on an AVX2 EPYC, and 1.8x faster on a Xeon with AMX: docs/drafter-data.md)."""
    if name != AUTO_DTYPE:
        return dtype_name(name)
    from .machine import has_bf16_units

    on_cpu = device_map is None and (device is None or str(device).split(":")[0] == "cpu")
    return "bf16" if not on_cpu or has_bf16_units() else "fp32"


def portable_path(text: str) -> str:
    """``text`` with the user's home folder written ``~``: what reports and model cards record instead of a machine's
    absolute paths."""
    from pathlib import Path

    return str(text).replace(str(Path.home()), "~")


class ModelLoadError(OSError):
    """A target or drafter that cannot be loaded from what the user named: the message says which, why, and what to
    do (the commands print it as one line)."""


_HUB_ID = re.compile(r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?(?:/[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?)?")
_WEIGHTS = {"drafter": ("model.safetensors",),  # the drafter reads safetensors only (never a pickle)
            "target": ("model.safetensors", "pytorch_model.bin")}


def _weights_problem(folder: Path, kind: str) -> str | None:
    """What keeps the weights of a saved model ``folder`` from loading (missing, a shard missing, a safetensors file
    cut short), naming the file; None when they look whole. Cheap: only headers are read."""
    from safetensors import safe_open

    files: list[Path] = []
    for name in _WEIGHTS[kind]:
        index = folder / f"{name}.index.json"
        if (folder / name).is_file():
            files = [folder / name]
        elif index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                return f"{index} cannot be read ({error}): it is damaged; copy the folder again"
            missing = [shard for shard in shards if not (folder / shard).is_file()]
            if missing:
                return f"{index.name} lists {', '.join(missing)}, missing from {folder}: copy the folder again"
            files = [folder / shard for shard in shards]
        if files:
            break
    else:
        wanted = " or ".join(_WEIGHTS[kind])
        return f"no weights in {folder} (no {wanted}): the save did not finish, or this is not a {kind} folder"
    for file in files:
        if file.suffix != ".safetensors":
            continue
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as error:  # noqa: BLE001 - SafetensorError and OSError alike: the file cannot be read
            return (f"the weights file {file} cannot be read ({error}): it is damaged or was cut short (an "
                    "interrupted download, copy or save); copy the folder again")
    return None


def model_source_problem(source: str, kind: str) -> str | None:
    """What is wrong with ``source`` as the ``kind`` ("target" / "drafter") to load, before anything loads: a path that
    does not exist, a file, a folder without a readable config.json or whole weights; None for a folder that looks
    loadable, "default", or a Hub id (the Hub answers for those when loading)."""
    if source == "default":
        return None
    path = Path(source).expanduser()
    if not path.exists():
        if _HUB_ID.fullmatch(source) and not source.startswith(".") and ".." not in source:
            return None
        return f"{source}: no such folder (nor a Hub id, which reads name or namespace/name)"
    if not path.is_dir():
        return f"{source} is a file: pass the folder that holds the {kind}'s config.json and weights, or a Hub id"
    config = path / "config.json"
    if not config.is_file():
        contents = "it is empty" if not any(path.iterdir()) else "it has no config.json"
        return f"{source} is not a saved {kind} ({contents}): pass the folder save_pretrained wrote, or a Hub id"
    try:
        fields = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"{config} cannot be read ({error}): it is damaged; copy the folder again, or save the {kind} again"
    if not isinstance(fields, dict):
        return f"{config} holds no {kind} configuration (a JSON object of its settings): copy the folder again"
    return _weights_problem(path, kind)


def check_model_source(source: str | None, kind: str) -> None:
    """Raise a :class:`ModelLoadError` saying what is wrong with ``source`` (:func:`model_source_problem`); ``None``
    is the embedded default."""
    problem = None if source is None else model_source_problem(str(source), kind)
    if problem is not None:
        raise ModelLoadError(problem + ".")


def _model_source_arg(text: str, kind: str) -> str:
    problem = model_source_problem(text, kind)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def target_arg(text: str) -> str:
    """``argparse`` type of every ``--target``: a folder that looks loadable, a Hub id, or "default"
    (:func:`model_source_problem`)."""
    return _model_source_arg(text, "target")


def drafter_arg(text: str) -> str:
    """``argparse`` type of every ``--drafter``-like flag: a drafter folder that looks loadable, a Hub id, or
    "default" (:func:`model_source_problem`)."""
    return _model_source_arg(text, "drafter")


@contextlib.contextmanager
def _loading(kind: str, source: Any) -> Iterator[None]:
    """Turn a failure to load the ``kind`` named by ``source`` into a :class:`ModelLoadError` naming both."""
    from safetensors import SafetensorError

    try:
        yield
    except ModelLoadError:
        raise
    except (OSError, ValueError, TypeError, KeyError, SafetensorError) as error:
        name = "the embedded default" if source in (None, "default") else source
        raise ModelLoadError(f"could not load the {kind} {name}: {str(error).strip().rstrip('.')}.") from error


def resolve_target(target: str | None) -> str:
    """A loadable target path or Hub id: ``None`` / "default" is the embedded default (converted once, offline)."""
    if target in (None, "default"):
        from . import defaults

        print(f"[hf-retrace] target: {defaults.describe_default_target_source()}", file=sys.stderr)
        return str(defaults.ensure_default_target())
    return target


def load_target(target: str | None, dtype: str | torch.dtype = "bf16", quantization: str | None = None,
                frozen: bool = False, device: str | torch.device | None = None, device_map: Any = None):
    """(target model in eval mode, tokenizer) from a Hub id / folder, or the embedded default for ``None``/"default".

    ``quantization``: None, "8bit" or "4bit" (bitsandbytes). ``frozen`` turns off the weights' gradients (training).
    ``device`` ("cuda", "cuda:1", ...) loads the whole target there; ``device_map`` ("auto", or a map of module names
    to devices) lets accelerate place it; neither: the CPU.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device is not None and device_map is not None:
        raise ValueError("pass either a device or a device_map, not both.")
    check_model_source(target, "target")
    with _loading("target", target):
        path = resolve_target(target)
    dt = torch_dtype(dtype)
    kwargs: dict[str, Any] = {"dtype": dt}
    move_to = None  # a device the target is moved to after loading (no accelerate to load it there directly)
    if device_map is not None:
        kwargs["device_map"] = device_map
    elif device is not None and str(device) != "cpu":
        if quantization or importlib.util.find_spec("accelerate") is not None:
            kwargs["device_map"] = {"": str(device)}
        else:
            move_to = device
    if quantization:
        from transformers import BitsAndBytesConfig

        bits = {"8bit": dict(load_in_8bit=True), "4bit": dict(load_in_4bit=True, bnb_4bit_compute_dtype=dt)}
        kwargs["quantization_config"] = BitsAndBytesConfig(**bits[quantization])
        kwargs.setdefault("device_map", "cpu")  # bitsandbytes places weights while loading: say where
    with _loading("target", target):
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    if move_to is not None:
        model.to(move_to)
    if frozen:
        for p in model.parameters():
            p.requires_grad_(False)
    return model, tokenizer


def load_drafter(drafter: str | None, dtype: str | torch.dtype = "bf16", device: str | torch.device | None = None,
                 compile: bool = False):
    """A drafter from a Hub id / folder, or the one shipped for the embedded default when ``None``/"default";
    on ``device`` (default: the CPU), its forward compiled when ``compile`` (:func:`compile_drafter`)."""
    from . import defaults
    from .modeling import ReTraceDrafter

    check_model_source(drafter, "drafter")
    with _loading("drafter", drafter):
        path = defaults.default_drafter_path() if drafter in (None, "default") else drafter
        model = ReTraceDrafter.from_pretrained(path, dtype=torch_dtype(dtype)).eval()
    if device is not None:
        model.to(device)
    return compile_drafter(model) if compile else model


def load_pair(target: str | None, drafter: str | None, dtype: str | torch.dtype = "bf16",
              quantization: str | None = None, device: str | torch.device | None = None, device_map: Any = None,
              compile: bool = False):
    """(target, tokenizer, drafter); ``None`` or "default" picks the embedded default for either. The target goes to
    ``device`` or ``device_map`` (:func:`load_target`), the drafter to the device of its input embeddings. The
    drafter's configuration is read first: a drafter that cannot load fails before the target loads."""
    from . import defaults
    from .configuration import ReTraceConfig
    from .generation.placement import embedding_device

    check_model_source(drafter, "drafter")
    with _loading("drafter", drafter):
        ReTraceConfig.from_pretrained(defaults.default_drafter_path() if drafter in (None, "default") else drafter)
    model, tokenizer = load_target(target, dtype, quantization, device=device, device_map=device_map)
    return model, tokenizer, load_drafter(drafter, dtype, device=embedding_device(model), compile=compile)


def compile_drafter(drafter: Any, **options: Any):
    """``drafter`` with its forward compiled by ``torch.compile`` (in place: it stays a ``ReTraceDrafter``, so
    ``generate`` still dispatches it, and its state dict keeps its keys). Returns ``drafter``.

    ``options`` go to ``torch.compile`` (default ``dynamic=True``: the context grows every round, so sizes are symbolic
    from the first call instead of recompiling on the second). The forward compiles without a graph break
    (``tests/test_compile.py``); the first rounds of the first call pay the compilation. See ``docs/gpu.md``.
    """
    drafter.compile(**({"dynamic": True} | options))
    return drafter


# --------------------------------------------------------------------------- where models run (command-line flags)

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def device_arg(text: str) -> str:
    """``argparse`` type of ``--device``: a torch device name (``cpu``, ``cuda``, ``cuda:1``, ``mps``, ``xpu``) that
    this machine has."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device name; use e.g. cpu, cuda, cuda:1, mps") from None
    if device.type == "cpu":
        return str(device)
    backend = getattr(torch, device.type, None)
    available = backend is not None and hasattr(backend, "is_available") and backend.is_available()
    if device.type == "mps":
        available = torch.backends.mps.is_available()
    if not available:
        raise argparse.ArgumentTypeError(
            f"{text!r}: this machine has no {device.type} device for torch {torch.__version__} (a CPU-only build, or "
            "no driver); use --device cpu")
    count = getattr(backend, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} {device.type} device(s), "
                                         f"numbered 0..{count - 1}")
    return str(device)


def device_map_arg(text: str) -> str | dict[str, Any]:
    """``argparse`` type of ``--device-map``: an accelerate strategy, or a JSON object of module names to devices."""
    if text in DEVICE_MAP_STRATEGIES:
        return text
    try:
        mapping = json.loads(text)
    except ValueError:
        mapping = None
    if not isinstance(mapping, dict) or not mapping:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use one of {', '.join(DEVICE_MAP_STRATEGIES)}, or a JSON object of module names to devices, "
            'e.g. \'{"model.embed_tokens": 0, "model.layers": 0, "model.norm": 1, "lm_head": 1}\'')
    return mapping


def add_device_arguments(parser: argparse.ArgumentParser, compile: bool = False) -> None:
    """``--device`` / ``--device-map`` (one or the other) and, with ``compile``, ``--compile``: the same flags, help and
    checks on every command that loads a model."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--device", type=device_arg, default=None,
                       help="where the models run: cpu (default), cuda, cuda:1, mps, ...")
    where.add_argument("--device-map", type=device_map_arg, default=None, metavar="MAP",
                       help=f"let accelerate place the target ({', '.join(DEVICE_MAP_STRATEGIES)}, or a JSON map of "
                            "module names to devices); the drafter runs where the target's input embeddings are")
    if compile:
        parser.add_argument("--compile", action="store_true",
                            help="torch.compile the drafter's forward (the first rounds pay the compilation)")
