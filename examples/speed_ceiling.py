"""The highest decode speed-up any drafter can reach on this machine, from its measured verify costs.

A round that drafts k tokens costs ``c + verify_costs[k]`` plain target steps (c: the drafter's own cost, about 0.15
for the shipped drafter, about 0.01 for a lookup round) and commits the accepted drafts plus one token of the target.
With a per-slot acceptance rate ``alpha`` (each draft accepted with that probability once the ones before it were)
it commits ``(1 - alpha**(k + 1)) / (1 - alpha)`` tokens on average, so the speed-up over plain decoding is that over
the round's cost, at the best k. Reading the verify costs of a calibration (``hf-retrace calibrate --json``) or of
``examples/compare_shapes.py``'s JSON (its shared costs), this prints, for each alpha, the best k and the speed-up,
and the alpha a goal needs:

    python examples/speed_ceiling.py --costs docs/speed/shape-comparison.json --goal 2 --markdown docs/speed/ceiling.md
"""

import argparse
import json
from pathlib import Path

from hf_retrace.generation.policy import verify_cost

ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 1.0)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round of k drafts commits when each draft is accepted with probability alpha after its prefix."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_round(alpha: float, c: float, costs: list[float], max_k: int) -> tuple[int, float]:
    """(k, speed-up) of the best number of drafts per round, at most ``max_k``."""
    return max(((k, expected_tokens(alpha, k) / (c + verify_cost(costs, k))) for k in range(max_k + 1)),
               key=lambda kv: kv[1])


def alpha_needed(goal: float, c: float, costs: list[float], max_k: int) -> float | None:
    """The smallest per-slot acceptance (to 0.001) whose best round reaches ``goal``; None when even 1.0 does not."""
    if best_round(1.0, c, costs, max_k)[1] < goal:
        return None
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if best_round(mid, c, costs, max_k)[1] >= goal else (mid, hi)
    return hi


def read_costs(path: Path) -> list[float]:
    data = json.loads(path.read_text())
    if isinstance(data, list):  # compare_shapes.py: every row carries the shared vector
        return list(data[0]["shared_verify_costs"])
    return list(data["verify_costs"])  # hf-retrace calibrate --json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", required=True, help="a calibration JSON or compare_shapes.py's JSON")
    parser.add_argument("--drafter-c", type=float, default=0.15, help="a drafter round's own cost (target steps)")
    parser.add_argument("--lookup-c", type=float, default=0.01, help="a lookup round's own cost (target steps)")
    parser.add_argument("--block-size", type=int, default=8, help="the drafter drafts at most block_size - 1 tokens")
    parser.add_argument("--lookup-max", type=int, default=16, help="the most tokens a lookup round may propose")
    parser.add_argument("--goal", type=float, default=2.0)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    costs = read_costs(Path(args.costs))
    kinds = [("drafter", args.drafter_c, args.block_size - 1), ("lookup", args.lookup_c, args.lookup_max)]
    lines = ["# The speed-up ceiling of this machine", "",
             "Verify costs (k drafts, in one-token target steps): "
             + ", ".join(f"{k}:{v:.2f}" for k, v in enumerate(costs)) + f" (from `{args.costs}`).", "",
             "| per-slot acceptance α | drafter (c " + f"{args.drafter_c:g}, k ≤ {args.block_size - 1}): best k, "
             "speed-up | lookup (c " + f"{args.lookup_c:g}, k ≤ {args.lookup_max}): best k, speed-up |",
             "|---|---|---|"]
    for alpha in ALPHAS:
        cells = [f"{k}, {s:.2f}×" for k, s in (best_round(alpha, c, costs, m) for _, c, m in kinds)]
        lines.append(f"| {alpha:g} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, c, max_k in kinds:
        need = alpha_needed(args.goal, c, costs, max_k)
        lines.append(f"- {args.goal:g}× with a {name} round needs a per-slot acceptance of "
                     + (f"at least {need:.3f}." if need is not None else "more than 1: out of reach at any α."))
    command = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)
    lines += ["", f"Command: `python examples/speed_ceiling.py {command}`", ""]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
