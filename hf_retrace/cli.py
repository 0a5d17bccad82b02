"""``hf-retrace``: generate | data | train | bench | demo."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

# load_target stays importable from here for scripts written against earlier versions
from .loading import (  # noqa: F401
    MAX_NEW_TOKENS, SHORT_DTYPES, ModelLoadError, add_device_arguments, drafter_arg, dtype_arg, load_drafter, load_pair,
    load_target, target_arg, torch_dtype,
)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .generation.checks import check_context
    from .side_by_side import chat_input_ids, compare

    torch.manual_seed(args.seed)
    target, tokenizer, drafter = load_pair(args.target, args.drafter, args.dtype, device=args.device,
                                           device_map=args.device_map, compile=args.compile)
    if args.no_retrace:
        drafter = drafter.with_policy(retrace=False)
    try:  # before the plain run too, which has no such check: a prompt past the context would run for minutes
        check_context(target, chat_input_ids(tokenizer, args.prompt).shape[1])
    except ValueError as error:
        raise SystemExit(f"hf-retrace generate: {error}") from None
    result = compare(target, tokenizer, drafter, args.prompt, args.max_new_tokens, args.temperature, args.seed)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        return 0
    stats = result.drafted.stats or {}
    print(result.drafted.text)
    print()
    print(f"plain generate  : {result.plain.tokens_per_second:6.1f} tokens/s ({len(result.plain.token_ids)} tokens)")
    print(f"with the drafter: {result.drafted.tokens_per_second:6.1f} tokens/s "
          f"(tau = {stats.get('mean_acceptance_length', 0):.2f} tokens per target forward)")
    print(f"ran: {result.ran}")
    print(f"speed-up {result.speedup:.2f}x")
    print("\n".join(result.outcome_lines(tokenizer)))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .export import ExportError, export_zlab

    drafter = load_drafter(args.drafter, "fp32")
    try:
        out = export_zlab(drafter, args.out, dtype=torch_dtype(args.dtype), overwrite=args.overwrite)
    except ExportError as e:
        raise SystemExit(f"hf-retrace export: {e}") from None
    left_out = " (its ReTrace module is not part of DFlash and was left out)" if drafter.retrace is not None else ""
    print(f"[hf-retrace] DFlash backbone written in the z-lab layout to {out}{left_out}", file=sys.stderr)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from .tuning.auto import cache_line, records_of, tune_and_cache
    from .tuning.report import print_tuning, print_verification
    from .tuning.verify import verify_tuning

    target, _, drafter = load_pair(args.target, args.drafter, args.dtype, device=args.device,
                                   device_map=args.device_map)
    result, path = tune_and_cache(target, drafter, rows=args.batch_size)
    print_tuning(result)
    print(f"[hf-retrace] {cache_line(result, path)}")
    if args.verify:
        records = records_of(drafter)
        if records is None:
            print("[hf-retrace] --verify: the drafter ships no recorded rounds, so there are no prompts to verify on")
        else:
            print_verification(verify_tuning(target, drafter, result, records))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-retrace", description="Lossless speculative decoding with ReTrace.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer a prompt with and without the drafter; print tau and both speeds")
    gen.add_argument("prompt")
    gen.add_argument("--target", type=target_arg, default=None,
                     help="Hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--drafter", type=drafter_arg, default=None,
                     help="Hub id or folder (default: the drafter shipped for it)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", type=dtype_arg, choices=SHORT_DTYPES, default="bf16")
    add_device_arguments(gen, compile=True)
    gen.add_argument("--no-retrace", action="store_true", help="use the DFlash backbone alone")
    gen.add_argument("--json", action="store_true", help="print the answer, tau and both speeds as JSON")
    gen.set_defaults(func=cmd_generate)

    tune = sub.add_parser("tune", help="measure this machine's round costs, replay the drafter's recorded rounds and "
                          "cache the round policy every later generate uses (done at first use otherwise)")
    tune.add_argument("--target", type=target_arg, default=None,
                      help="Hub id or folder (default: embedded SmolLM2-135M-Instruct)")
    tune.add_argument("--drafter", type=drafter_arg, default=None,
                      help="Hub id or folder (default: the drafter shipped for it)")
    tune.add_argument("--dtype", type=dtype_arg, choices=SHORT_DTYPES, default="bf16")
    add_device_arguments(tune)
    tune.add_argument("--json", default=None, help="also write the result (costs, tables, choices) to this file; "
                      "HF_RETRACE_POLICY=FILE uses it")
    tune.add_argument("--verify", action="store_true", help="then run a short real A/B (plain, the choice, the "
                      "runner-up) on the drafter's recorded prompts and print predicted against realized speed-ups")
    tune.add_argument("--batch-size", type=int, default=1, help="tune for batched generate calls of this many rows "
                      "(each batch size is tuned and cached apart; a batched call does it at first use otherwise)")
    tune.set_defaults(func=cmd_tune)

    exp = sub.add_parser("export", help="write a drafter's DFlash backbone in the z-lab layout (vLLM, SGLang, dflash)")
    exp.add_argument("--drafter", type=drafter_arg, default=None,
                     help="folder or Hub id (default: the drafter shipped here)")
    exp.add_argument("--out", required=True, help="an empty or new folder")
    exp.add_argument("--layout", choices=("zlab",), default="zlab", help="the layout written (z-lab's DFlash)")
    exp.add_argument("--dtype", type=dtype_arg, choices=SHORT_DTYPES, default="bf16",
                     help="dtype of the written weights")
    exp.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty --out")
    exp.set_defaults(func=cmd_export)

    from .bench.commands import register as register_bench
    from .training.cli.commands import register as register_training

    from .demo import register as register_demo

    register_training(sub)
    register_bench(sub)
    register_demo(sub)
    return parser


def _check_environment(args: argparse.Namespace) -> None:
    """The settings a command reads from the environment, checked before any model loads: the cache folder, and for
    generate ``HF_RETRACE_POLICY`` (a bad value would otherwise fail after the plain run)."""
    from .defaults import cache_root_problem
    from .tuning.auto import POLICY_ENV_VAR, env_policy

    problem = cache_root_problem()
    if problem is not None:
        raise SystemExit(f"hf-retrace {args.command}: {problem}.")
    if args.command == "generate" and os.environ.get(POLICY_ENV_VAR, "").strip() not in ("shipped", "off"):
        try:  # auto, or a file: read now (shipped and off need the drafter, and are always valid)
            env_policy(None, args.temperature > 0)
        except ValueError as error:
            raise SystemExit(f"hf-retrace generate: {error}") from None


def validate_generate_args(args: argparse.Namespace) -> None:
    if not args.prompt.strip():
        raise SystemExit("hf-retrace generate: the prompt is empty; pass some text to answer.")
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise SystemExit(f"hf-retrace generate: --max-new-tokens must be in 1..{MAX_NEW_TOKENS}, "
                         f"got {args.max_new_tokens}.")
    if args.temperature < 0:
        raise SystemExit(f"hf-retrace generate: --temperature must be >= 0, got {args.temperature}.")
    _check_environment(args)


def validate_tune_args(args: argparse.Namespace) -> None:
    from .training.cli.checks import check_writable

    if args.batch_size < 1:
        raise SystemExit(f"hf-retrace tune: error: --batch-size {args.batch_size}: give a batch size of 1 or more")
    if args.batch_size > 1 and args.verify:
        raise SystemExit("hf-retrace tune: error: --verify runs batch-1 calls on the recorded prompts; drop it with "
                         "--batch-size (hf-retrace bench --batch-size N measures a batch's realized speed-up)")
    if args.json:  # written after the tuning: a path it cannot write would cost the whole measurement
        check_writable(args.json, "--json", "the tuning result")
    _check_environment(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    validate = {"generate": validate_generate_args, "tune": validate_tune_args}.get(args.command)
    if validate is not None:
        validate(args)
    try:
        return int(args.func(args) or 0)
    except ModelLoadError as error:  # what the user named cannot load: one line, no traceback
        raise SystemExit(f"hf-retrace {args.command}: {error}") from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
