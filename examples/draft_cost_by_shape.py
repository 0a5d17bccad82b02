"""The draft cost c of drafter shapes on this machine: one drafter round, in one-token steps of the target.

For each drafter folder (a trained run's export, or any ``from_pretrained`` folder), the tuner's own measurement
(:func:`hf_retrace.tuning.costs.measure_costs`): a round scoring 2 slots (what a confidence cut mostly pays) and one
scoring the whole block (full blocks), against the target's one-token step timed beside it, and the verify-cost curve
of the same window. c does not depend on the weights' values, so an early checkpoint prices its shape. Run it alone on
the machine: these are timings.

    python examples/draft_cost_by_shape.py RUNS/shape-l1-b8/export RUNS/shape-l2-b16/export --markdown c.md
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from hf_retrace.loading import load_drafter, load_target
from hf_retrace.machine import cpu_info
from hf_retrace.tuning.costs import measure_costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafters", nargs="+", help="drafter folders")
    parser.add_argument("--target", default="default")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _ = load_target(args.target, args.dtype)
    rows = []
    for folder in args.drafters:
        drafter = load_drafter(folder, args.dtype, device=target.device)
        costs = measure_costs(target, drafter)
        config = drafter.config
        rows.append({"drafter": folder, "layers": config.num_hidden_layers, "block": config.block_size,
                     "c_chunk": round(costs.draft_cost_chunk, 3), "c_full": round(costs.draft_cost_full, 3),
                     "step_ms": round(1000 * costs.step_seconds, 2), "settled": costs.settled,
                     "verify_costs": [round(v, 2) for v in costs.verify_costs]})
        print(json.dumps(rows[-1]), flush=True)
    table = ["| layers | block | c, 2 slots | c, full block | target step (ms) | verify of 1 / 7 / 15 drafts (steps) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        curve = row["verify_costs"]
        table.append(f"| {row['layers']} | {row['block']} | {row['c_chunk']:.3f} | {row['c_full']:.3f} | "
                     f"{row['step_ms']:.1f} | {curve[1]:.2f} / {curve[7]:.2f} / {curve[min(15, len(curve) - 1)]:.2f} |")
    text = "\n".join(table) + f"\n\nCPU: {cpu_info()}; {platform.machine()}, {args.threads} threads, {args.dtype}.\n"
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_info(), "dtype": args.dtype, "rows": rows}, indent=1))
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
