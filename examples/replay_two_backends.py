"""What a per-forward choice of matmul backend would buy, priced by the tuner's own replay, before it is built.

On a CPU whose bf16 matmuls go to oneDNN, a one-token forward can be far slower than with torch's own kernels while a
many-token verify is far faster (docs/bench/2026-12-06-epyc-onednn/). Given two ``hf-retrace tune --json`` files of
the same machine, one measured as torch runs by default and one with oneDNN off or capped (``ONEDNN_MAX_CPU_ISA=AVX2
hf-retrace tune --json off.json``, run with a separate ``HF_RETRACE_CACHE``: the machine key cannot tell them apart),
this replays the drafter's recorded rounds under each cost curve and under the cheaper of the two per forward (a
verify of k drafts, the drafter's round, the one-token step), each chosen as its tuner would, and prints each
temperature's choice and its predicted tokens per step-cost in units of the faster one-token step (plain decoding at
that step = 1; plain at the slower step reads below 1).

    python examples/replay_two_backends.py --on native.json --off capped.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def in_units(costs: dict[str, Any], unit: float) -> dict[str, Any]:
    """``costs`` (a tune file's ``costs``, in its own one-token steps) re-expressed in steps of ``unit`` seconds."""
    scale = costs["step_seconds"] / unit
    return {**costs, "verify_costs": [v * scale for v in costs["verify_costs"]], "step_seconds": unit,
            "draft_cost_chunk": costs["draft_cost_chunk"] * scale, "draft_cost_full": costs["draft_cost_full"] * scale}


def cheaper_per_forward(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """Both curves in units of the faster one-token step, and per entry the cheaper of the two."""
    unit = min(on["step_seconds"], off["step_seconds"])
    a, b = in_units(on, unit), in_units(off, unit)
    return {**b, "verify_costs": [min(x, y) for x, y in zip(a["verify_costs"], b["verify_costs"], strict=True)],
            "draft_cost_chunk": min(a["draft_cost_chunk"], b["draft_cost_chunk"]),
            "draft_cost_full": min(a["draft_cost_full"], b["draft_cost_full"])}


def main(argv: Sequence[str] | None = None) -> int:
    from hf_retrace.defaults import default_drafter_path
    from hf_retrace.generation.policy import shipped_policy
    from hf_retrace.loading import load_drafter
    from hf_retrace.tuning.costs import MachineCosts
    from hf_retrace.tuning.records import RoundRecords
    from hf_retrace.tuning.search import choose_policies

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--on", required=True, help="`hf-retrace tune --json` as torch runs by default")
    parser.add_argument("--off", required=True, help="`hf-retrace tune --json` with oneDNN off or capped")
    parser.add_argument("--drafter", default=None, help="the drafter whose recorded rounds to replay (default: shipped)")
    args = parser.parse_args(argv)
    try:
        on, off = (json.loads(Path(p).read_text(encoding="utf-8"))["costs"] for p in (args.on, args.off))
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"expected two `hf-retrace tune --json` files with their \"costs\": {e}") from e
    folder = args.drafter or default_drafter_path()
    records, base = RoundRecords.load(folder), shipped_policy(load_drafter(str(folder)).config)
    unit = min(on["step_seconds"], off["step_seconds"])
    mixed = cheaper_per_forward(on, off)
    print(f"one-token step: on {on['step_seconds'] * 1e3:.1f} ms, off {off['step_seconds'] * 1e3:.1f} ms; every figure "
          f"in steps of {unit * 1e3:.1f} ms (plain decoding at that step = 1)\n")
    print("| costs | plain decoding | verify of 1 / 3 / 8 / 32 drafts | drafter round | T=0 choice | predicted | "
          "T>0 choice | predicted |\n|---|---|---|---|---|---|---|---|")
    for name, costs in (("oneDNN on (torch's default)", on), ("oneDNN off or capped", off),
                        ("per forward the cheaper", mixed)):
        choice = choose_policies(records, MachineCosts.from_dict(costs), base)  # in the curve's own steps, as tuned
        scale = unit / costs["step_seconds"]  # its own step in steps of the faster one
        shown = in_units(costs, unit)
        verify = " / ".join(f"{shown['verify_costs'][k]:.2f}" for k in (1, 3, 8, 32))
        cells = []
        for temperature in ("greedy", "sampled"):
            policy = choice[temperature]
            cells += ([policy.describe().split(" (policy")[0], f"{policy.expected_speedup * scale:.2f}"]
                      if policy.speculate else ["plain decoding", f"{scale:.2f}"])
        print(f"| {name} | {scale:.2f} | {verify} | {shown['draft_cost_chunk']:.2f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
