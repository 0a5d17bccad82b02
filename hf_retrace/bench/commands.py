"""The ``hf-retrace bench`` subcommand: argument parsing only; the work is in ``plan``, ``runner`` and ``report``."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ..divergence import NEAR_TIE_ULPS
from ..loading import add_device_arguments, dtype_arg
from .datasets import DATASETS
from .methods import ALL_METHODS, DEFAULT_METHODS, MAIN_DRAFTER, OWN_DRAFTER_NAMES
from .plan import BenchInputError, BenchSpec, plan_benchmark

EPILOG = """\
examples:
  hf-retrace bench --dataset gsm8k --limit 8 --max-new-tokens 128 --json out.json
  hf-retrace bench --dataset mtbench --dataset my_prompts.jsonl --methods plain,dflash,retrace \\
      --temperature 0 --temperature 1 --seeds 0,1 --drafter ./drafter --drafter no_gate=./drafter-no-gate
  hf-retrace bench --methods all --dtype fp32 --markdown out.md --plots plots/

methods: """ + ", ".join(ALL_METHODS) + """ ('all' = every one). plain always runs: it is the speed-up
baseline and the T=0 reference. Exit status: 0, or 1 on bad input (before any model loads); with
--fail-on-mismatch, 3 when a T=0 output differs from plain generate in a way classified as a bug.
"""


def _comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _seeds(text: str) -> list[int]:
    try:
        return [int(part) for part in _comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be comma-separated integers, got {text!r}") from None


def parse_drafters(values: list[str] | None) -> dict[str, str]:
    """``--drafter PATH`` (the main drafter) and ``--drafter NAME=PATH`` (a method's or an ablation's own drafter)."""
    drafters: dict[str, str] = {}
    for value in values or []:
        name, sep, path = value.partition("=")
        if sep and name in OWN_DRAFTER_NAMES | {MAIN_DRAFTER}:
            key = name
        elif sep and re.fullmatch(r"[A-Za-z0-9_-]+", name) and not Path(value).exists():
            raise BenchInputError(f"--drafter {value}: unknown drafter name {name!r}; use PATH for the main drafter "
                                  f"or NAME=PATH with NAME one of {', '.join(sorted(OWN_DRAFTER_NAMES))}")
        else:
            key, path = MAIN_DRAFTER, value
        if key in drafters:
            raise BenchInputError(f"--drafter {key} is given twice ({drafters[key]} and {path})")
        drafters[key] = path
    return drafters


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    methods = list(ALL_METHODS) if args.methods.strip() == "all" else _comma_list(args.methods)
    return BenchSpec(
        datasets=args.dataset or list(DATASETS),
        methods=methods,
        temperatures=args.temperature or [0.0],
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        seeds=args.seeds,
        target=args.target,
        drafters=parse_drafters(args.drafter),
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        device_map=args.device_map,
        compile=args.compile,
        warmup=not args.no_warmup,
        progress=not args.no_progress,
        repeats=args.repeats,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from .report import markdown_report, write_json, write_markdown, write_plots
    from .runner import run_benchmark

    try:
        spec = spec_from_args(args)
        plan = plan_benchmark(spec)  # every input check, before any model loads
        if args.batch_size < 1:
            raise BenchInputError(f"--batch-size {args.batch_size}: give a batch size of 1 or more")
        if args.batch_size > 1 and args.plots:
            raise BenchInputError("--plots draws per-request figures: drop it with --batch-size")
    except BenchInputError as exc:
        raise SystemExit(f"hf-retrace bench: error: {exc}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch_size > 1:  # batched generate against plain batched generate (issue 39)
        from .batched_throughput import batched_markdown, run_batched_benchmark

        report = run_batched_benchmark(spec, plan, args.batch_size, args.repeats)
        for path in [write_json(report, args.json)] if args.json else []:
            print(f"[hf-retrace bench] wrote {path}", file=sys.stderr)
        if args.markdown:
            Path(args.markdown).write_text(batched_markdown(report))
        print(batched_markdown(report))
        return 0
    report = run_benchmark(spec, plan)
    if args.json:
        print(f"[hf-retrace bench] wrote {write_json(report, args.json)}", file=sys.stderr)
    if args.markdown:
        print(f"[hf-retrace bench] wrote {write_markdown(report, args.markdown)}", file=sys.stderr)
    if args.plots:
        for path in write_plots(report, args.plots):
            print(f"[hf-retrace bench] wrote {path}", file=sys.stderr)
    print(markdown_report(report))
    bugs, kernel_partings = report["lossless"]["mismatch_bugs"], report["lossless"]["kernel_partings"]
    if kernel_partings:
        print(f"[hf-retrace bench] plain decoding with oneDNN off parted from plain generate beyond a near-tie "
              f"{kernel_partings} time(s), drafting nothing: this machine's kernels alone move bf16 greedy outputs that "
              "far", file=sys.stderr)
    if bugs:
        print(f"[hf-retrace bench] {bugs} T=0 output(s) of a drafting method differ from plain generate beyond a "
              f"near-tie ({NEAR_TIE_ULPS} bf16 ulps): a losslessness bug unless the same request is identical in "
              "float32 (examples/check_flagged.py in the repository re-checks one; the divergence table lists them)",
              file=sys.stderr)
    return 3 if bugs and args.fail_on_mismatch else 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` to the ``hf-retrace`` command line."""
    bench = subparsers.add_parser(
        "bench",
        help="benchmark plain, prompt lookup, DFlash and ReTrace side by side: tau, speed-up, losslessness",
        description="Run every method on the same prompts; report tau, per-position acceptance, decode speed-up "
        "over plain generate (prefill excluded), draft/verify costs and T=0 equality with plain generate.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--dataset", action="append", metavar="NAME_OR_JSONL",
                       help=f"shipped set ({', '.join(DATASETS)}) or a .jsonl file; repeatable (default: all shipped)")
    bench.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                       help=f"comma-separated methods or 'all' (default: {','.join(DEFAULT_METHODS)})")
    bench.add_argument("--temperature", action="append", type=float, metavar="T",
                       help="sampling temperature, repeatable (default: 0)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--limit", type=int, default=None, help="at most this many prompts per dataset")
    bench.add_argument("--seeds", type=_seeds, default=[0],
                       help="comma-separated seeds; T>0 runs every seed, T=0 the first only (default: 0)")
    bench.add_argument("--target", default=None, help="Hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    bench.add_argument("--drafter", action="append", metavar="[NAME=]PATH",
                       help="drafter folder (default: the shipped one); NAME=PATH gives a method its own drafter, "
                            "e.g. no_gate=./drafter-no-gate for retrace-no_gate; repeatable")
    bench.add_argument("--dtype", type=dtype_arg, choices=("bf16", "fp32"), default="bf16")
    bench.add_argument("--quantization", choices=("8bit", "4bit"), default=None, help="bitsandbytes target")
    add_device_arguments(bench, compile=True)
    bench.add_argument("--json", metavar="OUT.json", help="write the full report as JSON")
    bench.add_argument("--markdown", metavar="OUT.md", help="write the tables as Markdown")
    bench.add_argument("--plots", metavar="DIR", help="write tau.png and per_position_acceptance.png")
    bench.add_argument("--threads", type=int, default=None,
                       help="torch CPU threads (default: torch's choice; on a CPU shared with other jobs, 1 "
                            "avoids thread-pool contention that can slow decoding tenfold)")
    bench.add_argument("--batch-size", type=int, default=1, metavar="N",
                       help="run each dataset's first turns in left-padded batches of N: batched generate with each "
                            "drafting method against plain batched generate, throughput and tau (default: 1, the "
                            "per-request benchmark)")
    bench.add_argument("--repeats", type=int, default=1, metavar="R",
                       help="time each request (with --batch-size: each batch) R times per method, the methods' "
                            "order alternating, and keep each call's median time: on a 2-core CPU one batch of 8 "
                            "moved by up to 20 %%, and one run's cells by 3-6 %% against each other (default: 1)")
    bench.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--fail-on-mismatch", action="store_true",
                       help="exit with status 3 when a T=0 output differs from plain generate beyond a near-tie")
    bench.set_defaults(func=cmd_bench)
    return bench
