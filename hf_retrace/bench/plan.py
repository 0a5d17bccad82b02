"""What to benchmark: the user's :class:`BenchSpec`, checked into a :class:`BenchPlan` before any model loads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..configuration import drafter_target_mismatches
from ..loading import resolve_target
from .datasets import DATASETS, BenchPrompt, load_prompts
from .methods import ALL_METHODS, DEFAULT_METHODS, MAIN_DRAFTER, OWN_DRAFTER_NAMES, Method

__all__ = ["BenchInputError", "BenchPlan", "BenchSpec", "plan_benchmark"]


class BenchInputError(ValueError):
    """A benchmark argument is wrong; raised before any model is loaded."""


@dataclass
class BenchSpec:
    """What to benchmark, as the user asked for it (nothing checked, nothing loaded).

    Example::

        spec = BenchSpec(datasets=["gsm8k"], methods=["plain", "dflash", "retrace"], max_new_tokens=64, limit=8)
        report = run_benchmark(spec)
        print(report["results"]["gsm8k"]["retrace"]["T=0"]["tau"])
    """

    datasets: list[str] = field(default_factory=lambda: list(DATASETS))
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    max_new_tokens: int = 128
    limit: int | None = None
    seeds: list[int] = field(default_factory=lambda: [0])
    target: str | None = None  # None: the embedded default target
    drafters: dict[str, str] = field(default_factory=dict)  # "default" or a method / ablation name -> path
    dtype: str = "bf16"
    quantization: str | None = None
    device: str | None = None  # None: the CPU (loading.load_target)
    device_map: str | dict | None = None
    compile: bool = False  # torch.compile the drafters' forward
    warmup: bool = True
    progress: bool = True
    repeats: int = 1  # each request (or batch) timed this many times, the methods' order alternating; the median kept


@dataclass
class BenchPlan:
    """A checked :class:`BenchSpec`: prompts read, target and drafters resolved to paths, methods chosen."""

    spec: BenchSpec
    target_path: str
    prompts: dict[str, list[BenchPrompt]]
    methods: list[Method]  # plain first
    drafter_paths: dict[str, str]  # method name -> drafter path
    skipped: dict[str, str]  # method name -> why it does not run
    notes: list[str]


def plan_benchmark(spec: BenchSpec) -> BenchPlan:
    """Check every argument and resolve paths; raise :class:`BenchInputError` before any model is loaded."""
    _check_settings(spec)
    prompts = _read_prompts(spec)
    names = ["plain"] + [m for m in dict.fromkeys(spec.methods) if m != "plain"]
    requested = [ALL_METHODS[m] for m in names]
    drafter_keys = _checked_drafter_names(spec.drafters, names)
    target_path, target_config = _target_config(spec.target)
    drafter_paths, skipped, notes = _resolve_drafters(requested, drafter_keys, target_path, target_config)
    methods = [m for m in requested if m.name not in skipped]
    return BenchPlan(spec, target_path, prompts, methods, drafter_paths, skipped, notes)


def _check_settings(spec: BenchSpec) -> None:
    """Every argument that needs no file read."""
    if not spec.datasets:
        raise BenchInputError(f"no dataset given; use one of {', '.join(DATASETS)} or the path of a .jsonl file")
    unknown = [m for m in spec.methods if m not in ALL_METHODS]
    if unknown or not spec.methods:
        raise BenchInputError(
            f"unknown method(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"choose from {', '.join(ALL_METHODS)} (comma-separated, or 'all')"
        )
    if isinstance(spec.repeats, bool) or not isinstance(spec.repeats, int) or spec.repeats < 1:
        raise BenchInputError(f"--repeats {spec.repeats!r}: give 1 or more timings per request (or batch) and method")
    if spec.max_new_tokens < 2:
        raise BenchInputError(f"--max-new-tokens must be at least 2 (one prefill token + decoded tokens), "
                              f"got {spec.max_new_tokens}")
    if spec.limit is not None and spec.limit < 1:
        raise BenchInputError(f"--limit must be a positive number of prompts per dataset, got {spec.limit}")
    if not spec.temperatures or any(not math.isfinite(t) or t < 0 for t in spec.temperatures):
        raise BenchInputError(f"temperatures must be finite and >= 0, got {spec.temperatures}")
    if not spec.seeds:
        raise BenchInputError("at least one seed is needed")
    if spec.dtype not in ("bf16", "fp32"):
        raise BenchInputError(f"--dtype must be bf16 or fp32, got {spec.dtype!r}")
    if spec.quantization not in (None, "8bit", "4bit"):
        raise BenchInputError(f"--quantization must be 8bit or 4bit, got {spec.quantization!r}")
    if spec.quantization is not None and _find_spec("bitsandbytes") is None:
        raise BenchInputError(f"--quantization {spec.quantization} needs bitsandbytes: `pip install bitsandbytes`")


def _read_prompts(spec: BenchSpec) -> dict[str, list[BenchPrompt]]:
    prompts = {}
    for name in spec.datasets:
        try:
            loaded = load_prompts(name, spec.limit)  # every record checked, not only the first `limit`
        except ValueError as exc:
            raise BenchInputError(f"--dataset {name}: {exc}") from None
        prompts[loaded[0].dataset if loaded else str(name)] = loaded
    return prompts


def _resolve_drafters(requested: list[Method], drafter_keys: dict[str, str], target_path: str,
                      target_config: Any) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(method name -> drafter path, method name -> why it is skipped, notes) for the methods that need a drafter."""
    notes, skipped, drafter_paths = [], {}, {}
    for method in requested:
        if not method.needs_drafter:
            continue
        key = next((k for k in method.drafter_names if k in drafter_keys), MAIN_DRAFTER)
        path = drafter_keys.get(key) or _default_drafter(method)
        config = _drafter_config(path)
        _check_drafter_fits_target(config, path, target_config, target_path)
        reason = _why_method_cannot_run(method, config)
        if reason is not None:
            skipped[method.name] = reason
            continue
        untrained = (f"the ReTrace module of {path} is untrained (zero output projection): the retrace methods "
                     "using it draft exactly what dflash drafts")
        if method.retrace and config.retrace == "untrained" and untrained not in notes:
            notes.append(untrained)
        drafter_paths[method.name] = str(path)
    return drafter_paths, skipped, notes


def _find_spec(name: str):
    import importlib.util

    return importlib.util.find_spec(name)


def _checked_drafter_names(drafters: dict[str, str], method_names: list[str]) -> dict[str, str]:
    for key in drafters:
        if key not in OWN_DRAFTER_NAMES | {MAIN_DRAFTER}:
            raise BenchInputError(
                f"--drafter {key}=...: unknown drafter name {key!r}; use PATH for the main drafter or NAME=PATH with "
                f"NAME one of {', '.join(sorted(OWN_DRAFTER_NAMES))}"
            )
        methods = [n for n in method_names if key in ALL_METHODS[n].drafter_names] if key != MAIN_DRAFTER else ["*"]
        if not methods:
            raise BenchInputError(f"--drafter {key}=... is given but no method in --methods uses it; "
                                  f"add {key if key in ALL_METHODS else 'retrace-' + key} to --methods")
    return dict(drafters)


def _target_config(target: str | None) -> tuple[str, Any]:
    """The target's folder (the default one resolved) and its config, read from config.json without any weights."""
    from transformers import AutoConfig

    from .. import defaults

    try:
        target = resolve_target(target)
    except (defaults.DefaultTargetUnavailableError, FileNotFoundError) as exc:
        raise BenchInputError(str(exc)) from None
    if not Path(target).is_dir() and (Path(target).exists() or target.startswith((".", "/", "~"))):
        raise BenchInputError(f"--target {target}: not a model folder (expected a folder with config.json)")
    try:
        config = AutoConfig.from_pretrained(target)
    except (OSError, ValueError) as exc:
        raise BenchInputError(f"--target {target}: cannot read its config.json ({exc})") from None
    return target, config.get_text_config()


def _default_drafter(method: Method) -> str:
    from .. import defaults

    try:
        return str(defaults.default_drafter_path())
    except FileNotFoundError as exc:
        raise BenchInputError(
            f"method {method.name} needs a drafter and none was given: {exc}. Pass --drafter PATH, "
            "or benchmark only --methods plain,prompt-lookup"
        ) from None


def _drafter_config(path: str):
    from ..configuration import ReTraceConfig

    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        raise BenchInputError(f"--drafter {path}: the folder has no config.json (expected a saved ReTraceDrafter)")
    if not Path(path).is_dir() and (Path(path).exists() or path.startswith((".", "/", "~"))):
        raise BenchInputError(f"--drafter {path}: no such folder")
    try:
        return ReTraceConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise BenchInputError(f"--drafter {path}: cannot read a drafter config ({exc})") from None


def _check_drafter_fits_target(config: Any, path: str, target_config: Any, target_path: str) -> None:
    """The drafter's config against the target's config.json (:func:`drafter_target_mismatches`, the one rule)."""
    wrong = drafter_target_mismatches(config, target_config)
    if wrong:
        raise BenchInputError(
            f"the drafter {path} was built for another target than {target_path} ({'; '.join(wrong)}). Pass the "
            "drafter trained for this target, or the target it was trained for."
        )


def _why_method_cannot_run(method: Method, config: Any) -> str | None:
    if method.kind == "native":
        from .native import native_dflash_unavailable_reason

        return native_dflash_unavailable_reason(config)
    if method.retrace and config.retrace == "absent":
        return "skipped: the drafter has no ReTrace module (config.retrace is \"absent\")"
    return None
