"""Two drafters' acceptance on the same prompts, paired: per set, the mean τ of each `hf-retrace bench --json` report's
METHOD row and their difference prompt by prompt, with its standard error.

Eight prompts a set give a set's mean τ a standard error of about 0.1 (prompts differ far more than drafters do), but
both drafters meet the same prompts, so the per-prompt difference is what tells them apart: its standard error was
0.01-0.04 on the dev sets for two close drafters (stage 3 against stage 2) and 0.03-0.09 for stage 4 against stage 2,
where in bf16 each drafter's text parts from plain's at its own near-tie and the pair is scored on partly different
texts. Requests are paired by (prompt id, turn, seed), never by their order; those in one report only are counted and
left out (MT-Bench's two turns of one prompt count as two pairs).

    hf-retrace bench ... --methods default,dflash-full-block --drafter NEW --json new.json
    hf-retrace bench ... --methods default,dflash-full-block --json old.json
    python examples/paired_tau.py new.json old.json [--method dflash-full-block] [--temperature 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from hf_retrace.bench.records import BenchRow, report_rows


def _rows(path: Path, method: str, temperature: float) -> dict[str, BenchRow]:
    try:
        rows = report_rows(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"paired_tau: {path} is not an `hf-retrace bench --json` report ({error}).") from None
    chosen = {row.dataset: row for row in rows if row.method == method and row.temperature == temperature}
    if not chosen:
        methods = sorted({f"{row.method} at T={row.temperature:g}" for row in rows})
        raise SystemExit(f"paired_tau: {path} has no {method} row at T={temperature:g}; it has {', '.join(methods)}. "
                         "Pass --method and --temperature of one of them.")
    return chosen


def paired(a: BenchRow, b: BenchRow) -> dict[str, Any]:
    """One set: both means over the requests both drafted on, the mean difference (a - b) and its standard error."""
    taus_b = {(r.prompt_id, r.turn, r.seed): r.tau for r in b.per_request if r.tau is not None}
    pairs = [(r.tau, taus_b[key]) for r in a.per_request
             if r.tau is not None and (key := (r.prompt_id, r.turn, r.seed)) in taus_b]
    diffs = [x - y for x, y in pairs]
    n = len(pairs)
    return {
        "pairs": n,
        "unpaired": len([r for r in a.per_request if r.tau is not None]) + len(taus_b) - 2 * n,
        "tau_a": statistics.fmean(x for x, _ in pairs) if n else None,
        "tau_b": statistics.fmean(y for _, y in pairs) if n else None,
        "diff": statistics.fmean(diffs) if n else None,
        "se": statistics.stdev(diffs) / math.sqrt(n) if n > 1 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="the first drafter's report (the difference is a - b)")
    parser.add_argument("b", type=Path, help="the second drafter's report, on the same prompts")
    parser.add_argument("--method", default="dflash-full-block", help="the row compared (default: the drafter alone)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args()
    rows_a, rows_b = _rows(args.a, args.method, args.temperature), _rows(args.b, args.method, args.temperature)
    sets = [name for name in rows_a if name in rows_b]
    if not sets:
        raise SystemExit(f"paired_tau: the reports share no set ({sorted(rows_a)} against {sorted(rows_b)}).")
    table = {name: paired(rows_a[name], rows_b[name]) for name in sets}
    print(f"{args.method} at T={args.temperature:g}: {args.a.name} (a) against {args.b.name} (b), paired by prompt")
    print(f"{'set':<12}{'pairs':>6}{'tau a':>8}{'tau b':>8}{'a - b':>9}{'+- se':>8}")
    for name, t in table.items():
        if not t["pairs"]:
            print(f"{name:<12}{0:>6}  (no request drafted in both)")
            continue
        se = f"{t['se']:.3f}" if t["se"] is not None else "-"
        print(f"{name:<12}{t['pairs']:>6}{t['tau_a']:>8.3f}{t['tau_b']:>8.3f}{t['diff']:>+9.3f}{se:>8}"
              + (f"   ({t['unpaired']} unpaired left out)" if t["unpaired"] else ""))
    if args.json:
        args.json.write_text(json.dumps({"method": args.method, "temperature": args.temperature, "a": str(args.a),
                                         "b": str(args.b), "sets": table}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
