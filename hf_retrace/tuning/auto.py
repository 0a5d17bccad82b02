"""Which round policy a call gets when it names none: ``HF_RETRACE_POLICY``, else the policy tuned for this machine.

Precedence, first match wins (the one place it is written; the README points here):

1. a drafter view's own policy: ``drafter.with_policy(policy)`` (changes given as ``with_policy(**changes)`` apply
   on top of whatever 2-3 give);
2. ``HF_RETRACE_POLICY``: ``auto`` (the default: 3), ``shipped`` (the drafter's config constants), ``off`` (plain
   decoding, no drafter forward), or the path of a JSON file holding a policy (``RoundPolicy.to_dict``) or a tuning
   result (``hf-retrace tune --json``);
3. ``auto``: the policy tuned for this machine, per temperature. At the first ``generate`` with a drafter, keyed by
   the target's and drafter's fingerprints, the dtype, the device, the CPU's model and flags, the thread count and the
   torch / transformers versions, this machine's costs are measured (about 1-3 s on a CPU), the drafter's recorded
   rounds replayed (:mod:`.search`), and the choice cached as JSON in ``$HF_RETRACE_CACHE/policies`` (default
   ``~/.cache/hf_retrace/policies``). Later processes read it in milliseconds. An unreadable or stale entry is
   measured again, never fatal; the file is written atomically, so two processes at once leave one valid file. A
   drafter without recorded rounds keeps its shipped policy, with the guard armed by the measured costs.

One line on stderr says when a call tunes, and what it chose.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..defaults import cache_root
from ..machine import cpu_info
from ..generation.policy import RoundPolicy, shipped_policy
from .costs import MachineCosts, measure_costs
from .records import RECORDS_FILENAME, RoundRecords
from .search import LOOKUP_BUDGETS, choose_policies

__all__ = ["POLICY_ENV_VAR", "auto_policy", "machine_key", "policy_cache_dir", "tune", "tune_and_cache", "tuned_policies"]

POLICY_ENV_VAR = "HF_RETRACE_POLICY"
CACHE_FORMAT = 1
_MEMO: dict[str, dict[str, RoundPolicy]] = {}
_LOCK = threading.Lock()


def policy_cache_dir() -> Path:
    return cache_root() / "policies"


def _fingerprint(model: Any) -> str:
    config = model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else str(model.config)
    parameters = sum(p.numel() for p in model.parameters())
    text = f"{getattr(model.config, '_name_or_path', '')}|{parameters}|{config}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def machine_key(target: Any, drafter: Any) -> dict[str, Any]:
    """Everything a tuned policy depends on besides the temperature."""
    import importlib.metadata

    import transformers

    try:
        version = importlib.metadata.version("hf-retrace")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        version = "source"
    device = target.get_input_embeddings().weight.device
    key = {"format": CACHE_FORMAT, "target": _fingerprint(target), "drafter": _fingerprint(drafter),
           "dtype": str(target.dtype).removeprefix("torch."), "drafter_dtype": str(drafter.dtype).removeprefix("torch."),
           "device": device.type, "cpu": cpu_info(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "transformers": transformers.__version__, "hf_retrace": version}
    if device.type == "cuda":
        key["accelerator"] = torch.cuda.get_device_name(device)
    records = _records_path(drafter)  # new records for the same weights: tuned again
    key["records"] = hashlib.sha256(records.read_bytes()).hexdigest()[:16] if records is not None else None
    return key


def _key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _records_path(drafter: Any) -> Path | None:
    """``round_records.json.gz`` beside the drafter's weights (its folder, or the local Hub cache; never a download
    at generate time), or None."""
    source = getattr(drafter, "name_or_path", "") or getattr(drafter.config, "_name_or_path", "")
    path = Path(source) / RECORDS_FILENAME if source else None
    if path is None or not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(source, RECORDS_FILENAME) if source else None
            path = Path(cached) if isinstance(cached, str) else None
        except Exception:  # not a Hub id, or no cache: no records
            path = None
    return path


def _records_of(drafter: Any) -> RoundRecords | None:
    """The drafter's recorded rounds: in memory (``drafter.round_records``), or the file beside its weights."""
    records = getattr(drafter, "round_records", None)
    if records is not None:
        return records
    path = _records_path(drafter)
    if path is None:
        return None
    try:
        return RoundRecords.load(path)
    except ValueError as e:
        print(f"[hf-retrace] {e}; keeping the drafter's shipped round policy.", file=sys.stderr)
        return None


def tune(target: Any, drafter: Any, records: RoundRecords | None = None) -> dict[str, Any]:
    """Measure this machine's costs and choose the policy per temperature; returns the cacheable result
    (``policies``, ``costs``, ``tables``, ``seconds``)."""
    started = time.perf_counter()
    records = records if records is not None else _records_of(drafter)
    longest = max([drafter.config.block_size - 1] + [b[1] for b in LOOKUP_BUDGETS if b])
    costs = measure_costs(target, drafter, max_drafts=longest)
    base = shipped_policy(drafter.config)
    if records is None:
        armed = costs.arm(base, reason="the drafter ships no recorded rounds to replay")
        choice = {"greedy": armed, "sampled": armed, "tables": {}}
    else:
        choice = choose_policies(records, costs, base)
    return {"policies": {name: choice[name].to_dict() for name in ("greedy", "sampled")}, "costs": costs.to_dict(),
            "tables": choice["tables"], "seconds": round(time.perf_counter() - started, 2)}


def _read_cache(path: Path, key: dict[str, Any]) -> dict[str, RoundPolicy] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") != key:
            return None  # stale (another version, a hash collision): measure again
        return _policies(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"[hf-retrace] the cached round policy {path} is unreadable ({e}); measuring again.", file=sys.stderr)
        return None


def write_atomically(path: Path, data: dict[str, Any]) -> None:
    """Write JSON to ``path`` through a temporary file in the same folder and one rename: a reader sees the old file or
    the new one, never a part; two writers at once leave one of their files whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def _policies(result: dict[str, Any]) -> dict[str, RoundPolicy]:
    return {name: RoundPolicy.from_dict(result["policies"][name]) for name in ("greedy", "sampled")}


def tune_and_cache(target: Any, drafter: Any) -> tuple[dict[str, Any], Path]:
    """Tune now (whatever the cache holds) and cache the result for this machine; returns it and the cache path."""
    key = machine_key(target, drafter)
    path = policy_cache_dir() / f"{_key_digest(key)}.json"
    result = tune(target, drafter)
    try:
        write_atomically(path, {"key": key, **result, "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
    except OSError as e:
        print(f"[hf-retrace] could not cache the round policy in {path} ({e}); it is used for this process only.",
              file=sys.stderr)
    with _LOCK:
        _MEMO[_key_digest(key)] = _policies(result)
    return result, path


def tuned_policies(target: Any, drafter: Any) -> dict[str, RoundPolicy]:
    """This machine's policies for ``target`` + ``drafter``: memoised, else cached on disk, else tuned now."""
    key = machine_key(target, drafter)
    digest = _key_digest(key)
    with _LOCK:
        if digest in _MEMO:
            return _MEMO[digest]
        policies = _read_cache(policy_cache_dir() / f"{digest}.json", key)
        if policies is not None:
            _MEMO[digest] = policies
            return policies
    print("[hf-retrace] tuning the round policy for this machine (once; measuring costs)...", file=sys.stderr,
          flush=True)
    result, path = tune_and_cache(target, drafter)
    policies = _policies(result)
    print(f"[hf-retrace] tuned in {result['seconds']:.1f} s (cached in {path}): T=0 {policies['greedy'].describe()}; "
          f"T>0 {policies['sampled'].describe()}", file=sys.stderr, flush=True)
    return policies


def _env_policy(value: str, drafter: Any, do_sample: bool) -> RoundPolicy:
    if value == "shipped":
        return shipped_policy(drafter.config)
    if value == "off":
        return shipped_policy(drafter.config).replace(speculate=False, source="env",
                                                       reason=f"{POLICY_ENV_VAR}=off")
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"{POLICY_ENV_VAR}={value!r}: expected auto, shipped, off, or the path of a JSON policy file "
                         "(RoundPolicy.to_dict, or `hf-retrace tune --json`'s output); no such file.")
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict) and "policies" in data:
        data = data["policies"]["sampled" if do_sample else "greedy"]
    return RoundPolicy.from_dict(data).replace(source=f"file {path.name}")


def auto_policy(drafter: Any, target: Any, generation_config: Any) -> RoundPolicy:
    """The resolver ``import hf_retrace`` installs (:func:`~hf_retrace.generation.policy.set_policy_resolver`)."""
    do_sample = bool(getattr(generation_config, "do_sample", False))
    value = os.environ.get(POLICY_ENV_VAR, "auto").strip() or "auto"
    if value != "auto":
        return _env_policy(value, drafter, do_sample)
    return tuned_policies(target, drafter)["sampled" if do_sample else "greedy"]
