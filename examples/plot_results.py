"""The README's results: its table rows and its one plot, from `hf-retrace bench` JSON reports.

    python examples/plot_results.py docs/bench/2026-12-03/smollm2-T0.json docs/bench/2026-12-03/smollm2-T1.json \
        --cpu "AVX2, no bf16 units" --png docs/results-speedup.png

Prints one markdown row per dataset x temperature (plain tok/s; speed-up over plain and τ per request for prompt
lookup, the drafter alone, the shipped constants and the default) and draws the speed-ups as grouped bars, one panel
per temperature. The default is the ``default`` method (the tuned round policy, exactly as ``generate`` runs it;
``(plain)`` where it decoded plainly); ``dflash`` is the drafter alone, lookup off.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_retrace.bench.records import BenchRow, report_rows

DATASETS = {"gsm8k": "GSM8K", "math500": "MATH-500", "humaneval": "HumanEval", "mtbench": "MT-Bench"}
METHODS = {"prompt-lookup": "prompt lookup", "dflash": "drafter alone", "shipped": "shipped constants",
           "default": "default (tuned)"}


def read_rows(paths: list[Path]) -> dict[tuple[str, float, str], BenchRow]:
    """(dataset, temperature, method) -> row, over every report given."""
    return {(r.dataset, r.temperature, r.method): r for p in paths for r in report_rows(json.loads(p.read_text()))}


def _cell(row: BenchRow | None) -> str:
    if row is None:
        return "–"
    return f"{row.speedup:.2f}× " + ("(plain)" if row.tau_per_request is None else f"(τ {row.tau_per_request:.2f})")


def table_rows(rows: dict[tuple[str, float, str], BenchRow]) -> list[str]:
    lines = []
    for temperature in sorted({t for _, t, _ in rows}):
        for dataset, name in DATASETS.items():
            plain = rows.get((dataset, temperature, "plain"))
            if plain is None:
                continue
            cells = [_cell(rows.get((dataset, temperature, m))) for m in METHODS]
            lines.append(f"| {name} | {temperature:g} | {plain.tokens_per_second:.1f} | " + " | ".join(cells) + " |")
    return lines


def plot(rows: dict[tuple[str, float, str], BenchRow], cpu: str, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({t for _, t, _ in rows})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(5 * len(temperatures) + 1.5, 3.4), sharey=True, squeeze=False)
    width = 0.8 / len(METHODS)
    for ax, temperature in zip(axes[0], temperatures):
        names = [d for d in DATASETS if (d, temperature, "plain") in rows]
        for i, (method, label) in enumerate(METHODS.items()):
            values = [rows[(d, temperature, method)].speedup if (d, temperature, method) in rows else 0 for d in names]
            ax.bar([x + (i - (len(METHODS) - 1) / 2) * width for x in range(len(names))], values, width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(names)), [DATASETS[d] for d in names])
        ax.set_title(f"T={temperature:g}")
    axes[0][0].set_ylabel("speed-up over plain generate")
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct, bf16, {cpu}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="hf-retrace bench --json reports")
    parser.add_argument("--cpu", default="this CPU", help="the machine's name in the table and the plot's title")
    parser.add_argument("--png", type=Path, default=None, help="write the plot here")
    args = parser.parse_args()
    rows = read_rows(args.reports)
    print("\n".join(table_rows(rows)))
    if args.png:
        plot(rows, args.cpu, args.png)


if __name__ == "__main__":
    main()
