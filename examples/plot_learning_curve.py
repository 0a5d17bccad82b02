"""The learning curve of a training run: tau (real generate on held-out training prompts) vs tokens seen.

    python examples/plot_learning_curve.py RUN_DIR [--out docs/learning_curve] [--label NAME]

Reads ``RUN_DIR/train_log.jsonl`` (written by ``hf-retrace train``), writes ``OUT.png`` and ``OUT.json`` (the points:
step, tokens seen, minutes of training, tau, and the teacher-forced tau proxy of the same step).
"""

import argparse
import json
from pathlib import Path


def curve(run_dir: Path) -> list[dict]:
    points, tokens, proxy = [], 0, None
    for line in (run_dir / "train_log.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line of a killed run
            continue
        if "tokens" in row and "loss" in row:
            tokens = row["tokens"]  # cumulative
            proxy = row.get("tau_proxy", proxy)
            seconds = row.get("seconds")
        if "tau" in row:
            points.append({"step": row["step"], "tokens_seen": tokens,
                           "minutes": round(seconds / 60, 1) if seconds is not None else None,
                           "tau": row["tau"], "tau_proxy_last_step": proxy})
    return points


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", default="docs/learning_curve")
    parser.add_argument("--label", default=None)
    args = parser.parse_args()
    points = curve(args.run_dir)
    if not points:
        raise SystemExit(f"{args.run_dir}/train_log.jsonl has no tau evaluations yet.")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(points, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([p["tokens_seen"] / 1e6 for p in points], [p["tau"] for p in points], marker="o",
            label=args.label or args.run_dir.name)
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel("tau (held-out training prompts, T=0)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.png')} and {out.with_suffix('.json')} ({len(points)} points)")


if __name__ == "__main__":
    main()
