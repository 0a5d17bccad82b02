"""``hf-retrace train`` and ``hf-retrace data {generate,tokenize,features}``.

Every check that can fail on user input (paths, folders, prompt files, flag combinations) runs before any model is
loaded, so a typo costs seconds, not hours.

Example::

    hf-retrace data generate --target default --prompts prompts.jsonl --out work_data/responses
    hf-retrace data tokenize --target default --responses work_data/responses --out work_data/tok
    hf-retrace train --target default --data work_data/tok --out runs/drafter --bf16 --max-steps 1000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from ..loading import SHORT_DTYPES, dtype_arg, load_drafter, load_target, portable_path, resolve_target, torch_dtype
from .features import DEFAULT_MAX_BATCH_TOKENS
from .objective import DEFAULT_GAMMA

__all__ = ["register", "cmd_train", "cmd_data", "build_train_parser"]



def _fail(message: str) -> SystemExit:
    return SystemExit(f"hf-retrace: error: {message}")


def _parse_ids(text: str | None) -> list[int] | None:
    if text is None or text == "":
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise _fail(f"expected a comma-separated list of integers, got {text!r}") from None


HELD_OUT_ENV_VAR = "HF_RETRACE_HELD_OUT_DIRS"  # os.pathsep-separated folders of benchmark prompts


def _held_out_folder(path: Path) -> Path | None:
    """The folder of ``$HF_RETRACE_HELD_OUT_DIRS`` that holds ``path`` (benchmark data: never train or tune on it)."""
    resolved = path.resolve()
    for folder in filter(None, os.environ.get(HELD_OUT_ENV_VAR, "").split(os.pathsep)):
        folder_path = Path(folder).resolve()
        if resolved == folder_path or folder_path in resolved.parents:
            return folder_path
    return None


def _refuse_held_out(path: Path, flag: str) -> None:
    folder = _held_out_folder(path)
    if folder is not None:
        raise _fail(f"{flag} {path} lies in {folder}, a benchmark folder listed in ${HELD_OUT_ENV_VAR}: "
                    "train and calibrate on training data only.")


def _is_main_launch_process() -> bool:
    """True outside ``accelerate launch``/torchrun, and in its rank-0 process (before any Accelerator exists)."""
    return int(os.environ.get("RANK", "0")) == 0


def _folder_is_empty(path: Path) -> bool:
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


RUN_MARKERS = ("drafter_init.json", "train_log.jsonl", "run_settings.json", "checkpoints")  # a run's own files
RUN_SETTINGS = "run_settings.json"
# the drafter fields that make a checkpoint's weights fit (or not)
_SHAPE_FIELDS = ("block_size", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "target_layer_ids", "draft_vocab_size", "learned_mask_embedding",
                 "mask_token_id", "retrace")


def run_settings(args: argparse.Namespace, drafter_config: Any, num_processes: int) -> dict[str, Any]:
    """What defines a run as one experiment: a ``--resume`` with any of these changed would be another one."""
    return {
        "stage": args.stage, "target": args.target, "data": str(Path(args.data).resolve()),
        "max_sequences": args.max_sequences, "holdout": args.holdout, "seed": args.seed,
        "init_from": args.init_from, "joint": args.joint, "verification": args.verification,
        "retrace_ablation": args.retrace_ablation, "num_anchors": args.num_anchors, "gamma": args.gamma,
        "global_batch": args.batch_size * num_processes * args.grad_accum, "grad_accum": args.grad_accum,
        "lr": args.lr, "weight_decay": args.weight_decay, "warmup_ratio": args.warmup_ratio,
        "max_grad_norm": args.max_grad_norm, "epochs": args.epochs, "max_steps": args.max_steps,
        "bf16": args.bf16, "target_dtype": args.target_dtype,
        "drafter": {name: getattr(drafter_config, name, None) for name in _SHAPE_FIELDS},
    }


def check_resume_settings(out: Path, settings: dict[str, Any]) -> None:
    """Refuse a ``--resume`` whose settings differ from the run's in ``out``, listing every difference."""
    path = out / RUN_SETTINGS
    if not path.is_file():
        return
    saved = json.loads(path.read_text())
    changed = [f"{key}: {saved.get(key)!r} in the run, {value!r} now" for key, value in settings.items()
               if saved.get(key) != value]
    if changed:
        raise _fail(f"--resume continues the run in {out}, but these settings differ from it: " + "; ".join(changed)
                    + ". Pass the run's own settings to continue it, or start a new --out (to train its drafter "
                    f"further under new settings: --init-from {out}/export after `export_checkpoint`, or from its "
                    "saved drafter).")


# ---------------------------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------------------------


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help='Hub id, local folder, or "default" (SmolLM2-135M-Instruct)')
    p.add_argument("--data", required=True, help="tokenized folder (manifest.json) from `hf-retrace data tokenize`")
    p.add_argument("--out", required=True, help="output folder: drafter, README.md, logs, checkpoints/")
    p.add_argument("--stage", choices=("backbone", "retrace"), default="backbone",
                   help="backbone: the DFlash drafter; retrace: the fusion module (backbone frozen)")
    feats = p.add_mutually_exclusive_group()
    feats.add_argument("--features-dir", default=None,
                       help="precomputed target features (computed there first if missing/incomplete; resumable)")
    feats.add_argument("--online", action="store_true", help="target forward inside each step (the default)")
    # drafter shape / initialisation
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=3, help="drafter decoder layers")
    p.add_argument("--num-target-features", type=int, default=5, help="how many target layers to tap")
    p.add_argument("--target-layer-ids", default=None, help="explicit tapped layers, e.g. 1,8,14,20,27")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="a spare row of the target's embeddings for MASK (default: a learned mask vector)")
    p.add_argument("--init-from", default=None, help="fine-tune an existing drafter (folder or Hub id)")
    p.add_argument("--copy-target-layers", nargs="?", const="last", default=None,
                   help="initialise drafter layers from target layers: 'last' (default) or a list like 20,25,29")
    # objective
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft only the N most frequent response tokens of --data (cheaper rounds; default: all)")
    p.add_argument("--verification", choices=("exact", "teacher-forced"), default="exact",
                   help="--stage retrace: the target's verdict from a real verify forward over the drafts (exact) "
                        "or from the teacher-forced outputs on the true sequence (cheaper, optimistic)")
    p.add_argument("--retrace-ablation", choices=("full", "no_correction", "no_gate", "tokens_only"), default="full",
                   help="--stage retrace: train an ablated fusion module (retrace.md section 8)")
    p.add_argument("--joint", action="store_true",
                   help="--stage retrace: also fine-tune the backbone (use a small --lr); default: backbone frozen")
    p.add_argument("--num-anchors", type=int, default=32)
    p.add_argument("--gamma", type=float, default=DEFAULT_GAMMA,
                   help="position decay exp(-(k-1)/gamma); <=0: uniform")
    # optimisation
    p.add_argument("--batch-size", type=int, default=1, help="sequences per device per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.04)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
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
    # evaluation, checkpoints, output
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


def build_train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-retrace train")
    add_train_arguments(parser)
    return parser


def validate_train_args(args: argparse.Namespace) -> dict[str, Any]:
    """All cheap checks; returns facts found on the way (the data manifest). Raises SystemExit with a message."""
    if args.stage == "retrace":
        if not args.init_from:
            raise _fail("--stage retrace trains the ReTrace module on a trained DFlash backbone: pass --init-from "
                        "DRAFTER (e.g. the output folder of a --stage backbone run, or a published DFlash drafter).")
        if args.features_dir:
            raise _fail("--stage retrace runs the target online (its cache verifies the drafts); drop --features-dir.")
    if args.draft_vocab_size is not None and args.draft_vocab_size < 2:
        raise _fail("--draft-vocab-size must be at least 2 (or leave it out for the full vocabulary).")
    data = Path(args.data)
    manifest_path = data / "manifest.json"
    if not manifest_path.is_file():
        raise _fail(f"--data {data}: no manifest.json; make it with `hf-retrace data tokenize ... --out {data}`.")
    manifest = json.loads(manifest_path.read_text())
    if not manifest.get("complete"):
        raise _fail(f"--data {data} is only partly tokenized; run `hf-retrace data tokenize` again to finish it.")
    _refuse_held_out(data, "--data")
    positive = {"--block-size": args.block_size - 1, "--num-layers": args.num_layers, "--num-anchors": args.num_anchors,
                "--batch-size": args.batch_size, "--grad-accum": args.grad_accum,
                "--keep-checkpoints": args.keep_checkpoints, "--eval-max-new-tokens": args.eval_max_new_tokens}
    for flag, value in positive.items():
        if value < 1:
            raise _fail(f"{flag} must be at least {2 if flag == '--block-size' else 1}.")
    if args.lr <= 0 or not 0 <= args.warmup_ratio < 1 or args.epochs <= 0:
        raise _fail("--lr must be > 0, --warmup-ratio in [0, 1), --epochs > 0.")
    if args.max_steps is not None and args.max_steps < 1:
        raise _fail("--max-steps must be at least 1.")
    if args.init_from and (args.copy_target_layers or args.mask_token_id is not None or args.target_layer_ids):
        raise _fail("--init-from takes the drafter's shape from its checkpoint; drop --copy-target-layers, "
                    "--mask-token-id and --target-layer-ids.")
    if args.init_from and not Path(args.init_from).exists() and "/" not in args.init_from:
        raise _fail(f"--init-from {args.init_from}: not a folder nor a Hub id (owner/name).")
    _parse_ids(args.target_layer_ids)
    if args.copy_target_layers not in (None, "last"):
        _parse_ids(args.copy_target_layers)
    if args.eval_prompts:
        from .data import validate_prompt_file

        try:
            validate_prompt_file(args.eval_prompts)
        except (FileNotFoundError, ValueError) as error:
            raise _fail(f"--eval-prompts: {error}") from None
        if _held_out_folder(Path(args.eval_prompts)):
            print("[hf-retrace] note: evaluating tau on held-out benchmark prompts (fine for eval, never for training).",
                  file=sys.stderr)
    if args.features_dir:
        fm = Path(args.features_dir) / "features.json"
        if fm.is_file():
            existing = json.loads(fm.read_text())
            if existing.get("dataset", {}).get("num_tokens") != manifest.get("num_tokens"):
                raise _fail(f"--features-dir {args.features_dir} was computed for another dataset "
                            f"({existing.get('dataset')}); use a new folder.")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise _fail(f"--out {out} is a file.")
    has_checkpoint = (out / "checkpoints").is_dir()
    # under `accelerate launch` only the main process checks, empties and writes --out (the others would see its files)
    if not _is_main_launch_process():
        return {"manifest": manifest, "has_checkpoint": has_checkpoint}
    if not _folder_is_empty(out) and not (args.resume or args.overwrite):
        raise _fail(f"--out {out} is not empty. Pass --resume to continue a run there, --overwrite to start over, "
                    "or choose a new folder.")
    if args.resume and args.overwrite:
        raise _fail("--resume and --overwrite exclude each other.")
    if args.overwrite and not _folder_is_empty(out) and not any((out / name).exists() for name in RUN_MARKERS):
        sample = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise _fail(f"--overwrite deletes a previous run's output only, but {out} holds other files ({sample}); "
                    "nothing was deleted. Choose a new --out, or empty that folder yourself.")
    if args.target != "default" and not Path(args.target).exists() and "/" not in args.target:
        raise _fail(f"--target {args.target}: not a folder, a Hub id (owner/name) nor 'default'.")
    return {"manifest": manifest, "has_checkpoint": has_checkpoint}


def _eval_prompt_ids(args, tokenizer, dataset, holdout_indices) -> list[list[int]]:
    from .data import prompt_token_ids, read_prompts

    if args.eval_prompts:
        prompts = [p.prompt for p in read_prompts(args.eval_prompts)]
        return prompt_token_ids(tokenizer, prompts)
    ids = []
    for index in holdout_indices:
        item = dataset[index]
        mask = item["loss_mask"]
        first = int(mask.nonzero()[0]) if mask.any() else len(mask)
        ids.append(item["input_ids"][:first].tolist())
    return ids


def _build_drafter(args, target, dtype):
    import torch

    from ..modeling import ReTraceDrafter
    from .trainer import (
        check_drafter_matches_target,
        copy_target_layers,
        drafter_config_from_target,
        init_from_target_statistics,
    )

    if args.init_from:
        drafter = ReTraceDrafter.from_pretrained(args.init_from, dtype=torch.float32)
        init = f"fine-tuned from {args.init_from}"
    else:
        config = drafter_config_from_target(
            target.config, num_hidden_layers=args.num_layers, block_size=args.block_size,
            num_target_features=args.num_target_features, target_layer_ids=_parse_ids(args.target_layer_ids),
            mask_token_id=args.mask_token_id, retrace=False,
        )
        torch.manual_seed(args.seed)
        drafter = ReTraceDrafter(config).to(torch.float32)
        init_from_target_statistics(drafter, target)
        init = "from scratch (mask vector at the scale of the target's embeddings)"
        if args.copy_target_layers:
            source = None if args.copy_target_layers == "last" else _parse_ids(args.copy_target_layers)
            mapping = copy_target_layers(drafter, target, source)
            init += f", layers copied from target layers {list(mapping.values())}"
    if args.draft_vocab_size and not args.init_from:
        drafter.set_draft_vocab(frequent_response_tokens(args.data, args.draft_vocab_size, target.config))
        init += f", draft vocabulary: the {args.draft_vocab_size} most frequent response tokens"
    if args.stage == "retrace":
        drafter.add_retrace()
        drafter.config.retrace_ablation = args.retrace_ablation
    name = getattr(target.config, "_name_or_path", "the target")
    check_drafter_matches_target(drafter.config, target.config, name)
    if args.block_size != drafter.config.block_size and args.init_from:
        print(f"[hf-retrace] note: --init-from drafter has block size {drafter.config.block_size}; using it.",
              file=sys.stderr)
    return drafter, init


def frequent_response_tokens(data_dir: str, size: int, target_config: Any):
    """The ``size`` most frequent response tokens of the tokenized data, end-of-sequence ids always included."""
    import numpy as np
    import torch

    from .data import TokenizedDataset

    vocab = target_config.get_text_config().vocab_size
    counts = np.zeros(vocab, dtype=np.int64)
    for item in TokenizedDataset(data_dir):
        counts += np.bincount(item["input_ids"][item["loss_mask"]].numpy(), minlength=vocab)[:vocab]
    eos = target_config.eos_token_id
    for token in [eos] if isinstance(eos, int) else list(eos or []):
        counts[token] = counts.max() + 1
    return torch.from_numpy(np.argsort(-counts, kind="stable")[:size].copy())


def cmd_train(args: argparse.Namespace) -> int:
    started = time.time()
    facts = validate_train_args(args)
    out = Path(args.out)
    if args.overwrite and out.exists() and _is_main_launch_process():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    import hf_retrace  # noqa: F401  (generate hook for tau evaluation)

    from .data import TokenizedDataset
    from .features import (
        FeatureDataset,
        OnlineFeatures,
        PrecomputedFeatures,
        covered_sequences,
        features_manifest,
        precompute_features,
    )
    from .objective import DFlashObjective
    from .trainer import (
        ADAMW_BETAS,
        SUMMARY_FILE,
        TauEvaluator,
        Trainer,
        TrainingArguments,
        backbone_parameters,
        retrace_parameters,
        write_model_card,
    )

    target_path = resolve_target(args.target)
    target, tokenizer = load_target(target_path, args.target_dtype, frozen=True)
    sequences = TokenizedDataset(args.data)
    vocab = target.config.get_text_config().vocab_size
    if facts["manifest"].get("vocab_size", vocab) > vocab:
        raise _fail(f"--data was tokenized with a {facts['manifest']['vocab_size']}-token vocabulary but the target "
                    f"has {vocab}: tokenize with the target's tokenizer.")
    drafter, init = _build_drafter(args, target, torch.float32)
    settings = run_settings(args, drafter.config, int(os.environ.get("WORLD_SIZE", "1")))
    if args.resume:
        check_resume_settings(out, settings)
    if _is_main_launch_process():
        (out / RUN_SETTINGS).write_text(json.dumps(settings, indent=2))
        (out / "drafter_init.json").write_text(json.dumps(
            {"init": init, "config": json.loads(drafter.config.to_json_string())}, indent=2))

    num = len(sequences) if args.max_sequences is None else min(args.max_sequences, len(sequences))
    if args.holdout >= num:
        raise _fail(f"--holdout {args.holdout} leaves no training sequences (the data has {num}).")
    train_indices = list(range(num - args.holdout))
    holdout_indices = list(range(num - args.holdout, num))

    features = None
    feature_fn = None
    if args.stage == "retrace":
        mode = f"online, in the objective (verification: {args.verification})"
    elif args.features_dir:
        layer_ids = drafter.config.target_layer_ids
        fm = features_manifest(args.features_dir)
        if fm is not None and fm.get("target_layer_ids") != layer_ids:
            raise _fail(f"--features-dir holds target layers {fm.get('target_layer_ids')} but the drafter reads "
                        f"{layer_ids}; use a new folder.")
        partial_ok = fm is not None and covered_sequences(fm) >= num
        if fm is None or not (fm.get("complete") or partial_ok):
            precompute_features(target, sequences, args.features_dir, layer_ids, progress=not args.no_progress)
        features = PrecomputedFeatures(args.features_dir, allow_partial=partial_ok)
        mode = f"precomputed ({args.features_dir}, {len(features)} sequences covered)"
    else:
        feature_fn = OnlineFeatures(target, drafter.config.target_layer_ids)
        mode = "online"
    dataset = FeatureDataset(sequences, features, indices=train_indices)

    eval_fn = None
    prompt_ids = []
    if args.eval_prompts or holdout_indices:
        prompt_ids = _eval_prompt_ids(args, tokenizer, sequences, holdout_indices)
        eval_fn = TauEvaluator(target, prompt_ids, max_new_tokens=args.eval_max_new_tokens, limit=args.eval_limit)

    if args.stage == "retrace":
        from .retrace_stage import ReTraceObjective

        objective = ReTraceObjective(drafter, target, num_anchors=args.num_anchors, gamma=args.gamma,
                                     verification=args.verification)
        param_filter = (lambda name: True) if args.joint else retrace_parameters
    else:
        objective = DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings(),
                                    num_anchors=args.num_anchors, gamma=args.gamma)
        param_filter = backbone_parameters
    targs = TrainingArguments(
        out_dir=str(out), batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
        weight_decay=args.weight_decay, warmup_ratio=args.warmup_ratio, max_grad_norm=args.max_grad_norm,
        epochs=args.epochs, max_steps=args.max_steps, mixed_precision="bf16" if args.bf16 else "no",
        save_every=args.save_every, keep_checkpoints=args.keep_checkpoints, eval_every=args.eval_every,
        seed=args.seed, num_workers=args.num_workers, progress=not args.no_progress,
        save_dtype=args.save_dtype, resume=args.resume,
    )
    trainer = Trainer(objective, dataset, targs, feature_fn=feature_fn, param_filter=param_filter,
                      eval_fn=eval_fn)
    # the target runs on the same device as the drafter
    target.to(trainer.accelerator.device)
    acc = trainer.accelerator
    acc.print(f"[hf-retrace] target {target_path} ({args.target_dtype}); drafter {init}: "
              f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f} M params, {drafter.config.num_hidden_layers} "
              f"layers, block {drafter.config.block_size}, target layers {drafter.config.target_layer_ids}, "
              f"mask: {'learned vector' if drafter.config.learned_mask_embedding else drafter.config.mask_token_id}")
    acc.print(f"[hf-retrace] {len(dataset)} training sequences, features {mode}, {trainer.total_steps} steps "
              f"({args.batch_size} x {args.grad_accum} x {acc.num_processes} sequences each), warmup "
              f"{trainer.warmup_steps}; {len(prompt_ids)} eval prompts")
    summary = trainer.train()
    final_eval = {}
    if eval_fn is not None:
        acc.print(f"[hf-retrace] final tau evaluation on {len(prompt_ids)} prompts ...")
        final_eval = trainer.evaluate(limit=None)
        if final_eval:
            trainer._log({"step": summary["steps"], "final": True, **final_eval})
            acc.print(f"[hf-retrace] tau = {final_eval['tau']:.3f}")
    trainer.save_drafter(out, args.save_dtype)
    if acc.is_main_process:
        hours = summary["seconds"] / 3600
        info = {
            "target": _hub_id(target_path) or Path(target_path).name,  # no machine paths in a shipped card
            "target_hub_id": _hub_id(target_path),
            "data": f"{Path(args.data).name} ({facts['manifest'].get('num_sequences')} sequences, "
                    f"{facts['manifest'].get('num_response_tokens')} response tokens; sources: "
                    + ", ".join(Path(s['path']).name for s in facts["manifest"].get("sources", [])) + ")",
            "num_sequences": len(dataset),
            "tokens": summary["tokens"], "labels": summary["labels"], "steps": summary["steps"],
            "time": f"{summary['seconds'] / 60:.1f} min of training ({hours:.2f} h)",
            "hardware": f"{acc.num_processes} x {acc.device.type} ({platform.processor() or platform.machine()}, "
                        f"{os.cpu_count()} cores)" if acc.device.type == "cpu" else f"{acc.num_processes} x {acc.device}",
            "stage": portable_path(f"{args.stage}; drafter {init}; features {mode}"),
            "hyperparameters": (f"block {drafter.config.block_size}, {drafter.config.num_hidden_layers} layers, "
                                f"target layers {drafter.config.target_layer_ids}, {args.num_anchors} anchors, "
                                f"gamma {args.gamma}, lr {args.lr}, warmup {args.warmup_ratio}, cosine, "
                                f"batch {args.batch_size}x{args.grad_accum}x{acc.num_processes}, "
                                f"{'bf16' if args.bf16 else 'fp32'}, AdamW{ADAMW_BETAS}, wd {args.weight_decay}, clip "
                                f"{args.max_grad_norm}"),
            "command": portable_path("hf-retrace train " + " ".join(shlex.quote(a) for a in getattr(args, "_argv", []))),
            "tau": final_eval.get("tau"),
            "eval_prompts": final_eval.get("eval_prompts"),
            "eval_max_new_tokens": args.eval_max_new_tokens,
        }
        write_model_card(out, info)
        (out / SUMMARY_FILE).write_text(json.dumps(
            {**summary, "final_eval": final_eval, "wall_seconds_this_process": time.time() - started,
             "info": info}, indent=2, default=str))
        acc.print(f"[hf-retrace] drafter saved to {out}")
        if args.push_to_hub:
            from ..modeling import ReTraceDrafter

            ReTraceDrafter.from_pretrained(out).push_to_hub(args.push_to_hub)
            from huggingface_hub import upload_file

            upload_file(path_or_fileobj=str(out / "README.md"), path_in_repo="README.md", repo_id=args.push_to_hub)
            acc.print(f"[hf-retrace] pushed to https://huggingface.co/{args.push_to_hub}")
    return 0


def _hub_id(path: str) -> str | None:
    info = Path(path) / "hf_retrace_source.json"
    if info.is_file():
        try:
            return json.loads(info.read_text()).get("equivalent_hub_id")
        except ValueError:
            return None
    return None if Path(path).exists() else path


# ---------------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------------


def cmd_data(args: argparse.Namespace) -> int:
    from . import data as data_mod

    if args.data_command == "generate":
        for path in args.prompts:
            try:
                data_mod.validate_prompt_file(path)
            except (FileNotFoundError, ValueError) as error:
                raise _fail(f"--prompts: {error}") from None
        target, tokenizer = load_target(args.target, args.dtype, frozen=True)
        prompts = []
        for path in args.prompts:
            prompts += data_mod.read_prompts(path, limit=args.limit, suffix=args.suffix)
        summary = data_mod.generate_responses(
            target, tokenizer, prompts, args.out, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
            do_sample=args.temperature > 0, temperature=args.temperature or 1.0, seed=args.seed,
            max_prompt_tokens=args.max_prompt_tokens,
        )
        print(f"[hf-retrace] {summary.num_generated} answers ({summary.new_tokens} tokens, "
              f"{summary.tokens_per_second:.1f} tok/s), {summary.num_already_done} already done, "
              f"{summary.num_too_long} prompts too long; shards in {args.out}")
        return 0
    if args.data_command == "tokenize":
        from transformers import AutoTokenizer

        missing = [p for p in args.responses if not Path(p).exists()]
        if missing:
            raise _fail(f"--responses: not found: {missing}")
        tokenizer = AutoTokenizer.from_pretrained(resolve_target(args.target))
        manifest = data_mod.tokenize_responses(tokenizer, args.responses, args.out, max_length=args.max_length)
        print(f"[hf-retrace] {manifest['num_sequences']} sequences, {manifest['num_tokens']} tokens "
              f"({manifest['num_response_tokens']} response tokens) in {args.out}")
        return 0
    if args.data_command == "features":
        from ..configuration import build_target_layer_ids
        from .features import precompute_features

        if not (Path(args.data) / "manifest.json").is_file():
            raise _fail(f"--data {args.data}: no manifest.json (run `hf-retrace data tokenize` first).")
        target, _ = load_target(args.target, args.dtype, frozen=True)
        layers = _parse_ids(args.target_layer_ids) or build_target_layer_ids(
            target.config.get_text_config().num_hidden_layers, args.num_target_features)
        import torch

        storage = torch_dtype(args.storage_dtype) if args.storage_dtype else None
        manifest = precompute_features(target, data_mod.TokenizedDataset(args.data), args.out, layers,
                                       max_batch_tokens=args.max_batch_tokens, limit=args.limit,
                                       storage_dtype=storage)
        print(f"[hf-retrace] features of {manifest['num_sequences']} sequences (layers {layers}) in {args.out}")
        return 0
    raise _fail(f"unknown data command {args.data_command!r}")


def _check_calibration_args(args: argparse.Namespace) -> tuple[int, int] | None:
    """All checks of ``hf-retrace calibrate`` that need no model; returns the ``--sequences`` range (or None)."""
    from .data import validate_prompt_file

    if not (Path(args.drafter) / "config.json").is_file():
        raise _fail(f"--drafter {args.drafter}: not a drafter folder (no config.json).")
    if bool(args.prompts) == bool(args.data):
        raise _fail("calibrate needs prompts: --data DIR --sequences A:B (never trained on), or --prompts FILE.")
    if args.prompts:
        try:
            validate_prompt_file(args.prompts)
        except (FileNotFoundError, ValueError) as error:
            raise _fail(f"--prompts: {error}") from None
        _refuse_held_out(Path(args.prompts), "--prompts")
        return None
    if not (Path(args.data) / "manifest.json").is_file():
        raise _fail(f"--data {args.data}: no manifest.json (run `hf-retrace data tokenize` first).")
    _refuse_held_out(Path(args.data), "--data")
    try:
        start, end = (int(x) for x in (args.sequences or "").split(":"))
    except ValueError:
        raise _fail(f"--sequences must be A:B (sequence indices never trained on), got {args.sequences!r}.") from None
    return start, end


def _calibration_prompts(args: argparse.Namespace, tokenizer: Any, sequences: tuple[int, int] | None):
    from .data import TokenizedDataset, prompt_token_ids, read_prompts

    if sequences is None:
        return prompt_token_ids(tokenizer, [p.prompt for p in read_prompts(args.prompts, limit=args.limit)])
    start, end = sequences
    dataset = TokenizedDataset(args.data)
    if not 0 <= start < end <= len(dataset):
        raise _fail(f"--sequences {start}:{end} is outside the {len(dataset)} sequences of --data.")
    return _eval_prompt_ids(argparse.Namespace(eval_prompts=None), None, dataset,
                            list(range(start, end))[: args.limit])


def cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from .calibrate import calibrate_confidence_threshold

    sequences = _check_calibration_args(args)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    target, tokenizer = load_target(args.target, args.dtype, frozen=True)
    prompts = _calibration_prompts(args, tokenizer, sequences)
    drafter = load_drafter(args.drafter, args.dtype)
    result = calibrate_confidence_threshold(target, drafter, prompts, max_new_tokens=args.max_new_tokens)
    print(f"[hf-retrace] c = {result['draft_cost_c']:.3f}; verify cost of k drafts (x one step): "
          + ", ".join(f"{k}:{v:.2f}" for k, v in enumerate(result["verify_costs"])))
    print("| threshold | tau | drafted/round | tokens per step-cost |\n|---|---|---|---|")
    for row in result["table"]:
        print(f"| {row['threshold']:.2f} | {row['tau']:.2f} | {row['mean_drafted']:.2f} | {row['tokens_per_cost']:.3f} |")
    best, full = result["best"], result["full_block"]
    print(f"[hf-retrace] best threshold {best['threshold']:.2f}: {best['tokens_per_cost']:.3f} tokens per step-cost "
          f"vs {full['tokens_per_cost']:.3f} with full blocks ({result['rounds']} rounds, {result['prompts']} prompts)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.write:
        path = Path(args.drafter) / "config.json"
        config = json.loads(path.read_text())
        config["draft_confidence_threshold"] = best["threshold"]
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        print(f"[hf-retrace] wrote draft_confidence_threshold={best['threshold']} into {path}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``train``, ``data`` and ``calibrate`` to the ``hf-retrace`` parser's subcommands."""
    train = subparsers.add_parser("train", help="train a DFlash drafter for a target (CPU, GPU, accelerate launch)")
    add_train_arguments(train)
    train.set_defaults(func=_train_entry)

    data = subparsers.add_parser("data", help="make training data: target answers, tokenization, features")
    dsub = data.add_subparsers(dest="data_command", required=True)
    gen = dsub.add_parser("generate", help="let the target answer prompts (resumable JSONL shards)")
    gen.add_argument("--target", required=True, help='Hub id, folder or "default"')
    gen.add_argument("--prompts", required=True, nargs="+", help="prompt JSONL file(s)")
    gen.add_argument("--out", required=True)
    gen.add_argument("--suffix", default="", help="appended to every prompt")
    gen.add_argument("--limit", type=int, default=None, help="first N prompts of each file")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--max-prompt-tokens", type=int, default=768)
    gen.add_argument("--batch-size", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", type=dtype_arg, choices=SHORT_DTYPES, default="bf16")
    gen.set_defaults(func=cmd_data)
    tok = dsub.add_parser("tokenize", help="responses -> input_ids + loss_mask shards (manifest.json)")
    tok.add_argument("--target", required=True, help="whose tokenizer/chat template (Hub id, folder, default)")
    tok.add_argument("--responses", required=True, nargs="+", help="response JSONL files or shard folders")
    tok.add_argument("--out", required=True)
    tok.add_argument("--max-length", type=int, default=1024)
    tok.set_defaults(func=cmd_data)
    feat = dsub.add_parser("features", help="precompute the target's tapped hidden states (resumable)")
    feat.add_argument("--target", required=True)
    feat.add_argument("--data", required=True, help="tokenized folder")
    feat.add_argument("--out", required=True)
    feat.add_argument("--num-target-features", type=int, default=5)
    feat.add_argument("--target-layer-ids", default=None)
    feat.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS)
    feat.add_argument("--limit", type=int, default=None)
    feat.add_argument("--dtype", type=dtype_arg, choices=SHORT_DTYPES, default="bf16",
                      help="the target's dtype for the forward (float32 is ~2.5x faster on CPUs without bf16 units)")
    feat.add_argument("--storage-dtype", type=dtype_arg, choices=SHORT_DTYPES, default=None,
                      help="dtype on disk (default: --dtype; bfloat16 halves the disk of a float32 forward)")
    feat.set_defaults(func=cmd_data)

    cal = subparsers.add_parser("calibrate", help="calibrate a drafter's adaptive block on held-out training prompts")
    cal.add_argument("--target", required=True, help='Hub id, folder or "default"')
    cal.add_argument("--drafter", required=True, help="drafter folder (its config.json gets the threshold with --write)")
    cal.add_argument("--data", default=None, help="tokenized folder; prompts are the sequences in --sequences")
    cal.add_argument("--sequences", default=None, metavar="A:B",
                     help="indices of --data sequences never trained on (e.g. 4900:4932)")
    cal.add_argument("--prompts", default=None, help="or: a prompt JSONL file (never dev/)")
    cal.add_argument("--limit", type=int, default=24, help="prompts used")
    cal.add_argument("--max-new-tokens", type=int, default=96)
    cal.add_argument("--dtype", type=dtype_arg, choices=SHORT_DTYPES, default="bf16")
    cal.add_argument("--num-threads", type=int, default=None)
    cal.add_argument("--json", default=None, help="write the full table here")
    cal.add_argument("--write", action="store_true", help="store the best threshold in the drafter's config.json")
    cal.set_defaults(func=cmd_calibrate)


def _train_entry(args: argparse.Namespace) -> int:
    if not hasattr(args, "_argv"):
        args._argv = sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "train" else sys.argv[1:]
    return cmd_train(args)


def main(argv: list[str] | None = None) -> int:
    """``python -m hf_retrace.training.commands train ...`` (same as ``hf-retrace train ...``)."""
    parser = argparse.ArgumentParser(prog="hf-retrace")
    register(parser.add_subparsers(dest="command", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args._argv = argv[1:]
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
