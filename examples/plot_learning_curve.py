"""The learning curve of training runs: tau (real generate on the run's evaluation prompts) vs tokens seen.

    python examples/plot_learning_curve.py RUN_DIR [RUN_DIR ...] [--out docs/learning_curve] [--label NAME ...]
    [--x tokens|minutes]

Reads each ``RUN_DIR/train_log.jsonl`` (written by ``hf-retrace train``), writes ``OUT.png`` (one line per run: runs
compared at equal tokens, or at equal minutes with ``--x minutes``) and ``OUT.json`` (per run, the points: step,
tokens seen, minutes of training, tau, and the teacher-forced tau proxy of the same step; one run: the list itself, as
before).
"""

import argparse
import json
from pathlib import Path


def curve(run_dir: Path) -> list[dict]:
    points, tokens, proxy, seconds = [], 0, None, None
    for line in (run_dir / "train_log.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line of a killed run
            continue
        if "tokens" in row:  # cumulative; step 0 (the evaluation before training) has no loss
            tokens, seconds = row["tokens"], row.get("seconds")
            proxy = row.get("tau_proxy", proxy)
        if "tau" in row:
            points.append({"step": row["step"], "tokens_seen": tokens,
                           "minutes": round(seconds / 60, 1) if seconds is not None else None,
                           "tau": row["tau"], "tau_proxy_last_step": proxy})
    return points


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dirs", type=Path, nargs="+")
    parser.add_argument("--out", default="docs/learning_curve")
    parser.add_argument("--label", nargs="+", default=None, help="one name per run (default: the folder names)")
    parser.add_argument("--x", choices=("tokens", "minutes"), default="tokens")
    args = parser.parse_args()
    labels = args.label or [run.name for run in args.run_dirs]
    if len(labels) != len(args.run_dirs):
        raise SystemExit(f"--label names {len(labels)} runs, {len(args.run_dirs)} were given: one label per run.")
    curves = {label: curve(run) for label, run in zip(labels, args.run_dirs)}
    empty = [str(run) for run, points in zip(args.run_dirs, curves.values()) if not points]
    if empty:
        raise SystemExit(f"no tau evaluations yet in {', '.join(empty)} (train_log.jsonl).")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = next(iter(curves.values())) if len(curves) == 1 else curves
    out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, points in curves.items():
        xs = [p["tokens_seen"] / 1e6 if args.x == "tokens" else p["minutes"] for p in points]
        ax.plot(xs, [p["tau"] for p in points], marker="o", label=label)
    ax.set_xlabel("training tokens seen (millions)" if args.x == "tokens" else "minutes of training")
    ax.set_ylabel("tau (evaluation prompts, T=0)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.png')} and {out.with_suffix('.json')} "
          f"({', '.join(f'{label}: {len(points)} points' for label, points in curves.items())})")


if __name__ == "__main__":
    main()
