"""``hf-retrace train``: one training run from its flags, from the checks to the saved drafter and its model card.

Example::

    hf-retrace train --target default --data work_data/tok --out runs/drafter --bf16 --max-steps 1000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ...loading import load_target, portable_path, resolve_target
from ...modeling import ReTraceDrafter
from ...tuning.records import RECORDS_FILENAME
from .checks import (
    RUN_SETTINGS,
    check_resume_settings,
    is_main_launch_process,
    parse_ids,
    run_settings,
    usage_error,
    validate_train_args,
)
from ..checkpoints import DRAFTER_INIT
from ..data import TokenizedDataset, read_prompts, records_token_ids
from ..drafter_init import (
    check_drafter_matches_target,
    copy_target_layers,
    drafter_config_from_target,
    frequent_response_tokens,
    init_from_target_statistics,
)
from ..evaluation import TauEvaluator, sequence_prompt_ids
from ..feature_dataset import FeatureDataset
from ..features import OnlineFeatures
from ..model_card import target_hub_id, write_model_card
from ..objective import DFlashObjective
from ..precomputed_features import PrecomputedFeatures, covered_sequences, features_manifest, precompute_features
from ..retrace_stage import ReTraceObjective
from ..trainer import ADAMW_BETAS, Trainer, TrainingArguments, backbone_parameters, retrace_parameters

__all__ = ["cmd_train", "source_labels"]

SUMMARY_FILE = "training_summary.json"


def cmd_train(args: argparse.Namespace) -> int:
    started = time.time()
    facts = validate_train_args(args)
    out = Path(args.out)
    if args.overwrite and out.exists() and is_main_launch_process():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    target_path = resolve_target(args.target)
    target, tokenizer = load_target(target_path, args.target_dtype, frozen=True)
    sequences = TokenizedDataset(args.data)
    vocab = target.config.get_text_config().vocab_size
    if facts["manifest"].get("vocab_size", vocab) > vocab:
        raise usage_error(f"--data was tokenized with a {facts['manifest']['vocab_size']}-token vocabulary but the "
                          f"target has {vocab}: tokenize with the target's tokenizer.")
    drafter, init = _build_drafter(args, target)
    _record_run(args, out, drafter, init)

    num = len(sequences) if args.max_sequences is None else min(args.max_sequences, len(sequences))
    if args.holdout >= num:
        raise usage_error(f"--holdout {args.holdout} leaves no training sequences (the data has {num}).")
    holdout_indices = list(range(num - args.holdout, num))
    features, feature_fn, mode = _feature_source(args, target, drafter, sequences, num)
    topk = PrecomputedFeatures(args.topk_dir, allow_partial=True, kind="topk") if args.distill_weight else None
    dataset = FeatureDataset(sequences, features, indices=list(range(num - args.holdout)), topk=topk)
    eval_fn, prompt_ids = None, []
    if args.eval_prompts or holdout_indices:
        prompt_ids = _eval_prompt_ids(args, tokenizer, sequences, holdout_indices)
        eval_fn = TauEvaluator(target, prompt_ids, max_new_tokens=args.eval_max_new_tokens, limit=args.eval_limit)
    objective, param_filter = _objective(args, drafter, target)
    trainer = Trainer(objective, dataset, _training_arguments(args, out), feature_fn=feature_fn,
                      param_filter=param_filter, eval_fn=eval_fn)
    target.to(trainer.accelerator.device)  # the target runs on the same device as the drafter
    _print_plan(trainer, args, target_path, drafter, init, len(dataset), mode, len(prompt_ids))
    summary = trainer.train()
    final_eval = _final_evaluation(trainer, summary["steps"], len(prompt_ids)) if eval_fn is not None else {}
    trainer.save_drafter(out, args.save_dtype)
    acc = trainer.accelerator
    if acc.is_main_process:
        info = _card_info(args, facts["manifest"], target_path, drafter, init, mode, acc, len(dataset), summary,
                          final_eval)
        write_model_card(out, info)
        (out / SUMMARY_FILE).write_text(json.dumps(
            {**summary, "final_eval": final_eval, "wall_seconds_this_process": time.time() - started,
             "info": info}, indent=2, default=str))
        acc.print(f"[hf-retrace] drafter saved to {out}")
        if args.push_to_hub:
            _push_to_hub(out, args.push_to_hub)
            acc.print(f"[hf-retrace] pushed to https://huggingface.co/{args.push_to_hub}")
    trainer.finish()
    return 0


def _build_drafter(args: argparse.Namespace, target: Any) -> tuple[ReTraceDrafter, str]:
    """The drafter the run starts from (fp32), and a line saying how it was initialised."""
    if args.init_from:
        drafter = ReTraceDrafter.from_pretrained(args.init_from, dtype=torch.float32)
        # new weights: the source's recorded rounds no longer describe them (save_pretrained must not carry them)
        drafter.config._name_or_path = drafter.name_or_path = ""  # (transformers 5 keeps both)
        init = f"fine-tuned from {args.init_from}"
        layers = parse_ids(args.target_layer_ids)
        if layers and layers != list(drafter.config.target_layer_ids):
            before = list(drafter.config.target_layer_ids)
            try:
                drafter.set_target_layers(layers)
            except ValueError as error:
                raise usage_error(f"--target-layer-ids {args.target_layer_ids}: {error}") from None
            init += f", target layers {before} -> {layers} (zero input columns for the new ones)"
    else:
        config = drafter_config_from_target(
            target.config, num_hidden_layers=args.num_layers, block_size=args.block_size,
            num_target_features=args.num_target_features, target_layer_ids=parse_ids(args.target_layer_ids),
            mask_token_id=args.mask_token_id, retrace=False,
        )
        torch.manual_seed(args.seed)
        drafter = ReTraceDrafter(config).to(torch.float32)
        init_from_target_statistics(drafter, target)
        init = "from scratch (mask vector at the scale of the target's embeddings)"
        if args.copy_target_layers:
            source = None if args.copy_target_layers == "last" else parse_ids(args.copy_target_layers)
            mapping = copy_target_layers(drafter, target, source)
            init += f", layers copied from target layers {list(mapping.values())}"
    if args.draft_vocab_size:  # a selection of the target's frozen head rows: re-selecting loses nothing learned
        before = drafter.config.draft_vocab_size if drafter.draft_vocab is not None else None
        drafter.set_draft_vocab(frequent_response_tokens(args.data, args.draft_vocab_size, target.config))
        init += f", draft vocabulary: the {args.draft_vocab_size} most frequent response tokens of --data"
        if args.init_from:
            init += f" (re-selected; it had {before or 'the full vocabulary'})"
    if args.stage == "retrace":
        drafter.add_retrace()
        drafter.config.retrace_ablation = args.retrace_ablation
    name = getattr(target.config, "_name_or_path", "the target")
    check_drafter_matches_target(drafter.config, target.config, name)
    if args.block_size != drafter.config.block_size and args.init_from:
        print(f"[hf-retrace] note: --init-from drafter has block size {drafter.config.block_size}; using it.",
              file=sys.stderr)
    return drafter, init


def _record_run(args: argparse.Namespace, out: Path, drafter: ReTraceDrafter, init: str) -> None:
    """Refuse a ``--resume`` under other settings; write the run's settings and its drafter's config."""
    settings = run_settings(args, drafter.config, int(os.environ.get("WORLD_SIZE", "1")))
    if args.resume:
        check_resume_settings(out, settings)
    if is_main_launch_process():
        (out / RUN_SETTINGS).write_text(json.dumps(settings, indent=2))
        (out / DRAFTER_INIT).write_text(json.dumps(
            {"init": init, "config": json.loads(drafter.config.to_json_string())}, indent=2))


def _feature_source(args: argparse.Namespace, target: Any, drafter: ReTraceDrafter, sequences: TokenizedDataset,
                    num: int) -> tuple[PrecomputedFeatures | None, OnlineFeatures | None, str]:
    """Where the target's features come from: precomputed features, an online ``feature_fn``, and a line saying so."""
    if args.stage == "retrace":
        return None, None, f"online, in the objective (verification: {args.verification})"
    if not args.features_dir:
        return None, OnlineFeatures(target, drafter.config.target_layer_ids), "online"
    layer_ids = list(drafter.config.target_layer_ids)
    fm = features_manifest(args.features_dir)
    stored = list(fm.get("target_layer_ids", [])) if fm is not None else layer_ids
    if not set(layer_ids) <= set(stored):
        raise usage_error(f"--features-dir holds target layers {stored} but the drafter reads {layer_ids}; use a new "
                          f"folder, or one whose layers include the drafter's.")
    if fm is None or covered_sequences(fm) < num:  # none yet, stopped short, or made before the data grew
        precompute_features(target, sequences, args.features_dir, stored, progress=not args.no_progress)
    features = PrecomputedFeatures(args.features_dir, allow_partial=True, layers=layer_ids)
    chosen = f", layers {layer_ids} of {stored}" if stored != layer_ids else ""
    return features, None, f"precomputed ({args.features_dir}{chosen}, {len(features)} sequences covered)"


def _eval_prompt_ids(args: argparse.Namespace, tokenizer: Any, dataset: TokenizedDataset,
                     holdout_indices: list[int]) -> list[list[int]]:
    if args.eval_prompts:
        return records_token_ids(tokenizer, read_prompts(args.eval_prompts))
    return sequence_prompt_ids(dataset, holdout_indices)


def _objective(args: argparse.Namespace, drafter: ReTraceDrafter, target: Any) -> tuple[torch.nn.Module, Any]:
    """The stage's objective and the drafter weights it trains."""
    if args.stage == "retrace":
        objective = ReTraceObjective(drafter, target, num_anchors=args.num_anchors, gamma=args.gamma,
                                     verification=args.verification)
        return objective, (lambda name: True) if args.joint else retrace_parameters
    objective = DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings(),
                                num_anchors=args.num_anchors, gamma=args.gamma, distill_weight=args.distill_weight)
    return objective, backbone_parameters


def _training_arguments(args: argparse.Namespace, out: Path) -> TrainingArguments:
    return TrainingArguments(
        out_dir=str(out), batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
        weight_decay=args.weight_decay, warmup_ratio=args.warmup_ratio, max_grad_norm=args.max_grad_norm,
        epochs=args.epochs, max_steps=args.max_steps, mixed_precision="bf16" if args.bf16 else "no",
        max_seconds=args.max_minutes * 60 if args.max_minutes else None,
        save_every=args.save_every, keep_checkpoints=args.keep_checkpoints, eval_every=args.eval_every,
        seed=args.seed, num_workers=args.num_workers, progress=not args.no_progress,
        save_dtype=args.save_dtype, resume=args.resume,
    )


def _print_plan(trainer: Trainer, args: argparse.Namespace, target_path: str, drafter: ReTraceDrafter, init: str,
                num_sequences: int, mode: str, num_prompts: int) -> None:
    acc, config = trainer.accelerator, drafter.config
    acc.print(f"[hf-retrace] target {target_path} ({args.target_dtype}); drafter {init}: "
              f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f} M params, {config.num_hidden_layers} "
              f"layers, block {config.block_size}, target layers {config.target_layer_ids}, "
              f"mask: {'learned vector' if config.learned_mask_embedding else config.mask_token_id}")
    steps = (f"up to {trainer.total_steps} steps (fit to --max-minutes {args.max_minutes:g} after the first ones)"
             if args.max_minutes else f"{trainer.total_steps} steps")
    acc.print(f"[hf-retrace] {num_sequences} training sequences, features {mode}, {steps} "
              f"({args.batch_size} x {args.grad_accum} x {acc.num_processes} sequences each), warmup "
              f"{f'{args.warmup_ratio:g} of them' if args.max_minutes else trainer.warmup_steps}; "
              f"{num_prompts} eval prompts")
    if args.distill_weight:
        acc.print(f"[hf-retrace] loss: {1 - args.distill_weight:g} x the target's token + {args.distill_weight:g} x "
                  f"its top-k distribution ({args.topk_dir})")


def _final_evaluation(trainer: Trainer, steps: int, num_prompts: int) -> dict[str, Any]:
    trainer.accelerator.print(f"[hf-retrace] final tau evaluation on {num_prompts} prompts ...")
    final_eval = trainer.evaluate(limit=None)
    if final_eval:
        trainer._log({"step": steps, "final": True, **final_eval})
        trainer.accelerator.print(f"[hf-retrace] tau = {final_eval['tau']:.3f}")
    return final_eval


def source_labels(paths: list[str]) -> list[str]:
    """Each data source by its file name, with its folder where two sources share a name (``responses/...`` and
    ``responses-w1/...`` of two workers): what a model card says without a machine's paths."""
    names = [Path(path).name for path in paths]
    return [name if names.count(name) == 1 else f"{Path(path).parent.name}/{name}" for path, name in zip(paths, names)]


def _card_info(args: argparse.Namespace, manifest: dict[str, Any], target_path: str, drafter: ReTraceDrafter,
               init: str, mode: str, acc: Any, num_sequences: int, summary: dict[str, Any],
               final_eval: dict[str, Any]) -> dict[str, Any]:
    """What the model card and ``training_summary.json`` say about the run (no machine paths)."""
    config = drafter.config
    hardware = (f"{acc.num_processes} x {acc.device.type} ({platform.processor() or platform.machine()}, "
                f"{os.cpu_count()} cores)" if acc.device.type == "cpu" else f"{acc.num_processes} x {acc.device}")
    return {
        "target": target_hub_id(target_path) or Path(target_path).name,  # no machine paths in a shipped card
        "target_hub_id": target_hub_id(target_path),
        "data": f"{Path(args.data).name} ({manifest.get('num_sequences')} sequences, "
                f"{manifest.get('num_response_tokens')} response tokens; sources: "
                + ", ".join(source_labels([s["path"] for s in manifest.get("sources", [])])) + ")",
        "num_sequences": num_sequences,
        "tokens": summary["tokens"], "labels": summary["labels"], "steps": summary["steps"],
        "time": f"{summary['seconds'] / 60:.1f} min of training ({summary['seconds'] / 3600:.2f} h)",
        "hardware": hardware,
        "stage": portable_path(f"{args.stage}; drafter {init}; features {mode}"),
        "hyperparameters": (f"block {config.block_size}, {config.num_hidden_layers} layers, "
                            f"target layers {config.target_layer_ids}, {args.num_anchors} anchors, "
                            f"gamma {args.gamma}, "
                            + (f"top-k distillation weight {args.distill_weight}, " if args.distill_weight else "")
                            + f"lr {args.lr}, warmup {args.warmup_ratio}, cosine over {summary['total_steps']} steps"
                            + (f" (fit to --max-minutes {args.max_minutes:g})" if args.max_minutes else "") + ", "
                            f"batch {args.batch_size}x{args.grad_accum}x{acc.num_processes}, "
                            f"{'bf16' if args.bf16 else 'fp32'}, AdamW{ADAMW_BETAS}, wd {args.weight_decay}, clip "
                            f"{args.max_grad_norm}"),
        "command": portable_path("hf-retrace train " + " ".join(shlex.quote(a) for a in getattr(args, "_argv", []))),
        "tau": final_eval.get("tau"),
        "eval_prompts": final_eval.get("eval_prompts"),
        "eval_max_new_tokens": args.eval_max_new_tokens,
    }


# what a drafter folder publishes: weights (one file or shards + index), config, model card, recorded rounds
PUBLISHED_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json", "README.md", RECORDS_FILENAME)


def _push_to_hub(out: Path, repo_id: str) -> None:
    """Upload the drafter folder's published files in one commit (checkpoints, logs and run settings stay here)."""
    from fnmatch import fnmatch

    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi()
    repo_id = api.create_repo(repo_id, exist_ok=True).repo_id
    files = sorted(p for p in out.iterdir() if p.is_file() and any(fnmatch(p.name, g) for g in PUBLISHED_FILES))
    api.create_commit(repo_id, [CommitOperationAdd(path_in_repo=p.name, path_or_fileobj=str(p)) for p in files],
                      commit_message="Upload hf-retrace drafter")
