"""Which round policy a call gets when it names none: ``HF_RETRACE_POLICY``, else the policy tuned for this machine.

The precedence (a view, then ``HF_RETRACE_POLICY``, then the tuned policy) is written once, in docs/round-policy.md.
The tuned policy: at the first ``generate`` with a drafter, keyed by the target's and drafter's fingerprints, the
dtype, the device, the CPU's model and flags, the thread count and the torch / transformers versions, this machine's
costs are measured (:mod:`.costs`; timings too noisy to decide on are timed again with half the threads, whose choice,
or else the shipped policy, is used uncached, and are measured again by the first call :data:`RETRY_SECONDS` later,
:data:`RETRIES` times at most a process), the drafter's
recorded rounds replayed (:mod:`.search`; plain decoding only where two measurements agree), and the choice cached as
JSON in ``$HF_RETRACE_CACHE/policies`` (default ``~/.cache/hf_retrace/policies``). Later processes read it in
milliseconds. An entry is checked field by field on read; an unreadable, stale or invalid one is measured again, never
fatal, and so is one whose first real calls realized a figure more than 15 % from the prediction (once; those
figures and the checks of a plain choice: :mod:`.realized`; the cache's folder, writes, memo: :mod:`.entries`).
The file is written atomically, so two processes at once leave one valid file. A drafter without recorded rounds
keeps its shipped policy, with the guard armed by the measured costs.

A batch of ``B`` rows is priced apart, at its first call (``rows=B``; one entry per batch size): the costs are
timed at ``B`` rows (:func:`.costs.measure_costs`), so a verify of ``B`` rows of ``k + 1`` tokens is weighed
against plain batched decoding's ``B``-row step; the same replay chooses, each round priced by its widest row, and a
drafting choice is kept only where a real A/B against plain batched decoding agrees
(:func:`.verify.check_batch_choice`).

One line on stderr says when a call tunes, what it chose, and whether it was cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..machine import cpu_info
from ..generation.policy import CacheOrigin, RoundPolicy, shipped_policy
from .costs import MachineCosts, measure_costs, measure_costs_fewer_threads
from .records import RECORDS_FILENAME, RoundRecords
from .search import LOOKUP_BUDGETS, apply_price, choose_policies
from .entries import _LOCK, _MEMO, policy_cache_dir, write_atomically
from .realized import REALIZED_TOLERANCE, _REALIZED, probe_or, probes_found_drafting
from .verify import check_batch_choice, measure_price

__all__ = ["POLICY_ENV_VAR", "auto_policy", "cache_line", "env_policy", "machine_key", "records_of", "tune",
           "tune_and_cache", "tuned_policies"]

POLICY_ENV_VAR = "HF_RETRACE_POLICY"
CACHE_FORMAT = 4  # 2: robust costs, plain proved by two measurements, realized figures; 3: oneDNN per forward width;
# 4: the price of real rounds measured (costs.price, decisions at it)
# how a batch is priced (issue 39): 2 = forwards timed as the batch loop runs them (padding, masked slots, a mask)
# and the rows replayed in lockstep; an entry priced otherwise is tuned again
BATCH_PRICING = 2
_RETRY: dict[str, tuple[float, int]] = {}  # digest -> (when an unsettled tuning may be tried again, tries left)


def _fingerprint(model: Any) -> str:
    config = model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else str(model.config)
    parameters = sum(p.numel() for p in model.parameters())
    text = f"{getattr(model.config, '_name_or_path', '')}|{parameters}|{config}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def machine_key(target: Any, drafter: Any, rows: int = 1) -> dict[str, Any]:
    """Everything a tuned policy depends on besides the temperature (``rows``: the batch size, keyed past 1)."""
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
    if rows > 1:
        key["rows"], key["batch_pricing"] = rows, BATCH_PRICING
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


def records_of(drafter: Any) -> RoundRecords | None:
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


NAMES = ("greedy", "sampled")  # T=0, T>0
_LABELS = {"greedy": "T=0", "sampled": "T>0"}
UNSETTLED = ("this machine's timings stayed too noisy to decide on ({why}); the shipped policy is used for now, "
             "measured again in this process after {retry:.0f} s (at most {retries} times), and by the next process")
STAND_IN = ("this machine's timings with its {threads} threads stayed too noisy to decide on ({why}); timed with "
            "{fewer} instead they settled, and their choice is used for now (never plain decoding), measured again in "
            "this process after {retry:.0f} s (at most {retries} times), and by the next process")
RETRY_SECONDS = 60.0  # an unsettled tuning is tried again by the first call this long after it (a busy moment passes)
RETRIES = 2  # per process


def _unsettled_note(costs: MachineCosts) -> str:
    return UNSETTLED.format(why=costs.unsettled_cause(), retry=RETRY_SECONDS, retries=RETRIES)


def tune(target: Any, drafter: Any, records: RoundRecords | None = None, rows: int = 1) -> dict[str, Any]:
    """Measure this machine's costs (at batch size ``rows``) and choose the policy per temperature; returns the result
    (``policies``, ``costs``, ``tables``, ``seconds``, ``measurements``, and ``cacheable`` with ``note`` saying why
    not).

    Timings too noisy to decide on (:attr:`MachineCosts.settled` False) are timed again with half the intra-op
    threads (a CPU busy with another process: :func:`.costs.measure_costs_fewer_threads`; batch 1 only): where those
    settle, their choice is used, else the shipped policy; uncached either way. Plain
    decoding is a decision that must be proved: where the first measurement finds nothing that pays, the costs are
    measured again, independently, and plain stands only where both agree (else the drafting choice of the second)."""
    started = time.perf_counter()
    records = records if records is not None else records_of(drafter)
    longest = max([drafter.config.block_size - 1] + [b[1] for b in LOOKUP_BUDGETS if b])
    base = shipped_policy(drafter.config)
    costs = measure_costs(target, drafter, max_drafts=longest, rows=rows)
    result: dict[str, Any] = {"costs": costs.to_dict(), "measurements": [costs.to_dict()]}
    if not costs.settled and rows == 1:  # (a batch's choice needs a real A/B, which a busy machine cannot give)
        stand_in = measure_costs_fewer_threads(target, drafter, max_drafts=longest)
        if stand_in is not None:
            result["measurements"].append(stand_in.to_dict())
            if stand_in.settled:
                return _stand_in_choice(result, records, costs, stand_in, base, started)
    if not costs.settled:
        policies = {name: _unsettled(costs, base) for name in NAMES}
        result["unsettled"] = True
        return _finish(result, policies, {}, started, _unsettled_note(costs))
    choice = _choose(records, costs, base)
    costs, choice = _priced(target, drafter, records, costs, choice, result, rows)
    result["costs"] = result["measurements"][0] = costs.to_dict()
    plain = [name for name in NAMES if not choice[name].speculate]
    if plain:  # one measurement never decides plain decoding
        second = replace(measure_costs(target, drafter, max_drafts=longest, rows=rows), price=costs.price,
                         clock_price=costs.clock_price)
        result["measurements"].append(second.to_dict())
        if not second.settled:
            for name in plain:
                choice[name] = _unsettled(second, base)
            result["unsettled"] = True
            return _finish(result, {name: choice[name] for name in NAMES}, choice["tables"], started,
                           _unsettled_note(second))
        again = _choose(records, second, base)  # at the first's price: two of its passes agreed already
        for name in plain:
            if again[name].speculate:  # the two disagree: plain is not proved, draft (the guard still backs off)
                choice[name] = again[name].replace(reason="a second measurement found drafting that pays")
                choice["tables"][name] = again["tables"].get(name, [])
            else:
                choice[name] = choice[name].replace(reason=choice[name].reason + "; two measurements agree")
    note = check_batch_choice(target, drafter, records, choice, result, rows) if rows > 1 and records is not None \
        else ""
    return _finish(result, {name: choice[name] for name in NAMES}, choice["tables"], started, note)


def _priced(target: Any, drafter: Any, records: RoundRecords | None, costs: MachineCosts, choice: dict[str, Any],
            result: dict[str, Any], rows: int) -> tuple[MachineCosts, dict[str, Any]]:
    """``costs`` with the measured price of real rounds and ``choice`` decided again at it
    (:func:`.search.apply_price`), at batch size 1 with recorded T=0 answers: the T=0 choice's rounds, or where it is plain the best replayed
    drafting policy's (a plain choice keeps its knobs), timed in real calls against plain ``generate``
    (:func:`.verify.measure_price`, two of whose passes must agree); the check is appended to ``result["prices"]``.
    Unchanged where the price is not measured or does not settle (the replay's figure alone decides, as before)."""
    if rows != 1 or records is None or not records.greedy or "replayed" not in choice:
        return costs, choice
    policy = choice["greedy"].replace(speculate=True, source="tuned", reason="")
    check = measure_price(target, drafter, policy, records.greedy, costs.step_seconds)
    result.setdefault("prices", []).append(check.to_dict())
    if check.price is None:
        return costs, choice
    clocked = None if check.clocked is None else round(check.clocked, 3)
    return replace(costs, price=round(check.price, 3), clock_price=clocked), apply_price(choice, round(check.price, 3))


def _stand_in_choice(result: dict[str, Any], records: RoundRecords | None, costs: MachineCosts,
                     stand_in: MachineCosts, base: RoundPolicy, started: float) -> dict[str, Any]:
    """The replay's choice under ``stand_in`` (settled costs timed with fewer threads, where ``costs`` with all of
    them were not) for this process, uncached and measured again later; a choice of plain decoding keeps the shipped
    policy instead (a stand-in never proves plain)."""
    choice = _choose(records, stand_in, base)
    timed = f"timed with {stand_in.threads} of {torch.get_num_threads()} threads on a busy machine"
    policies = {name: choice[name].replace(reason=f"{choice[name].reason}; {timed}") if choice[name].speculate
                else _unsettled(stand_in, base) for name in NAMES}
    result.update(costs=stand_in.to_dict(), unsettled=True)
    note = STAND_IN.format(threads=torch.get_num_threads(), why=costs.unsettled_cause(), fewer=stand_in.threads,
                           retry=RETRY_SECONDS, retries=RETRIES)
    return _finish(result, policies, choice["tables"], started, note)


def _choose(records: RoundRecords | None, costs: MachineCosts, base: RoundPolicy) -> dict[str, Any]:
    if records is None:
        armed = costs.arm(base, reason="the drafter ships no recorded rounds to replay")
        return {"greedy": armed, "sampled": armed, "tables": {}}
    return choose_policies(records, costs, base)


def _unsettled(costs: MachineCosts, base: RoundPolicy) -> RoundPolicy:
    """The shipped policy (never plain) when the timings stay too noisy, armed so the guard still backs off."""
    return costs.arm(base).replace(source="shipped", reason="the timings were too noisy to tune on")


def _finish(result: dict[str, Any], policies: dict[str, RoundPolicy], tables: dict, started: float,
            note: str) -> dict[str, Any]:
    result.update(policies={name: policies[name].to_dict() for name in NAMES}, tables=tables,
                  seconds=round(time.perf_counter() - started, 2), cacheable=not note, note=note)
    return result


def _read_cache(path: Path, key: dict[str, Any]) -> tuple[dict[str, RoundPolicy] | None, str, bool]:
    """``(policies, "", False)`` from a valid entry for ``key``; ``(None, why, realized)`` when it must be measured
    again (missing, stale, unreadable, a field of the wrong type or range, a plain choice resting on one measurement;
    ``realized``: a prediction the first real calls did not confirm)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("key") != key:
            return None, "", False  # stale (another version, a hash collision): measure again
        policies = _policies(data, where=f"the cached round policy {path}", digest=path.stem)
    except (FileNotFoundError, NotADirectoryError):  # nothing cached yet (or no cache folder at all)
        return None, "", False
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"the cached round policy {path} is unreadable ({e}); measuring again", False
    for name, policy in policies.items():
        realized = (data.get("realized") or {}).get(name)
        if not policy.speculate and data.get("plain_measurements", 1) < 2:
            return None, f"the cached {_LABELS[name]} choice of plain decoding rests on one measurement; measuring " \
                         "again", False
        probes = (data.get("probes") or {}).get(name)
        clock_price = policy.origin.clock_price if policy.origin is not None else None
        if not policy.speculate and probes_found_drafting(probes, clock_price) and data.get("revisits", 0) < 1:
            said = ", ".join(f"{figure:.2f}" for figure in probes)
            priced = "" if clock_price is None else \
                f", {', '.join(f'{figure * clock_price:.2f}' for figure in probes)}x plain at the measured price"
            return None, (f"the cached {_LABELS[name]} choice of plain decoding was checked by {len(probes)} calls "
                          f"that drafted and realized {said} tokens per step-cost (plain decoding: 1){priced}; "
                          "measuring again"), True
        if not (isinstance(realized, dict) and policy.expected_speedup):
            continue
        figure = realized.get("tokens_per_cost")
        if isinstance(figure, (int, float)) and abs(figure / policy.expected_speedup - 1) > REALIZED_TOLERANCE \
                and data.get("revisits", 0) < 1:
            return None, (f"the cached {_LABELS[name]} policy predicted {policy.expected_speedup:.2f} tokens per "
                          f"step-cost and its first calls realized {figure:.2f} (more than {REALIZED_TOLERANCE:.0%} "
                          "apart); measuring again"), True
    return policies, "", False


def _policies(result: dict[str, Any], where: str = "round policy", digest: str | None = None
              ) -> dict[str, RoundPolicy]:
    """The result's policy per temperature, each checked field by field (``where`` names the file in an error);
    with ``digest``, marked as this machine's cached choice (so its first calls' realized figure is recorded)."""
    found = result.get("policies") if isinstance(result, dict) else None
    if not isinstance(found, dict) or any(name not in found for name in NAMES):
        raise ValueError(f"{where}: expected \"policies\" with a \"greedy\" (T=0) and a \"sampled\" (T>0) "
                         "round policy, as `hf-retrace tune --json` writes")
    policies = {name: RoundPolicy.from_dict(found[name], where=f"{where}, policies.{name}") for name in NAMES}
    if digest is None:
        return policies
    costs = result.get("costs") or {}
    step = costs.get("step_seconds")  # the unit the first calls' figure is counted in
    rows = costs.get("rows", 1)
    revisits = result.get("revisits", 0)  # measured again once already: a plain choice is not checked again
    clock_price = costs.get("clock_price")  # a real call's speed-up per unit of that figure, where measured
    usable = isinstance(clock_price, (int, float)) and not isinstance(clock_price, bool) and clock_price > 0
    clock_price = clock_price if usable else None  # a bad one weighs the checks' figures alone, as before
    return {name: policy.replace(origin=CacheOrigin(digest, name, step, rows, revisits, clock_price=clock_price))
            for name, policy in policies.items()}


def tune_and_cache(target: Any, drafter: Any, revisits: int = 0, rows: int = 1) -> tuple[dict[str, Any], Path]:
    """Tune now (whatever the cache holds) and cache the result for this machine when it may be (``result["cached"]``
    says whether it was, ``result["cache_note"]`` why not); returns it and the cache path. ``rows``: the batch size."""
    key = machine_key(target, drafter, rows)
    digest = _key_digest(key)
    path = policy_cache_dir() / f"{digest}.json"
    result = tune(target, drafter, rows=rows)
    result["revisits"] = revisits
    result["cached"], result["cache_note"] = False, result.get("note", "")
    if result.get("cacheable", True):
        plain = sum(1 for name in NAMES if not result["policies"][name].get("speculate", True))
        kept = {name: value for name, value in result.items() if name not in ("cached", "cache_note")}
        measured = result.get("plain_measurements", len(result.get("measurements", [1])))
        entry = {"key": key, **kept, "plain_measurements": measured if plain else 0,
                 "revisits": revisits, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        try:
            write_atomically(path, entry)
            result["cached"] = True
        except OSError as e:
            result["cache_note"] = f"could not write the cache {path} ({e}); the policy is used for this process only"
    with _LOCK:
        _MEMO[digest] = _policies(result, digest=digest if result["cached"] else None)
        _REALIZED.pop(digest, None)
    return result, path


def cache_line(result: dict[str, Any], path: Path) -> str:
    """What happened to a tuning result, in words: cached where every later generate finds it, or why not."""
    if result.get("cached"):
        return f"cached in {path}: every later generate with this target, drafter, dtype and machine uses it"
    return f"not cached: {result.get('cache_note') or 'not written'}"


def tuned_policies(target: Any, drafter: Any, rows: int = 1) -> dict[str, RoundPolicy]:
    """This machine's policies for ``target`` + ``drafter`` at batch size ``rows``: memoised, else cached on disk,
    else tuned now."""
    key = machine_key(target, drafter, rows)
    digest = _key_digest(key)
    path = policy_cache_dir() / f"{digest}.json"
    with _LOCK:
        retry = _RETRY.get(digest)
        if digest in _MEMO and not (retry and retry[1] > 0 and time.monotonic() >= retry[0]):
            return _MEMO[digest]
        policies, why, realized = _read_cache(path, key)
        if policies is not None:
            _MEMO[digest] = policies
            return policies
    revisits = 0
    if why:
        print(f"[hf-retrace] {why}.", file=sys.stderr, flush=True)
        revisits = _entry_field(path, "revisits", 0) + realized
    batch = f" at batch size {rows}" if rows > 1 else ""
    again = " again (the last timings were too noisy)" if digest in _RETRY else ""
    print(f"[hf-retrace] tuning the round policy for this machine{batch}{again} (measuring costs)...", file=sys.stderr,
          flush=True)
    result, path = tune_and_cache(target, drafter, revisits=revisits, rows=rows)
    with _LOCK:
        policies = _MEMO[digest]
        if result.get("unsettled"):  # a busy moment: the first call after RETRY_SECONDS measures again
            tries = _RETRY.get(digest, (0.0, RETRIES))[1]
            _RETRY[digest] = (time.monotonic() + RETRY_SECONDS, tries - (digest in _RETRY))
        else:
            _RETRY.pop(digest, None)
    print(f"[hf-retrace] tuned in {result['seconds']:.1f} s ({cache_line(result, path)}): T=0 "
          f"{policies['greedy'].describe()}; T>0 {policies['sampled'].describe()}", file=sys.stderr, flush=True)
    return policies


def _entry_field(path: Path, name: str, default: Any) -> Any:
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get(name, default)
    except (OSError, ValueError, AttributeError):
        return default
    return value if isinstance(value, type(default)) else default


def _env_policy(value: str, drafter: Any, do_sample: bool) -> RoundPolicy:
    if value == "shipped":
        return shipped_policy(drafter.config)
    if value == "off":
        return shipped_policy(drafter.config).replace(speculate=False, source="env",
                                                       reason=f"{POLICY_ENV_VAR}=off")
    path = Path(value).expanduser()
    where = f"{POLICY_ENV_VAR}={value}"
    if not path.is_file():
        raise ValueError(f"{where}: expected auto, shipped, off, or the path of a JSON policy file "
                         "(RoundPolicy.to_dict, or `hf-retrace tune --json`'s output); no such file.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: the file cannot be read ({e}).") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e}); expected a RoundPolicy.to_dict() object or "
                         "`hf-retrace tune --json`'s output.") from None
    if isinstance(data, dict) and "policies" in data:
        return _policies(data, where=where)["sampled" if do_sample else "greedy"].replace(source=f"file {path.name}")
    return RoundPolicy.from_dict(data, where=where).replace(source=f"file {path.name}")


def env_policy(drafter: Any, do_sample: bool = False) -> RoundPolicy | None:
    """The policy ``HF_RETRACE_POLICY`` asks for (None: ``auto``, the tuned one), checked now: a ``ValueError`` names
    the variable, the file and the field. A command line calls it before loading anything expensive."""
    value = os.environ.get(POLICY_ENV_VAR, "auto").strip() or "auto"
    return None if value == "auto" else _env_policy(value, drafter, do_sample)


def auto_policy(drafter: Any, target: Any, generation_config: Any, rows: int = 1) -> RoundPolicy:
    """The resolver ``import hf_retrace`` hands the dispatch (:func:`~hf_retrace.generation.dispatch.install`);
    ``rows``: the call's batch size (each batch size is tuned apart)."""
    do_sample = bool(getattr(generation_config, "do_sample", False))
    policy = env_policy(drafter, do_sample)
    if policy is not None:
        return policy
    return probe_or(tuned_policies(target, drafter, rows)["sampled" if do_sample else "greedy"])
