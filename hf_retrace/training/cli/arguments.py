"""The flags of ``hf-retrace train``, ``hf-retrace data {generate,tokenize,features,topk}`` and
``hf-retrace calibrate``.

Parsing only: ``checks.py`` validates the values, ``commands.py`` wires the parsers to their commands.

Example::

    args = build_train_parser().parse_args(["--target", "default", "--data", "work_data/tok", "--out", "runs/d"])
"""

from __future__ import annotations

import argparse

from ...configuration import RETRACE_ABLATIONS
from ...loading import (
    AUTO_DTYPE, AUTO_DTYPE_HELP, AUTO_DTYPES, SHORT_DTYPES, add_device_arguments, drafter_arg, dtype_arg, target_arg,
)
from ..objective import DEFAULT_GAMMA
from ..precomputed_features import DEFAULT_MAX_BATCH_TOKENS

__all__ = ["add_calibrate_arguments", "add_features_arguments", "add_generate_arguments", "add_tokenize_arguments",
           "add_train_arguments", "build_train_parser"]


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    _add_run_arguments(p)
    _add_drafter_arguments(p)
    _add_objective_arguments(p)
    _add_optimisation_arguments(p)
    _add_evaluation_arguments(p)


def build_train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-retrace train")
    add_train_arguments(parser)
    return parser



def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """What to train, on what, where: target, data, output folder, stage, features."""
    p.add_argument("--target", type=target_arg, required=True,
                   help='Hub id, local folder, or "default" (SmolLM2-135M-Instruct)')
    p.add_argument("--data", required=True, help="tokenized folder (manifest.json) from `hf-retrace data tokenize`")
    p.add_argument("--out", required=True, help="output folder: drafter, README.md, logs, checkpoints/")
    p.add_argument("--stage", choices=("backbone", "retrace"), default="backbone",
                   help="backbone: the DFlash drafter; retrace: the fusion module (backbone frozen)")
    p.add_argument("--features-dir", default=None,
                   help="precomputed target features (computed there first if missing/incomplete; resumable); "
                        "default: a target forward inside each step")


def _add_drafter_arguments(p: argparse.ArgumentParser) -> None:
    """The drafter's shape and initialisation."""
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=3, help="drafter decoder layers")
    p.add_argument("--num-target-features", type=int, default=5, help="how many target layers to tap")
    p.add_argument("--target-layer-ids", default=None, help="explicit tapped layers, e.g. 1,8,14,20,27; with --init-from, "
                   "the drafter's own layers and more: the new ones start with zero input columns (its function "
                   "unchanged until trained)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="a spare row of the target's embeddings for MASK (default: a learned mask vector)")
    p.add_argument("--init-from", type=drafter_arg, default=None,
                   help="fine-tune an existing drafter (folder or Hub id)")
    p.add_argument("--copy-target-layers", nargs="?", const="last", default=None,
                   help="initialise drafter layers from target layers: 'last' (default) or a list like 20,25,29")


def _add_objective_arguments(p: argparse.ArgumentParser) -> None:
    """The training objective."""
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft only the N most frequent response tokens of --data (cheaper rounds; default: all); "
                        "with --init-from it re-selects the drafter's vocabulary for this data (default: kept)")
    p.add_argument("--verification", choices=("exact", "teacher-forced"), default="exact",
                   help="--stage retrace: the target's verdict from a real verify forward over the drafts (exact) "
                        "or from the teacher-forced outputs on the true sequence (cheaper, optimistic)")
    p.add_argument("--retrace-ablation", choices=RETRACE_ABLATIONS, default="full",
                   help="--stage retrace: train an ablated fusion module (no_correction: without the target's tokens, "
                        "probabilities and states; no_gate: ungated; tokens_only: without any hidden states)")
    p.add_argument("--joint", action="store_true",
                   help="--stage retrace: also fine-tune the backbone (use a small --lr); default: backbone frozen")
    p.add_argument("--distill-weight", type=float, default=0.0,
                   help="--stage backbone: weight in [0, 1] of the cross-entropy against the target's top-k "
                        "distribution (needs --topk-dir); the rest stays on the target's own token")
    p.add_argument("--topk-dir", default=None,
                   help="the target's top-k next-token distributions from `hf-retrace data topk` (same --data)")
    p.add_argument("--num-anchors", type=int, default=32)
    p.add_argument("--gamma", type=float, default=DEFAULT_GAMMA,
                   help="position decay exp(-(k-1)/gamma); <=0: uniform")


def _add_optimisation_arguments(p: argparse.ArgumentParser) -> None:
    """Optimiser, schedule, precision, data amount, seed."""
    p.add_argument("--batch-size", type=int, default=1, help="sequences per device per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.04)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="wall-clock minutes for this process's training loop: the learning-rate schedule is fit to "
                        "end within them (from the speed of the first steps), at the latest where --epochs or "
                        "--max-steps end it, and the loop stops at them regardless (a checkpoint is saved; --resume "
                        "goes on with the same schedule); the final evaluation and saving come after")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 master weights)")
    p.add_argument("--target-dtype", type=dtype_arg, choices=SHORT_DTYPES, default="bf16")
    p.add_argument("--save-dtype", type=dtype_arg, choices=SHORT_DTYPES, default="bf16")
    p.add_argument("--max-sequences", type=int, default=None, help="train on the first N sequences only")
    p.add_argument("--holdout", type=int, default=0,
                   help="keep the last N sequences out of training (their prompts evaluate tau without --eval-prompts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch CPU threads (1 is much faster than 2 on an oversubscribed CPU)")


def _add_evaluation_arguments(p: argparse.ArgumentParser) -> None:
    """Evaluation, checkpoints, output."""
    p.add_argument("--eval-prompts", default=None, help="held-out prompts JSONL for tau (real generate)")
    p.add_argument("--eval-every", type=int, default=0, help="steps between tau evaluations (0: only at the end)")
    p.add_argument("--eval-limit", type=int, default=None, help="prompts used by periodic evals (final: all)")
    p.add_argument("--eval-max-new-tokens", type=int, default=64)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out (if any)")
    p.add_argument("--overwrite", action="store_true", help="delete a non-empty --out first")
    p.add_argument("--push-to-hub", default=None, metavar="REPO", help="upload the trained drafter to this Hub repo")
    p.add_argument("--no-progress", action="store_true")


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """``hf-retrace data generate``: let the target answer prompts."""
    p.add_argument("--target", type=target_arg, required=True, help='Hub id, folder or "default"')
    p.add_argument("--prompts", required=True, nargs="+", help="prompt JSONL file(s)")
    p.add_argument("--out", required=True)
    p.add_argument("--suffix", default="", help="appended to every prompt")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each file")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", type=dtype_arg, choices=AUTO_DTYPES, default=AUTO_DTYPE, help=AUTO_DTYPE_HELP)
    add_device_arguments(p)


def add_tokenize_arguments(p: argparse.ArgumentParser) -> None:
    """``hf-retrace data tokenize``: responses into training sequences."""
    p.add_argument("--target", required=True, help="whose tokenizer/chat template (Hub id, folder, default)")
    p.add_argument("--responses", required=True, nargs="+",
                   help="response JSONL files or shard folders; an existing --out grows when these hold all of its "
                        "own sources, unchanged, and new ones (shard folders with more complete shards since)")
    p.add_argument("--out", required=True)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--exclude-ids", nargs="+", default=[], metavar="PROMPTS",
                   help="prompt files (JSONL) whose prompts, and their later turns, stay out of the sequences (e.g. "
                        "the prompts a drafter's rounds are recorded on)")


def add_features_arguments(p: argparse.ArgumentParser) -> None:
    """``hf-retrace data features``: precompute the target's tapped states."""
    p.add_argument("--target", type=target_arg, required=True)
    p.add_argument("--data", required=True, help="tokenized folder")
    p.add_argument("--out", required=True)
    p.add_argument("--num-target-features", type=int, default=5)
    p.add_argument("--target-layer-ids", default=None)
    p.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--dtype", type=dtype_arg, choices=AUTO_DTYPES, default=AUTO_DTYPE, help=AUTO_DTYPE_HELP)
    p.add_argument("--storage-dtype", type=dtype_arg, choices=SHORT_DTYPES, default=None,
                   help="dtype on disk (default: --dtype; bfloat16 halves the disk of a float32 forward)")
    add_device_arguments(p)


def add_topk_arguments(p: argparse.ArgumentParser) -> None:
    """``hf-retrace data topk``: precompute the target's top-k next-token distributions (for --distill-weight)."""
    p.add_argument("--target", type=target_arg, required=True)
    p.add_argument("--data", required=True, help="tokenized folder")
    p.add_argument("--out", required=True, help="a folder of its own (not the --features-dir)")
    p.add_argument("--k", type=int, default=16, help="tokens kept per position (ids + log-probabilities, 8 B each)")
    p.add_argument("--max-batch-tokens", type=int, default=4096,
                   help="padded tokens per forward (the logits take 4 B x vocabulary each)")
    p.add_argument("--limit", type=int, default=None, help="the first N sequences only")
    p.add_argument("--dtype", type=dtype_arg, choices=AUTO_DTYPES, default=AUTO_DTYPE, help=AUTO_DTYPE_HELP)
    add_device_arguments(p)


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    """``hf-retrace calibrate``: record the drafter's rounds (``round_records.json.gz``) for the round-policy tuner."""
    p.add_argument("--target", type=target_arg, required=True, help='Hub id, folder or "default"')
    p.add_argument("--drafter", type=drafter_arg, required=True,
                   help="drafter folder (round_records.json.gz is written into it with --write)")
    p.add_argument("--data", default=None, help="tokenized folder; prompts are the sequences in --sequences")
    p.add_argument("--sequences", default=None, metavar="A:B",
                   help="indices of --data sequences never trained on (e.g. 4900:4932)")
    p.add_argument("--prompts", default=None, help="or: a prompt JSONL file (training prompts, never benchmark ones)")
    p.add_argument("--limit", type=int, default=24, help="prompts used")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", type=dtype_arg, choices=SHORT_DTYPES, default="bf16")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write this machine's tuning result (costs, tables, choices) here")
    p.add_argument("--write", action="store_true",
                   help="store the recorded rounds in the drafter's folder (round_records.json.gz)")
