"""Drafter shapes for this CPU, compared at equal training time (issue on speed, item 3).

Each variant trains from scratch on the same precomputed target features for the same wall-clock budget: a short
probe measures its seconds per optimizer step alone on the machine, the real run gets ``budget / seconds-per-step``
steps (so its learning-rate schedule completes), then ``hf-retrace calibrate`` replays the same unseen calibration
prompts with it: full-block τ, the adaptive block's best threshold, and tokens per step-cost (the speed the drafter
would give on this machine, its own round cost included). Run it alone on the machine: the budget is wall-clock.

    python examples/compare_shapes.py --data ~/.cache/hf_retrace_runs/tok \
        --features-dir ~/.cache/hf_retrace_runs/feats5 --minutes 8 --runs ~/.cache/hf_retrace_runs/shapes \
        --markdown docs/speed/shape-comparison.md

Every step resumes: a variant whose calibration JSON exists is not run again; a killed run continues (``--resume``).
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from hf_retrace.generation.policy import RoundPolicy
from hf_retrace.tuning.replay import replay_rounds
from hf_retrace.tuning.search import CUTS, best_row

# name -> the train arguments that make the variant (everything else is shared, below)
VARIANTS = {
    "1 layer, block 8": ["--num-layers", "1", "--block-size", "8"],
    "3 layers, block 8": ["--num-layers", "3", "--block-size", "8"],
    "1 layer, block 16": ["--num-layers", "1", "--block-size", "16"],
    "1 layer, block 8, target's last layer copied": ["--num-layers", "1", "--block-size", "8",
                                                     "--copy-target-layers"],
    "1 layer, block 8, full vocabulary": ["--num-layers", "1", "--block-size", "8", "--draft-vocab-size", "0"],
    # after the shared arguments, so this --num-anchors replaces the recipe's 48
    "1 layer, block 8, 96 anchors": ["--num-layers", "1", "--block-size", "8", "--num-anchors", "96"],
    # the denser objective, against the same shape on the same answers: the target's top-16 distribution
    # (hf-retrace data topk, --topk-dir) covers the first 768 answers only, so both train on those
    "1 layer, block 8, 768 answers": ["--num-layers", "1", "--block-size", "8", "--max-sequences", "768"],
    "1 layer, block 8, 768 answers, top-k distillation 0.5": ["--num-layers", "1", "--block-size", "8",
                                                               "--max-sequences", "768", "--distill-weight", "0.5",
                                                               "--topk-dir", "{topk_dir}"],
}
PROBE_STEPS = 12


def shared_train_args(args: argparse.Namespace) -> list[str]:
    # the shipped recipe (examples/train_smollm2_drafter.sh, backbone step); the calibration sequences stay unseen
    return ["--stage", "backbone", "--target", args.target, "--data", args.data, "--features-dir", args.features_dir,
            "--max-sequences", str(args.max_sequences), "--holdout", "0", "--target-layer-ids", "1,8,14,20,27",
            "--num-anchors", "48", "--gamma", "4", "--batch-size", "2", "--grad-accum", "2", "--lr", "1e-3",
            "--warmup-ratio", "0.02", "--num-threads", str(args.threads), "--seed", "0", "--target-dtype", "bf16",
            "--save-dtype", "bf16", "--save-every", "200", "--keep-checkpoints", "1", "--no-progress"]


def draft_vocab_args(variant: list[str], default_size: int) -> list[str]:
    """``--draft-vocab-size 0`` in VARIANTS means the full vocabulary (the flag left out); else the shipped size."""
    if "--draft-vocab-size" in variant:
        i = variant.index("--draft-vocab-size")
        rest = variant[:i] + variant[i + 2:]
        return rest if variant[i + 1] == "0" else variant
    return [*variant, "--draft-vocab-size", str(default_size)]


def train_log(run: Path) -> list[dict]:
    rows = []
    for line in (run / "train_log.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line of a killed run
            continue
        if "loss" in row:
            rows.append(row)
    return rows


def hf_retrace(*cli_args: str) -> None:
    command = [sys.executable, "-m", "hf_retrace.cli", *cli_args]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def seconds_per_step(args: argparse.Namespace, name: str, variant: list[str], run: Path) -> float:
    probe = run.parent / (run.name + "-probe")
    if not (probe / "train_log.jsonl").is_file() or len(train_log(probe)) < PROBE_STEPS:
        hf_retrace("train", *shared_train_args(args), *variant, "--out", str(probe), "--max-steps",
                   str(PROBE_STEPS), "--overwrite")
    rows = train_log(probe)
    # the first steps warm up allocators and caches: time the second half of the probe
    half = len(rows) // 2
    per_step = (rows[-1]["seconds"] - rows[half - 1]["seconds"]) / (len(rows) - half)
    print(f"[compare-shapes] {name}: {per_step:.2f} s/step in the probe", flush=True)
    return per_step


def run_variant(args: argparse.Namespace, name: str, variant: list[str]) -> dict:
    run = Path(args.runs) / name.replace(", ", "-").replace(" ", "_").replace("'", "").replace(",", "")
    calibration = run / "calibration.json"
    variant = [a.format(topk_dir=args.topk_dir) for a in draft_vocab_args(variant, args.draft_vocab_size)]
    if args.steps:  # equal steps: the seconds per step are the run's own
        steps = args.steps
    else:
        per_step = seconds_per_step(args, name, variant, run)
        steps = max(1, int(args.minutes * 60 / per_step))
    if not calibration.is_file():
        if not (run / "training_summary.json").is_file():
            hf_retrace("train", *shared_train_args(args), *variant, "--out", str(run), "--max-steps", str(steps),
                       "--resume")
        hf_retrace("calibrate", "--target", args.target, "--drafter", str(run), "--data", args.data,
                   "--sequences", args.calibration_sequences, "--limit", str(args.calibration_limit),
                   "--max-new-tokens", "96", "--num-threads", str(args.threads), "--json", str(calibration))
    rows = train_log(run)
    table = json.loads(calibration.read_text())
    if args.steps:
        per_step = rows[-1]["seconds"] / rows[-1]["step"]
    return {"variant": name, "args": " ".join(variant), "seconds_per_step": per_step, "steps": rows[-1]["step"],
            "tokens_seen": rows[-1]["tokens"], "minutes": rows[-1]["seconds"] / 60,
            "tau_full_block": table["full_block"]["tau"], "threshold": table["best"]["threshold"],
            "tau_adaptive": table["best"]["tau"], "tokens_per_cost": table["best"]["tokens_per_cost"],
            "c": table["draft_cost_c"], "calibration": str(calibration)}


def shared_cost_replay(results: list[dict]) -> None:
    """Each calibration times the target's verify costs anew, and they drift between runs on a shared machine: replay
    every variant's recorded rounds under one verify-cost vector (per k, the median over the variants that measured
    it) with its own round cost c, so tokens per step-cost compare shapes, not moments."""
    tables = [json.loads(Path(r["calibration"]).read_text()) for r in results]
    longest = max(len(t["verify_costs"]) for t in tables)
    shared = [statistics.median(t["verify_costs"][k] for t in tables if k < len(t["verify_costs"]))
              for k in range(longest)]
    for result, table in zip(results, tables):
        rows = [{"threshold": cut, **replay_rounds(table["recorded_rounds"], RoundPolicy(
            confidence_cut=cut, verify_costs=shared, draft_cost=table["draft_cost_c"]))} for cut in CUTS]
        best = best_row(rows)
        result.update(shared_threshold=best["threshold"], shared_tokens_per_cost=best["tokens_per_cost"],
                      shared_verify_costs=shared)


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    budget = (f"for {args.steps} optimizer steps each (equal steps; `s/step` and `minutes` are each run's own)"
              if args.steps else
              f"for a budget of {args.minutes:g} minutes of wall-clock (steps = budget / the seconds per step of a "
              f"{PROBE_STEPS}-step probe; `minutes` is the training time measured; 2 threads, alone on the machine)")
    lines = [
        "# Drafter variants at an equal training budget (SmolLM2-135M-Instruct, this CPU)", "",
        f"Each variant trained from scratch {budget} on the same precomputed features of the first "
        f"{args.max_sequences} training answers (or fewer where the variant says), "
        f"then replayed on calibration sequences {args.calibration_sequences} (limit {args.calibration_limit}, never "
        "trained on) by `hf-retrace calibrate`. τ = accepted drafts + 1 per round; tokens per step-cost = committed "
        "tokens per (verify + draft) cost in plain target steps, at the best adaptive threshold; c = draft seconds "
        "per round / plain seconds per token. The last column replays every variant's recorded rounds under one "
        "verify-cost vector (per k the median over the variants' own measurements), so it compares shapes rather "
        "than the moments their calibrations ran.", "",
        "| variant | s/step | steps | minutes | tokens seen | full-block τ | best threshold | adaptive τ "
        "| tokens per step-cost | c | tokens per step-cost, shared verify costs (threshold) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        shared = (f"{r['shared_tokens_per_cost']:.3f} ({r['shared_threshold']:.2f})"
                  if "shared_tokens_per_cost" in r else "–")
        lines.append(f"| {r['variant']} | {r['seconds_per_step']:.2f} | {r['steps']} | {r['minutes']:.1f} "
                     f"| {r['tokens_seen'] / 1e3:.0f}k "
                     f"| {r['tau_full_block']:.2f} | {r['threshold']:.2f} | {r['tau_adaptive']:.2f} "
                     f"| {r['tokens_per_cost']:.3f} | {r['c']:.3f} | {shared} |")
    if results and "shared_verify_costs" in results[0]:
        costs = ", ".join(f"{k}:{v:.2f}" for k, v in enumerate(results[0]["shared_verify_costs"]))
        lines += ["", f"Shared verify costs (k drafts, × one target step): {costs}."]
    command = " ".join(f'"{a}"' if " " in a else a for a in sys.argv[1:]).replace(str(Path.home()), "~")
    lines += ["", f"Command: `python examples/compare_shapes.py {command}`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="tokenized answers (hf-retrace data tokenize)")
    parser.add_argument("--features-dir", required=True, help="their precomputed features (hf-retrace data features)")
    parser.add_argument("--runs", required=True, help="where the variants' runs go (outside the work tree)")
    parser.add_argument("--target", default="default")
    parser.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget per variant")
    parser.add_argument("--steps", type=int, default=None,
                        help="train every variant for this many steps instead (variants whose steps cost the same)")
    parser.add_argument("--topk-dir", default=None,
                        help="the target's top-k distributions (hf-retrace data topk), for the distillation variant")
    parser.add_argument("--max-sequences", type=int, default=4900)
    parser.add_argument("--draft-vocab-size", type=int, default=8960)
    parser.add_argument("--calibration-sequences", default="4900:4932")
    parser.add_argument("--calibration-limit", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="+", choices=sorted(VARIANTS), default=None, help="run these variants only")
    parser.add_argument("--markdown", default=None, help="write the table here")
    args = parser.parse_args()
    names = args.only or list(VARIANTS)
    needs_topk = [n for n in names if any("{topk_dir}" in a for a in VARIANTS[n])]
    if needs_topk and not args.topk_dir:
        parser.error(f"{', '.join(needs_topk)} need --topk-dir (hf-retrace data topk --limit 768); or leave them out "
                     "with --only")
    results = []
    for name in names:
        results.append(run_variant(args, name, VARIANTS[name]))
        print(markdown(results, args), flush=True)
    shared_cost_replay(results)
    print(markdown(results, args), flush=True)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown(results, args))
        # the calibration paths are this machine's: not part of the record
        public = [{k: v for k, v in r.items() if k != "calibration"} for r in results]
        Path(args.markdown).with_suffix(".json").write_text(json.dumps(public, indent=2) + "\n")


if __name__ == "__main__":
    main()
