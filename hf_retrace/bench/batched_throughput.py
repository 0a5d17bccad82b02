"""``hf-retrace bench --batch-size N``: batched ``generate`` with each drafting method against plain batched
``generate``, at the same batch size and the same left padding.

Each dataset's first turns are cut into batches of N prompts in the dataset's order (the last batch may be smaller),
left-padded with the tokenizer's pad token. Per batch and method one timed ``generate`` call (``repeats`` > 1: that
many, the methods' order alternating each time, and the median time kept); before them, once per batch, one timed
target forward over the padded batch (what ``generate``'s prefill does), subtracted from every method's time, as the
single-request benchmark does (``runner``). The figures:

- **throughput**: committed new tokens of all rows after each row's first (the prefill's), per decode second;
  ``speedup`` = the method's throughput / plain batched throughput on the same batches;
- **tau**: ``GenerationStats.mean_acceptance_length`` pooled over every row's rounds (the drafter's ``last_stats``);
- **T=0 equality**: rows whose tokens differ from plain batched ``generate``'s row (in fp32 every one is a bug; in bf16
  a verify over several tokens can round differently at a near-tie).

Methods other than our drafter's (prompt lookup, native DFlash) are skipped: transformers' assisted loop refuses
batches.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

from ..chat import prompt_token_ids
from ..divergence import find_divergence
from ..generation.batched import left_padded
from ..generation.placement import synchronize
from ..sampling import sampling_kwargs
from ..stats import GenerationStats
from .loop import Bench, call_order
from .plan import BenchPlan, BenchSpec

__all__ = ["batched_markdown", "run_batched_benchmark"]


def _new_tokens(sequences: torch.Tensor, prompt_width: int, eos_ids: set[int]) -> list[list[int]]:
    """Each row's committed new tokens: up to and with its first EOS (plain pads after it), else all of them."""
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))
        rows.append(row[:end])
    return rows


@torch.inference_mode()
def _prefill_seconds(target: Any, batch: dict[str, torch.Tensor]) -> float:
    synchronize(batch["input_ids"].device)
    started = time.perf_counter()
    out = target(**batch, use_cache=True, logits_to_keep=1)
    synchronize(out.logits.device)
    return time.perf_counter() - started


def _batch_methods(bench: Bench, batch_size: int) -> tuple[list[Any], list[str]]:
    """(plain first, then the drafter methods; the names of the methods a batch cannot run, each said on stderr)."""
    methods = sorted((m for m in bench.methods if m.kind in ("plain", "drafter")), key=lambda m: m.kind != "plain")
    skipped = [m for m in bench.methods if m not in methods]
    for method in skipped:
        why = ("a batch's plain step is a forward of as many tokens as rows, where oneDNN is the faster; not measured "
               "batched" if not method.onednn else "transformers' assisted loop, which it runs in, refuses batches")
        print(f"[hf-retrace bench] {method.name}: skipped at --batch-size {batch_size} ({why})", file=sys.stderr)
    return methods, [m.name for m in skipped]


def _batches(plan: BenchPlan, tokenizer: Any, batch_size: int, pad: int, device: Any) -> dict[str, list[dict]]:
    """Per dataset, its prompts' first turns in left-padded batches of ``batch_size`` (the last may be smaller)."""
    return {dataset: [left_padded(prompt_token_ids(tokenizer, [p.turns[0] for p in prompts[i : i + batch_size]]),
                                  pad, device)
                      for i in range(0, len(prompts), batch_size)]
            for dataset, prompts in plan.prompts.items()}


def run_batched_benchmark(spec: BenchSpec, plan: BenchPlan, batch_size: int, repeats: int = 1) -> dict[str, Any]:
    """Load the models, warm up, run every batch with plain and each drafting method (each call ``repeats`` times,
    the median time kept); return the report dict."""
    from .runner import _settings, load_models, temperature_label

    target, tokenizer, drafters = load_models(plan)
    bench = Bench(plan, target, tokenizer, drafters)
    methods, skipped = _batch_methods(bench, batch_size)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    eos = target.generation_config.eos_token_id
    eos_ids = set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
    device = target.get_input_embeddings().weight.device
    batches = _batches(plan, tokenizer, batch_size, pad, device)

    def call(method: Any, batch: dict, temperature: float, seed: int, max_new_tokens: int) -> tuple[Any, float]:
        torch.manual_seed(seed)
        synchronize(device)
        started = time.perf_counter()
        out = target.generate(**batch, **bench.generate_kwargs(method), pad_token_id=pad,
                              **sampling_kwargs(temperature, max_new_tokens))
        synchronize(device)
        return out, time.perf_counter() - started

    if spec.warmup:  # the first forwards of a process are slow, and so is each method's first full-length call (its
        # cache grown to the full length, every verify width met): keep them out of the timings
        first = next(iter(batches.values()))[0]
        for method in methods:
            call(method, first, 0.0, spec.seeds[0], spec.max_new_tokens)
    rows = []
    runs = [(t, s) for t in spec.temperatures for s in (spec.seeds if t > 0 else spec.seeds[:1])]
    for dataset, dataset_batches in batches.items():
        for temperature in spec.temperatures:
            seeds = [s for t, s in runs if t == temperature]
            totals = {m.name: dict(tokens=0, seconds=0.0, stats=[], differing=0, near_ties=0, rows=0)
                      for m in methods}
            for index, batch in enumerate(dataset_batches):
                prefill = _prefill_seconds(target, batch)
                for seed in seeds:
                    rows_of, stats_of = {}, {}
                    times: dict[str, list[float]] = {m.name: [] for m in methods}
                    for repeat in range(repeats):
                        for method in call_order(methods, index + repeat):  # nor first on every batch
                            out, seconds = call(method, batch, temperature, seed, spec.max_new_tokens)
                            times[method.name].append(seconds)
                            if method.name not in rows_of:  # seeded alike: every repeat gives the same rows
                                rows_of[method.name] = _new_tokens(out, batch["input_ids"].shape[1], eos_ids)
                                stats_of[method.name] = (None if method.kind == "plain"
                                                         else bench.drafters[method.name].last_stats)
                    for method in methods:
                        _add_call(totals[method.name], rows_of[method.name],
                                  statistics.median(times[method.name]) - prefill, stats_of[method.name])
                    if temperature == 0 and "plain" in rows_of:  # (outside the timed calls)
                        for name, new in rows_of.items():
                            if name != "plain":
                                _count_differing(target, batch, new, rows_of["plain"], spec.dtype, totals[name])
            plain_rate = totals["plain"]["tokens"] / totals["plain"]["seconds"] if "plain" in totals else None
            for method in methods:
                rows.append({"dataset": dataset, "temperature": temperature_label(temperature), "method": method.name,
                             "batch_size": batch_size, "batches": len(dataset_batches),
                             **_measured(totals[method.name], plain_rate, temperature)})
    timing = ("decode only: each batch's generate wall time minus one timed batched prefill forward; tokens after "
              "each row's first")
    environment = {"device": str(device), "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    if repeats > 1:
        timing += f"; each call timed {repeats} times, the methods' order alternating, the median kept"
    return {"settings": {**_settings(plan), "batch_size": batch_size, "repeats": repeats, "skipped_methods": skipped,
                         "timing": timing},
            "environment": environment, "rows": rows}


def _add_call(total: dict[str, Any], rows: list[list[int]], decode_seconds: float, stats: Any) -> None:
    """Add one timed call's new rows (tokens after each row's first) and decode time to a method's ``total``."""
    total["tokens"] += sum(max(len(row) - 1, 0) for row in rows)
    total["seconds"] += max(decode_seconds, 1e-9)
    total["rows"] += len(rows)
    if stats is not None:
        total["stats"].append(stats)


def _count_differing(target: Any, batch: dict[str, torch.Tensor], rows: list[list[int]], plain_rows: list[list[int]],
                     dtype: str, total: dict[str, Any]) -> None:
    """Count the T=0 rows that differ from plain's in ``total``, and those whose first divergence is a bf16 near-tie
    (:func:`~hf_retrace.divergence.find_divergence`, on the row's unpadded prompt)."""
    for b, (row, plain_row) in enumerate(zip(rows, plain_rows)):
        if row == plain_row:
            continue
        prompt = batch["input_ids"][b][batch["attention_mask"][b].bool()][None]
        found = find_divergence(target, prompt, plain_row, row, dtype)
        total["differing"] += 1
        total["near_ties"] += found is not None and found.verdict == "near-tie"


def _measured(total: dict[str, Any], plain_rate: float | None, temperature: float) -> dict[str, Any]:
    """One method's figures on one dataset and temperature, from its ``total``."""
    rate = total["tokens"] / total["seconds"]
    stats = [s for s in total["stats"] if s is not None]
    pooled = GenerationStats.pooled(stats)
    return {"rows": total["rows"], "decode_tokens": total["tokens"], "decode_seconds": total["seconds"],
            "tokens_per_second": rate, "speedup": rate / plain_rate if plain_rate else None,
            "tau": pooled.mean_acceptance_length if pooled.rounds else None,  # (None: decoded plainly)
            "rows_differing_from_plain": total["differing"] if temperature == 0 else None,
            "near_ties": total["near_ties"] if temperature == 0 else None,
            "policy": "; ".join(sorted({s.policy for s in stats if s.policy})) or None}


def batched_markdown(report: dict[str, Any]) -> str:
    """The report as one Markdown table."""
    settings = report["settings"]
    lines = [f"## hf-retrace bench, batch size {settings['batch_size']}", "",
             f"Target `{settings['target']}`, {settings['dtype']}; max_new_tokens {settings['max_new_tokens']}; "
             f"{settings['timing']}.", "",
             "| dataset | T | method | rows | tok/s | speed-up | τ | rows ≠ plain (T=0) |",
             "|---|---|---|---|---|---|---|---|"]
    policies = {}
    for row in report["rows"]:
        speedup = "–" if row["speedup"] is None else f"{row['speedup']:.2f}×"
        tau = "–" if row["tau"] is None else f"{row['tau']:.2f}"
        differing = "–" if row["rows_differing_from_plain"] is None else str(row["rows_differing_from_plain"])
        if row["rows_differing_from_plain"]:
            ties = row.get("near_ties") or 0
            differing += f" ({ties} near-tie, {row['rows_differing_from_plain'] - ties} beyond 2 ulps)"
        lines.append(f"| {row['dataset']} | {row['temperature']} | {row['method']} | {row['rows']} | "
                     f"{row['tokens_per_second']:.1f} | {speedup} | {tau} | {differing} |")
        if row.get("policy"):
            policies.setdefault((row["method"], row["temperature"]), row["policy"])
    if policies:
        lines += ["", "Round policies (each batch size is tuned apart):", ""]
        lines += [f"- {method}, {temperature}: {policy}" for (method, temperature), policy in policies.items()]
    lines += ["", "A row ≠ plain at T=0 is classified at its first differing token by the target's top-2 logit gap "
              "there (hf_retrace.divergence: a near-tie is within 2 bf16 ulps; a batched bf16 verify rounds "
              "differently from plain's one-token steps, and fp32 rows are equal, tests/test_batched.py)."]
    return "\n".join(lines) + "\n"
