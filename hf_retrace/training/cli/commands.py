"""``hf-retrace train``, ``hf-retrace data {generate,tokenize,features,topk}`` and ``hf-retrace calibrate``.

The flags live in ``arguments.py``, the checks in ``checks.py`` (every check that can fail on user input runs before
any model is loaded, so a typo costs seconds, not hours), the training run in ``train_command.py``.

Example::

    hf-retrace data generate --target default --prompts prompts.jsonl --out work_data/responses
    hf-retrace data tokenize --target default --responses work_data/responses --out work_data/tok
    hf-retrace train --target default --data work_data/tok --out runs/drafter --bf16 --max-steps 1000
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from ...configuration import build_target_layer_ids
from ...loading import AUTO_DTYPE, load_drafter, load_target, resolve_dtype, resolve_target, torch_dtype
from .arguments import (
    add_calibrate_arguments,
    add_features_arguments,
    add_generate_arguments,
    add_tokenize_arguments,
    add_topk_arguments,
    add_train_arguments,
    build_train_parser,
)
from ..calibrate import record_round_records
from .checks import check_calibration_args, check_prompt_file, parse_ids, require_tokenized, usage_error
from ..data import TokenizedDataset, generate_responses, read_prompts, records_token_ids, tokenize_responses
from ..data.recipes import PROMPT_RECIPES
from ..evaluation import sequence_prompt_ids
from ..precomputed_features import precompute_features, precompute_topk
from .train_command import cmd_train

__all__ = ["register", "cmd_train", "cmd_data", "build_train_parser"]


def register(subparsers: Any) -> None:
    """Add ``train``, ``data`` and ``calibrate`` to the ``hf-retrace`` parser's subcommands."""
    train = subparsers.add_parser("train", help="train a DFlash drafter for a target (CPU, GPU, accelerate launch)")
    add_train_arguments(train)
    train.set_defaults(func=_train_entry)

    data = subparsers.add_parser("data", help="make training data: target answers, tokenization, features")
    dsub = data.add_subparsers(dest="data_command", required=True)
    for name, help_text, add_arguments in (
        ("generate", "let the target answer prompts (resumable JSONL shards)", add_generate_arguments),
        ("tokenize", "responses -> input_ids + loss_mask shards (manifest.json)", add_tokenize_arguments),
        ("features", "precompute the target's tapped hidden states (resumable)", add_features_arguments),
        ("topk", "precompute the target's top-k next-token distributions (resumable; train --topk-dir)",
         add_topk_arguments),
    ):
        step = dsub.add_parser(name, help=help_text)
        add_arguments(step)
        step.set_defaults(func=cmd_data)
    for name, help_text, add_arguments, run in PROMPT_RECIPES:  # code-prompts, chat-prompts, mix
        step = dsub.add_parser(name, help=help_text)
        add_arguments(step)
        step.set_defaults(func=run)

    cal = subparsers.add_parser(
        "calibrate", help="record a drafter's rounds on held-out training prompts (what hf-retrace tune replays)"
    )
    add_calibrate_arguments(cal)
    cal.set_defaults(func=cmd_calibrate)


# ---------------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------------


def cmd_data(args: argparse.Namespace) -> int:
    commands = {"generate": _generate, "tokenize": _tokenize, "features": _precompute, "topk": _precompute_topk}
    if args.data_command not in commands:
        raise usage_error(f"unknown data command {args.data_command!r}")
    return commands[args.data_command](args)


def _data_dtype(args: argparse.Namespace) -> str:
    """The batched data commands' dtype, ``--dtype auto`` resolved for where the target runs (said on stderr)."""
    dtype = resolve_dtype(args.dtype, args.device, args.device_map)
    if args.dtype == AUTO_DTYPE:
        print(f"[hf-retrace] --dtype auto: {dtype}", file=sys.stderr)
    return dtype


def _generate(args: argparse.Namespace) -> int:
    for path in args.prompts:
        check_prompt_file(path, "--prompts")
    target, tokenizer = load_target(args.target, _data_dtype(args), frozen=True, device=args.device,
                                    device_map=args.device_map)
    prompts = []
    for path in args.prompts:
        prompts += read_prompts(path, limit=args.limit, suffix=args.suffix)
    summary = generate_responses(
        target, tokenizer, prompts, args.out, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
        do_sample=args.temperature > 0, temperature=args.temperature or 1.0, seed=args.seed,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    print(f"[hf-retrace] {summary.num_generated} answers ({summary.new_tokens} tokens, "
          f"{summary.tokens_per_second:.1f} tok/s), {summary.num_already_done} already done, "
          f"{summary.num_too_long} prompts too long; shards in {args.out}")
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    for flag, paths in (("--responses", args.responses), ("--exclude-ids", args.exclude_ids)):
        missing = [p for p in paths if not Path(p).exists()]
        if missing:
            raise usage_error(f"{flag}: not found: {missing}")
    try:
        excluded = {prompt.id for path in args.exclude_ids for prompt in read_prompts(path)}
    except ValueError as error:
        raise usage_error(f"--exclude-ids: {error}") from None
    tokenizer = AutoTokenizer.from_pretrained(resolve_target(args.target))
    try:  # --out holding other data (said before anything is written), or a record that is not a response
        manifest = tokenize_responses(tokenizer, args.responses, args.out, max_length=args.max_length,
                                      exclude_ids=excluded)
    except ValueError as error:
        raise usage_error(str(error)) from None
    parts = len(manifest.get("parts", [0]))
    print(f"[hf-retrace] {manifest['num_sequences']} sequences, {manifest['num_tokens']} tokens "
          f"({manifest['num_response_tokens']} response tokens; {manifest.get('num_excluded', 0)} excluded by id) in "
          f"{args.out}" + (f" ({parts} parts: it grew by new sources)" if parts > 1 else ""))
    return 0


def _precompute(args: argparse.Namespace) -> int:
    require_tokenized(args.data)
    target, _ = load_target(args.target, _data_dtype(args), frozen=True, device=args.device, device_map=args.device_map)
    layers = parse_ids(args.target_layer_ids) or build_target_layer_ids(
        target.config.get_text_config().num_hidden_layers, args.num_target_features)
    storage = torch_dtype(args.storage_dtype) if args.storage_dtype else None
    try:  # --out holding another store, other settings or features of other data: nothing was written
        manifest = precompute_features(target, TokenizedDataset(args.data), args.out, layers,
                                       max_batch_tokens=args.max_batch_tokens, limit=args.limit,
                                       storage_dtype=storage)
    except ValueError as exc:
        raise usage_error(str(exc)) from None
    print(f"[hf-retrace] features of {manifest['num_sequences']} sequences (layers {layers}) in {args.out}")
    return 0


def _precompute_topk(args: argparse.Namespace) -> int:
    require_tokenized(args.data)
    if args.k < 1 or args.max_batch_tokens < 1:
        raise usage_error(f"--k and --max-batch-tokens must be at least 1, got {args.k} and {args.max_batch_tokens}.")
    target, _ = load_target(args.target, _data_dtype(args), frozen=True, device=args.device, device_map=args.device_map)
    try:  # k beyond the vocabulary, or --out holding another store or other settings: nothing was written
        manifest = precompute_topk(target, TokenizedDataset(args.data), args.out, args.k,
                                   max_batch_tokens=args.max_batch_tokens, limit=args.limit)
    except ValueError as exc:
        raise usage_error(str(exc)) from None
    print(f"[hf-retrace] top-{args.k} distributions of {manifest['num_sequences']} sequences in {args.out}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# calibrate
# ---------------------------------------------------------------------------------------------------------------


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Record the drafter's rounds on held-out training prompts; print what this machine's tuner would choose."""
    from ...tuning.auto import tune
    from ...tuning.report import print_tuning

    sequences = check_calibration_args(args)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    target, tokenizer = load_target(args.target, args.dtype, frozen=True)
    prompts = _calibration_prompts(args, tokenizer, sequences)
    drafter = load_drafter(args.drafter, args.dtype)
    records = record_round_records(target, drafter, prompts, max_new_tokens=args.max_new_tokens)
    result = tune(target, drafter, records)
    print_tuning(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.write:
        path = records.save(args.drafter)
        print(f"[hf-retrace] wrote the recorded rounds ({path.stat().st_size / 1024:.0f} KB) to {path}; the drafter's "
              "round policy is tuned from them on each machine at first use (hf-retrace tune)")
    return 0


def _calibration_prompts(args: argparse.Namespace, tokenizer: Any, sequences: tuple[int, int] | None):
    if sequences is None:
        return records_token_ids(tokenizer, read_prompts(args.prompts, limit=args.limit))
    start, end = sequences
    dataset = TokenizedDataset(args.data)
    if not 0 <= start < end <= len(dataset):
        raise usage_error(f"--sequences {start}:{end} is outside the {len(dataset)} sequences of --data.")
    return sequence_prompt_ids(dataset, list(range(start, end))[: args.limit])


# ---------------------------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------------------------


def _train_entry(args: argparse.Namespace) -> int:
    if not hasattr(args, "_argv"):
        args._argv = sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "train" else sys.argv[1:]
    return cmd_train(args)


def main(argv: list[str] | None = None) -> int:
    """``python -m hf_retrace.training.cli.commands train ...`` (same as ``hf-retrace train ...``)."""
    parser = argparse.ArgumentParser(prog="hf-retrace")
    register(parser.add_subparsers(dest="command", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args._argv = argv[1:]
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
