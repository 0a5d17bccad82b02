"""``hf-retrace bench``: every decoding method on the same prompts, side by side, in one run.

One entry point (:func:`run_benchmark`), many datasets, one per-prompt loop (:func:`run_prompt`).

What is measured, per request (one user turn answered by one ``generate`` call):

- **Prefill excluded.** Before each request the target runs one timed forward over the request's input ids
  (``use_cache=True, logits_to_keep=1``: what ``generate``'s first forward does); that time is subtracted from the
  ``generate`` wall time. The prefill forward also yields the first new token, so the decode rate is
  ``(new tokens - 1) / (generate seconds - prefill seconds)``. Identical inputs (every method at T=0, every seed)
  reuse one prefill measurement, so prefill noise never separates the methods.
- **tau** is ``GenerationStats.mean_acceptance_length`` (accepted drafts + 1 per drafting round), never recomputed
  here: ``tau_per_request`` averages it over requests (z-lab's convention), ``tau_per_round`` pools every round of
  the dataset (vLLM's). Plain decoding has tau = 1 by that definition. transformers' own generators (prompt lookup,
  native DFlash) are recorded into a ``GenerationStats`` by wrapping their two methods; as in hf_retrace's own
  generator, the prefill forward and forwards that drafted nothing (prompt lookup found no n-gram) are not rounds.
- **Costs.** ``draft_cost_c`` = drafter seconds per round / plain decode seconds per token, ``verify_cost_epsilon`` =
  verify seconds per round / plain decode seconds per token - 1, ``ideal_speedup`` = tau_per_round / (1 + c + eps),
  and ``speedup_over_ideal`` = measured speed-up / ideal speed-up (what the loop's own overhead leaves).
- **Losslessness at T=0.** Every output is compared token by token with plain ``generate`` on the same input. The
  first divergence is reported with its position and the target's top-2 logit gap there (one target forward over
  plain's sequence up to that position). In fp32 every divergence is a bug; in bf16 a gap within two bf16 ulps of the
  logit magnitude is a near-tie (numerics), anything larger is a bug. Nothing is averaged away. At T > 0 outputs
  legitimately differ and are not compared.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from .divergence import NEAR_TIE_ULPS, find_divergence
from .loop import Bench, TurnResult, run_prompt
from .methods import ALL_METHODS, DEFAULT_METHODS, PROMPT_LOOKUP_NUM_TOKENS, Method
from .plan import BenchInputError, BenchPlan, BenchSpec, plan_benchmark
from .records import BenchRow
from .summary import lossless_summary, summarize

# the bench's public surface, importable from here as before the split into methods, plan, loop, divergence, summary
__all__ = [
    "ALL_METHODS",
    "DEFAULT_METHODS",
    "BenchInputError",
    "BenchSpec",
    "BenchPlan",
    "Method",
    "find_divergence",
    "plan_benchmark",
    "run_benchmark",
    "run_prompt",
]

SCHEMA_VERSION = 1
RequestsByRow = dict[tuple[str, float, str], list[TurnResult]]  # (dataset, temperature, method name) -> requests


def run_benchmark(spec: BenchSpec, plan: BenchPlan | None = None) -> dict[str, Any]:
    """Check the spec, load the models, warm up, run every prompt with every method; return the report dict."""
    plan = plan or plan_benchmark(spec)
    for method, reason in plan.skipped.items():
        print(f"[hf-retrace bench] {method}: {reason}", file=sys.stderr)
    for note in plan.notes:
        print(f"[hf-retrace bench] note: {note}", file=sys.stderr)
    loaded_at = time.perf_counter()
    bench = Bench(plan, *load_models(plan))
    load_seconds = time.perf_counter() - loaded_at
    if spec.warmup:  # first forwards of a process are slow (allocations, kernel choice): keep them out of the timings
        _warm_up(bench, spec, plan)
    started = time.perf_counter()
    turns_by_row = _run_every_request(bench, spec, plan)
    bench_seconds = time.perf_counter() - started
    rows = _summarize_rows(bench, spec, plan, turns_by_row)
    row_dicts = [row.to_dict() for row in rows]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for row, row_dict in zip(rows, row_dicts):
        results.setdefault(row.dataset, {}).setdefault(row.method, {})[temperature_label(row.temperature)] = row_dict
    return {
        "schema_version": SCHEMA_VERSION,
        "settings": _settings(plan),
        "environment": _environment(bench, load_seconds, bench_seconds),
        "methods": {m.name: m.description for m in bench.methods},
        "skipped": dict(plan.skipped),
        "notes": list(plan.notes),
        "results": results,
        "rows": row_dicts,
        "lossless": lossless_summary(rows),
    }


def load_models(plan: BenchPlan) -> tuple[Any, Any, dict[str, Any]]:
    """(target, tokenizer, {drafter path: drafter}), loaded through :mod:`hf_retrace.loading`."""
    from ..generation.placement import embedding_device
    from ..loading import load_drafter, load_target

    spec = plan.spec
    target, tokenizer = load_target(plan.target_path, spec.dtype, spec.quantization, device=spec.device,
                                    device_map=spec.device_map)
    device = embedding_device(target)  # where every drafter runs
    drafters = {path: load_drafter(path, spec.dtype, device=device, compile=spec.compile)
                for path in dict.fromkeys(plan.drafter_paths.values())}
    return target, tokenizer, drafters


def temperature_label(temperature: float) -> str:
    return f"T={temperature:g}"


def _warm_up(bench: Bench, spec: BenchSpec, plan: BenchPlan) -> None:
    """One short untimed request (the first prompt's first turn, every method); its prefill timings forgotten."""
    first_prompt = next(p for prompts in plan.prompts.values() for p in prompts)
    warm = dataclasses.replace(first_prompt, turns=first_prompt.turns[:1])
    saved, bench.max_new_tokens, bench.repeats = (bench.max_new_tokens, bench.repeats), min(spec.max_new_tokens, 16), 1
    run_prompt(bench, warm, 0.0, spec.seeds[0])
    bench.max_new_tokens, bench.repeats = saved
    bench.forget_prefill_timings()


def _run_every_request(bench: Bench, spec: BenchSpec, plan: BenchPlan) -> RequestsByRow:
    """Every dataset x (temperature, seed) x prompt x method; the requests grouped by (dataset, temperature, method).

    T > 0 runs every seed, T = 0 the first only (greedy decoding does not depend on it).
    """
    runs = [(t, s) for t in spec.temperatures for s in (spec.seeds if t > 0 else spec.seeds[:1])]
    total = sum(len(p.turns) for prompts in plan.prompts.values() for p in prompts) * len(runs) * len(bench.methods)
    turns_by_row: RequestsByRow = {}
    with tqdm(total=total, desc="hf-retrace bench", unit="request", disable=not spec.progress, file=sys.stderr) as bar:
        for dataset, prompts in plan.prompts.items():
            for temperature, seed in runs:
                for prompt in prompts:
                    for turn in run_prompt(bench, prompt, temperature, seed, on_request=lambda: bar.update(1)):
                        turns_by_row.setdefault((dataset, temperature, turn.method), []).append(turn)
    return turns_by_row


def _summarize_rows(bench: Bench, spec: BenchSpec, plan: BenchPlan,
                    turns_by_row: RequestsByRow) -> list[BenchRow]:
    """One row per dataset x temperature x method; plain's decode time per token is every row's speed-up baseline."""
    rows = []
    for dataset in plan.prompts:
        for temperature in spec.temperatures:
            plain = summarize(dataset, turns_by_row[(dataset, temperature, "plain")], ALL_METHODS["plain"], None,
                              temperature)
            for method in bench.methods:
                rows.append(summarize(dataset, turns_by_row[(dataset, temperature, method.name)], method,
                                      plain.decode_seconds_per_token, temperature))
    return rows


def _settings(plan: BenchPlan) -> dict[str, Any]:
    from .. import defaults
    from ..loading import portable_path

    spec = plan.spec
    default = spec.target in (None, "default")
    target = f"{defaults.DEFAULT_TARGET_HUB_ID} (converted default)" if default else portable_path(plan.target_path)
    return {
        "target": target,
        "drafters": {name: portable_path(path) for name, path in plan.drafter_paths.items()},
        "datasets": {name: len(prompts) for name, prompts in plan.prompts.items()},
        "methods": [m.name for m in plan.methods],
        "temperatures": list(spec.temperatures),
        "seeds": list(spec.seeds),
        "max_new_tokens": spec.max_new_tokens,
        "limit": spec.limit,
        "dtype": spec.dtype,
        "quantization": spec.quantization,
        "device": spec.device,
        "device_map": spec.device_map,
        "compile": spec.compile,
        "warmup": spec.warmup,
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS,
        "near_tie_ulps": NEAR_TIE_ULPS,
        "timing": "decode only: generate wall time minus one timed target prefill forward per request; "
                  "tokens after the first (the prefill's)" + (f"; each request timed {spec.repeats} times, the "
                                                             "methods' order alternating, the median kept"
                                                             if spec.repeats > 1 else ""),
        "repeats": spec.repeats,
    }


def _environment(bench: Bench, load_seconds: float, bench_seconds: float) -> dict[str, Any]:
    import transformers

    from .. import __version__

    return {
        "harness": "Hugging Face transformers generate(), eager, batch size 1",
        "device": str(bench.target.device),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_retrace": __version__,
        "load_seconds": load_seconds,
        "bench_seconds": bench_seconds,
    }

