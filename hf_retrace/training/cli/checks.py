"""Every check of ``hf-retrace train | data | calibrate`` that can fail on user input, run before any model loads.

Paths, folders, prompt files and flag combinations are checked first, so a typo costs seconds, not hours; a
``--resume`` is refused when the run's settings (``run_settings.json``) differ from the ones given now, and passes over
a damaged checkpoint (``check_resume_files``); a file written at the end must be writable now (``check_writable``).

Example::

    facts = validate_train_args(build_train_parser().parse_args(argv))  # SystemExit with a message on bad input
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ...tuning.records import RECORDS_FILENAME
from ..checkpoints import CHECKPOINTS, DRAFTER_INIT, RUN_SETTINGS, checkpoint_problem, step_checkpoints
from ..data import TokenizedDataset, validate_prompt_file
from ..precomputed_features import STORE_MAKERS, covered_sequences, features_manifest, store_fits, store_kind
from ..trainer import LOG_FILE

__all__ = [
    "RUN_SETTINGS",
    "check_calibration_args",
    "check_prompt_file",
    "check_resume_files",
    "check_resume_settings",
    "check_writable",
    "is_main_launch_process",
    "parse_ids",
    "refuse_held_out",
    "require_tokenized",
    "run_settings",
    "usage_error",
    "validate_train_args",
]

HELD_OUT_ENV_VAR = "HF_RETRACE_HELD_OUT_DIRS"  # os.pathsep-separated folders of benchmark prompts
RUN_MARKERS = (DRAFTER_INIT, LOG_FILE, RUN_SETTINGS, CHECKPOINTS)  # a run's own files
# the drafter fields that make a checkpoint's weights fit (or not)
_SHAPE_FIELDS = ("block_size", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "target_layer_ids", "draft_vocab_size", "learned_mask_embedding",
                 "mask_token_id", "retrace")


def _shape_value(drafter_config: Any, name: str) -> Any:
    """A shape field as a run records it; for ReTrace, whether the module exists (its training state is not shape)."""
    value = getattr(drafter_config, name, None)
    return value != "absent" if name == "retrace" and isinstance(value, str) else value


def usage_error(message: str) -> SystemExit:
    return SystemExit(f"hf-retrace: error: {message}")


def parse_ids(text: str | None) -> list[int] | None:
    if text is None or text == "":
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise usage_error(f"expected a comma-separated list of integers, got {text!r}") from None


def _held_out_folder(path: Path) -> Path | None:
    """The folder of ``$HF_RETRACE_HELD_OUT_DIRS`` that holds ``path`` (benchmark data: never train or tune on it)."""
    resolved = path.resolve()
    for folder in filter(None, os.environ.get(HELD_OUT_ENV_VAR, "").split(os.pathsep)):
        folder_path = Path(folder).resolve()
        if resolved == folder_path or folder_path in resolved.parents:
            return folder_path
    return None


def refuse_held_out(path: Path, flag: str) -> None:
    folder = _held_out_folder(path)
    if folder is not None:
        raise usage_error(f"{flag} {path} lies in {folder}, a benchmark folder listed in ${HELD_OUT_ENV_VAR}: "
                          "train and calibrate on training data only.")


def is_main_launch_process() -> bool:
    """True outside ``accelerate launch``/torchrun, and in its rank-0 process (before any Accelerator exists)."""
    return int(os.environ.get("RANK", "0")) == 0


def _folder_is_empty(path: Path) -> bool:
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def check_prompt_file(path: str, flag: str) -> None:
    try:
        validate_prompt_file(path)
    except (FileNotFoundError, ValueError) as error:
        raise usage_error(f"{flag}: {error}") from None


def check_writable(path: str | os.PathLike[str], flag: str, what: str) -> None:
    """Refuse now, before any model loads, a file that a command writes only at its end and could not write then:
    ``path``'s folder must exist and be writable (an atomic write creates a file beside it), and ``path``, where it
    exists, must be a writable file. ``what`` names the file's content in the message.

    Example: ``check_writable(args.json, "--json", "the table")``.
    """
    path = Path(path)
    if path.is_dir():
        raise usage_error(f"{flag}: {path} is a folder; {what} is written to a file there: give a file name.")
    if not path.parent.is_dir():
        raise usage_error(f"{flag}: {what} would go to {path}, but the folder {path.parent} does not exist: create it "
                          "first, or choose another path. Nothing was run.")
    for blocked in (path.parent, path):
        if blocked.exists() and not os.access(blocked, os.W_OK | (os.X_OK if blocked.is_dir() else 0)):
            raise usage_error(f"{flag}: {what} would go to {path}, but this user cannot write {blocked} (read-only "
                              "file system or permissions). Nothing was run: make it writable (e.g. chmod u+w "
                              f"{blocked}), or choose another path.")


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
        "drafter": {name: _shape_value(drafter_config, name) for name in _SHAPE_FIELDS},
        # only when used, so that runs recorded before the flag existed still resume
        **({"distill_weight": args.distill_weight} if args.distill_weight else {}),
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
        raise usage_error(
            f"--resume continues the run in {out}, but these settings differ from it: " + "; ".join(changed)
            + ". Pass the run's own settings to continue it, or start a new --out (to train its drafter further under "
            f"new settings: --init-from {out}/export after `export_checkpoint`, or from its saved drafter)."
        )


def check_resume_files(out: Path) -> Path | None:
    """What ``--resume`` reads, checked before any model loads; returns the checkpoint it resumes from (None: none).

    ``run_settings.json`` must parse (``--resume`` compares the settings with it). A checkpoint newer than the newest
    intact one is named with what is wrong and passed over, with a warning; when none is intact the resume is refused.
    Nothing is changed on disk.
    """
    settings = out / RUN_SETTINGS
    if settings.is_file():
        try:
            json.loads(settings.read_text())
        except (ValueError, OSError) as error:
            raise usage_error(
                f"--resume: {settings} cannot be read ({error}; cut short?). It records the run's settings, which "
                "--resume compares with the ones given now: restore it from a copy, or delete it to resume without "
                "that comparison (the settings given now are then recorded). Nothing was changed."
            ) from None
    damaged = []
    for checkpoint in step_checkpoints(out):  # newest first
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            if damaged and is_main_launch_process():
                for path, what in damaged:
                    print(f"[hf-retrace] warning: checkpoint {path} is damaged ({what}); resuming from "
                          f"{checkpoint.name}, the newest intact checkpoint (the damaged one is replaced when the run "
                          "passes its step).", file=sys.stderr)
            return checkpoint
        damaged.append((checkpoint, problem))
    if damaged:
        listed = "; ".join(f"{path.name}: {what}" for path, what in damaged)
        raise usage_error(f"--resume: no checkpoint in {out / CHECKPOINTS} can be loaded ({listed}). Restore one, or "
                          "start the run over with --overwrite. Nothing was changed.")
    return None


def require_tokenized(data: str) -> None:
    if not (Path(data) / "manifest.json").is_file():
        raise usage_error(f"--data {data}: no manifest.json (run `hf-retrace data tokenize` first).")


# ---------------------------------------------------------------------------------------------------------------
# hf-retrace train
# ---------------------------------------------------------------------------------------------------------------


def validate_train_args(args: argparse.Namespace) -> dict[str, Any]:
    """All cheap checks; returns facts found on the way (the data manifest). Raises SystemExit with a message."""
    _check_stage(args)
    manifest = _tokenized_manifest(Path(args.data))
    _check_numbers(args)
    _check_drafter_flags(args)
    if args.eval_prompts:
        check_prompt_file(args.eval_prompts, "--eval-prompts")
        if _held_out_folder(Path(args.eval_prompts)):
            print("[hf-retrace] note: evaluating tau on held-out benchmark prompts (fine for eval, never for "
                  "training).", file=sys.stderr)
    _check_features_dir(args.features_dir, args.data)
    _check_distillation(args, manifest)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise usage_error(f"--out {out} is a file.")
    has_checkpoint = (out / CHECKPOINTS).is_dir()
    if args.resume and out.is_dir():
        check_resume_files(out)
    # under `accelerate launch` only the main process checks, empties and writes --out (the others would see its files)
    if is_main_launch_process():
        _check_out_folder(args, out)
        if args.target != "default" and not Path(args.target).exists() and "/" not in args.target:
            raise usage_error(f"--target {args.target}: not a folder, a Hub id (owner/name) nor 'default'.")
        _check_push_to_hub(args.push_to_hub)
    return {"manifest": manifest, "has_checkpoint": has_checkpoint}


def _check_push_to_hub(repo_id: str | None) -> None:
    """--push-to-hub uploads at the end of the run: its repo id and the token are checked now, not after hours."""
    if repo_id is None:
        return
    import huggingface_hub
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise usage_error(f"--push-to-hub {repo_id!r} is not a Hub repo id (name or owner/name): {e}") from None
    if not huggingface_hub.get_token():
        raise usage_error(f"--push-to-hub {repo_id} needs a Hugging Face token with write access, and none is set: "
                          "run `hf auth login` (or set HF_TOKEN), then start the run again. Checked before training, "
                          "so a run never ends without its upload.")


def _check_stage(args: argparse.Namespace) -> None:
    if args.stage == "retrace":
        if not args.init_from:
            raise usage_error("--stage retrace trains the ReTrace module on a trained DFlash backbone: pass "
                              "--init-from DRAFTER (e.g. the output folder of a --stage backbone run, or a published "
                              "DFlash drafter).")
        if args.features_dir:
            raise usage_error("--stage retrace runs the target online (its cache verifies the drafts); drop "
                              "--features-dir.")
    if args.draft_vocab_size is not None and args.draft_vocab_size < 2:
        raise usage_error("--draft-vocab-size must be at least 2 (or leave it out for the full vocabulary).")


def _tokenized_manifest(data: Path) -> dict[str, Any]:
    manifest_path = data / "manifest.json"
    if not manifest_path.is_file():
        raise usage_error(f"--data {data}: no manifest.json; make it with `hf-retrace data tokenize ... --out {data}`.")
    manifest = json.loads(manifest_path.read_text())
    if not manifest.get("complete"):
        raise usage_error(f"--data {data} is only partly tokenized; run `hf-retrace data tokenize` again to finish it.")
    refuse_held_out(data, "--data")
    return manifest


def _check_numbers(args: argparse.Namespace) -> None:
    positive = {"--block-size": args.block_size - 1, "--num-layers": args.num_layers, "--num-anchors": args.num_anchors,
                "--batch-size": args.batch_size, "--grad-accum": args.grad_accum,
                "--keep-checkpoints": args.keep_checkpoints, "--eval-max-new-tokens": args.eval_max_new_tokens}
    for flag, value in positive.items():
        if value < 1:
            raise usage_error(f"{flag} must be at least {2 if flag == '--block-size' else 1}.")
    if args.lr <= 0 or not 0 <= args.warmup_ratio < 1 or args.epochs <= 0:
        raise usage_error("--lr must be > 0, --warmup-ratio in [0, 1), --epochs > 0.")
    if args.max_steps is not None and args.max_steps < 1:
        raise usage_error("--max-steps must be at least 1.")
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise usage_error(f"--max-minutes must be a positive number of minutes, got {args.max_minutes}.")


def _check_drafter_flags(args: argparse.Namespace) -> None:
    if args.init_from and (args.copy_target_layers or args.mask_token_id is not None):
        raise usage_error("--init-from takes the drafter's shape from its checkpoint; drop --copy-target-layers and "
                          "--mask-token-id (--target-layer-ids may add target layers to the ones it reads).")
    parse_ids(args.target_layer_ids)
    if args.copy_target_layers not in (None, "last"):
        parse_ids(args.copy_target_layers)


def _check_features_dir(features_dir: str | None, data: str) -> None:
    if not features_dir:
        return
    existing = features_manifest(features_dir)
    if existing is not None:
        _check_store(existing, "--features-dir", features_dir, "hidden", data)


def _check_store(store: dict[str, Any], flag: str, folder: str, kind: str, data: str) -> None:
    """A precomputed store of the expected kind, made for the tokenized data ``data`` (or its first sequences,
    before it grew)."""
    if store_kind(store) != kind:
        raise usage_error(f"{flag} {folder} holds what `{STORE_MAKERS[store_kind(store)]}` writes; {flag} takes a "
                          f"folder of `{STORE_MAKERS[kind]}`.")
    misfit = store_fits(store, TokenizedDataset(data))
    if misfit:
        raise usage_error(f"{flag} {folder} does not belong to --data {data}: {misfit}. Use a new folder.")


def _check_distillation(args: argparse.Namespace, manifest: dict[str, Any]) -> None:
    """``--distill-weight`` in [0, 1]; above 0 it needs a complete enough ``--topk-dir`` for the backbone stage."""
    if not 0.0 <= args.distill_weight <= 1.0:
        raise usage_error(f"--distill-weight must be in [0, 1] (0: the target's own token only), got "
                          f"{args.distill_weight}.")
    if not args.distill_weight:
        if args.topk_dir:
            raise usage_error("--topk-dir is read only with --distill-weight > 0; add one (e.g. 0.5) or drop it.")
        return
    if args.stage != "backbone":
        raise usage_error("--distill-weight trains the backbone (--stage backbone); the ReTrace stage does not use it.")
    if not args.topk_dir:
        raise usage_error("--distill-weight needs the target's top-k distributions: run `hf-retrace data topk --target "
                          f"{args.target} --data {args.data} --out TOPK_DIR` and pass --topk-dir TOPK_DIR.")
    store = features_manifest(args.topk_dir)
    if store is None:
        raise usage_error(f"--topk-dir {args.topk_dir}: no features.json; make it with `hf-retrace data topk`.")
    _check_store(store, "--topk-dir", args.topk_dir, "topk", args.data)
    total = int(manifest.get("num_sequences", 0))
    needed = min(args.max_sequences or total, total) - args.holdout
    covered = covered_sequences(store)
    if covered < needed:
        raise usage_error(f"--topk-dir {args.topk_dir} covers the first {covered} sequences but training reads the "
                          f"first {needed}: run `hf-retrace data topk` with --limit {needed} or more (it resumes), or "
                          f"train on fewer (--max-sequences {covered + args.holdout}).")


def _check_out_folder(args: argparse.Namespace, out: Path) -> None:
    if not _folder_is_empty(out) and not (args.resume or args.overwrite):
        raise usage_error(f"--out {out} is not empty. Pass --resume to continue a run there, --overwrite to start "
                          "over, or choose a new folder.")
    if args.resume and args.overwrite:
        raise usage_error("--resume and --overwrite exclude each other.")
    if args.overwrite and not _folder_is_empty(out) and not any((out / name).exists() for name in RUN_MARKERS):
        sample = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise usage_error(f"--overwrite deletes a previous run's output only, but {out} holds other files ({sample}); "
                          "nothing was deleted. Choose a new --out, or empty that folder yourself.")


# ---------------------------------------------------------------------------------------------------------------
# hf-retrace calibrate
# ---------------------------------------------------------------------------------------------------------------


def check_calibration_args(args: argparse.Namespace) -> tuple[int, int] | None:
    """All checks of ``hf-retrace calibrate`` that need no model; returns the ``--sequences`` range (or None)."""
    if not (Path(args.drafter) / "config.json").is_file():
        raise usage_error(f"--drafter {args.drafter}: not a drafter folder (no config.json).")
    if args.write:  # written at the end: a folder it cannot write would cost the whole calibration
        check_writable(Path(args.drafter) / RECORDS_FILENAME, "--write", "the recorded rounds")
    if args.json:
        check_writable(args.json, "--json", "the table")
    if bool(args.prompts) == bool(args.data):
        raise usage_error("calibrate needs prompts: --data DIR --sequences A:B (never trained on), or --prompts FILE.")
    if args.prompts:
        check_prompt_file(args.prompts, "--prompts")
        refuse_held_out(Path(args.prompts), "--prompts")
        return None
    require_tokenized(args.data)
    refuse_held_out(Path(args.data), "--data")
    try:
        start, end = (int(x) for x in (args.sequences or "").split(":"))
    except ValueError:
        message = f"--sequences must be A:B (sequence indices never trained on), got {args.sequences!r}."
        raise usage_error(message) from None
    return start, end
