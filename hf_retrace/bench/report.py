"""Render a benchmark report (the dict from ``run_benchmark``, or its JSON read back) as JSON, a Markdown table and
PNG plots. Rows are read as :class:`~hf_retrace.bench.records.BenchRow` records, so older reports render too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .methods import drafts_nothing
from .records import BenchRow, report_rows

__all__ = ["markdown_report", "write_json", "write_markdown", "write_plots"]

PER_POSITION_COLUMNS = 8


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "–"
    return f"{value:{spec}}{suffix}"


def _mismatch_cell(row: BenchRow) -> str:
    if row.mismatches is None:
        return "not compared (T>0)"
    if row.method == "plain":
        return "reference"
    cell = f"{row.mismatches}/{row.compared_requests}"
    if row.mismatches:
        wide = "kernel parting" if drafts_nothing(row.method) else "bug"  # plain decoding on other kernels
        cell += f" ({row.mismatch_bugs} {wide}, {row.mismatch_near_ties} near-tie)"
    if row.uncompared_requests:
        cell += f", {row.uncompared_requests} not comparable"
    return cell


def _tau_or_zero(row: BenchRow | None) -> float:
    """A bar's height: 0 where the method did not run or never drafted."""
    return (row.tau if row is not None else None) or 0.0


def markdown_report(report: dict[str, Any]) -> str:
    """The main table (one line per dataset x temperature x method), per-position acceptance and every divergence."""
    settings, env = report["settings"], report["environment"]
    rows = report_rows(report)
    quant = f", {settings['quantization']} target" if settings["quantization"] else ""
    lines = [
        "## hf-retrace bench",
        "",
        f"Target `{settings['target']}`, {settings['dtype']}{quant}; max_new_tokens {settings['max_new_tokens']}; "
        f"{env['harness']} on {env['device']} (torch threads: {env['torch_threads']}), torch {env['torch']}, "
        f"transformers {env['transformers']}. Speed-up = plain decode s/token ÷ method decode s/token, prefill "
        "excluded. τ = accepted drafts + 1 per round, as the per-request mean and (in brackets) pooled over all "
        "rounds. "
        "c = draft s/round ÷ plain s/token; ε = verify s/round ÷ plain s/token − 1; "
        "ideal = τ_round/(1+c+ε).",
        "",
        "| dataset | T | method | τ per request (per round) | tok/s | speed-up | c | ε | speed-up/ideal | "
        "drafted/round | lookup rounds | kept suffix | kept→committed | T=0 mismatches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        tau = f"{_fmt(row.tau)} ({_fmt(row.tau_per_round)})" if row.method != "plain" else "1"
        lines.append(
            f"| {row.dataset} | {row.temperature:g} | {row.method} | {tau} | "
            f"{_fmt(row.tokens_per_second, '.1f')} | {_fmt(row.speedup, '.2f', '×')} | "
            f"{_fmt(row.draft_cost_c)} | {_fmt(row.verify_cost_epsilon)} | "
            f"{_fmt(row.speedup_over_ideal)} | {_fmt(row.mean_draft_length, '.1f')} | "
            f"{_fmt(row.lookup_round_share, '.0%')} | {_fmt(row.kept_suffix_rate, '.0%')} | "
            f"{_fmt(row.kept_token_commit_rate, '.0%')} | {_mismatch_cell(row)} |"
        )
    lines += _policy_lines(rows) + _per_position_table(rows) + _divergence_table(rows)
    for method, reason in report["skipped"].items():
        lines.append(f"\n{method}: {reason}")
    for note in report["notes"]:
        lines.append(f"\nNote: {note}")
    return "\n".join(lines) + "\n"


def _policy_lines(rows: list[BenchRow]) -> list[str]:
    """The round policy each drafting method ran, per temperature (once per distinct policy; older reports: none)."""
    seen: dict[tuple[str, float], str] = {}
    for row in rows:
        if row.policy:
            seen.setdefault((row.method, row.temperature), row.policy)
    if not seen:
        return []
    lines = ["", "Round policies (RoundPolicy.describe(); guard back-offs counted per row in the JSON):", ""]
    lines += [f"- {method}, T={temperature:g}: {policy}" for (method, temperature), policy in seen.items()]
    return lines


def _per_position_table(rows: list[BenchRow]) -> list[str]:
    """Acceptance rate per draft slot and the histogram of tau, for the rows that drafted."""
    drafted = [r for r in rows if r.per_position_acceptance]
    if not drafted:
        return []
    width = min(PER_POSITION_COLUMNS, max(len(r.per_position_acceptance) for r in drafted))
    lines = [
        "",
        f"Per-position acceptance (draft slot 1..{width}; rate among rounds that drafted the slot):",
        "",
        "| dataset | T | method | " + " | ".join(str(i + 1) for i in range(width)) + " | histogram of τ |",
        "|---|---|---|" + "---|" * width + "---|",
    ]
    for row in drafted:
        rates = row.per_position_acceptance[:width] + [None] * (width - len(row.per_position_acceptance))
        histogram = " ".join(f"{k}:{v}" for k, v in row.acceptance_length_histogram.items())
        lines.append(f"| {row.dataset} | {row.temperature:g} | {row.method} | "
                     + " | ".join(_fmt(r) for r in rates) + f" | {histogram} |")
    return lines


def _divergence_table(rows: list[BenchRow]) -> list[str]:
    """Every T=0 divergence from plain, one line each."""
    divergences = [(r, d) for r in rows for d in r.divergences]
    if not divergences:
        return []
    lines = ["", "T=0 divergences from plain generate (first differing new token of each request):", "",
             "| dataset | method | prompt | turn | position | plain token | method token | top-2 gap | "
             "bf16 ulp | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row, d in divergences:
        at = d.divergence
        lines.append(f"| {row.dataset} | {row.method} | {d.prompt_id} | {d.turn} | {at.position} | "
                     f"{at.plain_token} | {at.method_token} | {at.top2_gap:.4g} | {at.bf16_ulp:.3g} | "
                     f"{at.verdict} |")
    return lines


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def write_markdown(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown_report(report))
    return path


def write_plots(report: dict[str, Any], directory: str | Path) -> list[Path]:
    """``tau.png`` (grouped bars: τ per dataset per method, one panel per temperature) and
    ``per_position_acceptance.png`` (one panel per dataset x temperature, one curve per drafting method)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rows = report_rows(report)
    datasets = list(dict.fromkeys(r.dataset for r in rows))
    temperatures = list(dict.fromkeys(r.temperature for r in rows))
    methods = list(dict.fromkeys(r.method for r in rows))
    by_key = {(r.dataset, r.temperature, r.method): r for r in rows}
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}  # one colour per method in both plots
    written = []

    fig, axes = plt.subplots(1, len(temperatures), figsize=(max(6, 1.6 * len(datasets) * len(temperatures) + 3), 4),
                             squeeze=False)
    bar_width = 0.8 / len(methods)
    for ax, temperature in zip(axes[0], temperatures):
        for i, method in enumerate(methods):
            taus = [_tau_or_zero(by_key.get((d, temperature, method))) for d in datasets]
            ax.bar([x + i * bar_width for x in range(len(datasets))], taus, bar_width, label=method,
                   color=colors[method])
        ax.set_xticks([x + bar_width * (len(methods) - 1) / 2 for x in range(len(datasets))], datasets)
        ax.set_ylabel("τ (tokens per target forward)")
        ax.set_title(f"T={temperature:g}")
        ax.axhline(1.0, color="grey", linewidth=0.5)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    written.append(directory / "tau.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    panels = [(d, t) for d in datasets for t in temperatures]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (dataset, temperature) in zip(axes[0], panels):
        for method in methods:
            row = by_key.get((dataset, temperature, method))
            rates = row.per_position_acceptance if row is not None else []
            if rates:
                ax.plot(range(1, len(rates) + 1), rates, marker="o", markersize=3, label=method, color=colors[method])
        ax.set_xlabel("draft slot")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{dataset}, T={temperature:g}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(directory / "per_position_acceptance.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
