"""The training loop: one CPU, one GPU or many with ``accelerate launch``.

The loop is stage-agnostic: it trains whatever ``objective`` module it is given (``forward(batch) -> (loss,
metrics)``, with the drafter at ``objective.drafter``), only the drafter weights that ``param_filter(name)`` selects
(names relative to the drafter, e.g. ``layers.0.mlp.up_proj.weight``, ``retrace.gate.weight``). The DFlash backbone
stage uses :class:`~hf_retrace.training.objective.DFlashObjective` with :func:`backbone_parameters`; a ReTrace
stage passes its own objective and :func:`retrace_parameters` (the backbone stays frozen) and reuses everything else:
data order, checkpoints (``checkpoints.py``), resume, logs, τ evaluation (``evaluation.py``), saving.

Example::

    objective = DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings())
    trainer = Trainer(objective, FeatureDataset(TokenizedDataset(data_dir)), TrainingArguments(out_dir="run"),
                      feature_fn=OnlineFeatures(target, drafter.config.target_layer_ids),
                      eval_fn=TauEvaluator(target, eval_prompt_ids))
    summary = trainer.train()
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .checkpoints import latest_checkpoint, read_checkpoint, save_in_dtype, truncate_log, write_checkpoint
from .features import collate_sequences
from .objective import tau_proxy
from .time_budget import BUDGET_SAFETY, TimeBudget

__all__ = ["Trainer", "TrainingArguments", "backbone_parameters", "exit_if_still_running", "retrace_parameters"]

TEARDOWN_TIMEOUT_S = 60.0  # seconds a multi-process teardown may take before the process leaves without it


def exit_if_still_running(call: Callable[[], Any], seconds: float, warning: str) -> None:
    """Run ``call``; if it has not returned after ``seconds``, print ``warning`` to stderr and end the process
    (``os._exit(0)``: only for the last act of a process, once everything is written and flushed)."""
    returned = threading.Event()

    def watchdog() -> None:
        if not returned.wait(seconds):
            sys.stdout.flush()
            print(warning, file=sys.stderr, flush=True)
            os._exit(0)

    threading.Thread(target=watchdog, name="teardown-watchdog", daemon=True).start()
    call()
    returned.set()

LOG_FILE = "train_log.jsonl"
ADAMW_BETAS = (0.9, 0.95)


def backbone_parameters(name: str) -> bool:
    """The DFlash stage trains every drafter weight except the ReTrace module's."""
    return not name.startswith("retrace.")


def retrace_parameters(name: str) -> bool:
    """The ReTrace stage trains only ``retrace.*`` (backbone frozen)."""
    return name.startswith("retrace.")


@dataclass
class TrainingArguments:
    """Hyper-parameters of :class:`Trainer` (``epochs`` may be fractional; ``max_steps`` wins when set)."""

    out_dir: str
    batch_size: int = 1  # sequences per process per micro-batch
    grad_accum: int = 1
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0
    epochs: float = 1.0
    max_steps: int | None = None
    # wall-clock seconds for this process's loop (the starting evaluation included): the schedule is fit to end within
    # them, at the latest at what ``epochs`` / ``max_steps`` set, and the loop stops at them whatever happens
    max_seconds: float | None = None
    mixed_precision: str = "no"  # "no" | "bf16" | "fp16"
    save_every: int = 500
    keep_checkpoints: int = 2
    eval_every: int = 0
    log_every: int = 1
    seed: int = 0
    num_workers: int = 0
    progress: bool = True
    save_dtype: str = "bfloat16"
    resume: bool = False


@dataclass
class _State:
    step: int = 0  # optimizer steps done
    micro_step: int = 0  # micro-batches consumed (global; the data order is a pure function of this)
    tokens: int = 0  # sequence tokens seen (all processes)
    labels: int = 0
    seconds: float = 0.0  # training wall time before this process
    last_eval: dict = field(default_factory=dict)
    total_steps: int = 0  # the steps a time budget fit the schedule to (0: none; ``epochs`` / ``max_steps`` set it)


def _lr_lambda(total_steps: int, warmup_steps: int, min_ratio: float) -> Callable[[int], float]:
    def schedule(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return schedule


@dataclass
class _StepSums:
    """One process's sums over the micro-batches of one optimizer step."""

    slot_correct: torch.Tensor
    slot_counts: torch.Tensor
    loss: float = 0.0
    tokens: int = 0
    labels: int = 0
    grad_norm: Any = None


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _select_trainable(drafter: nn.Module, param_filter: Callable[[str], bool]) -> list[nn.Parameter]:
    """The weights ``param_filter`` selects, with ``requires_grad`` set on them and cleared on every other one."""
    trainable = []
    for name, param in drafter.named_parameters():
        keep = bool(param_filter(name))
        param.requires_grad_(keep)
        if keep:
            trainable.append(param)
    if not trainable:
        raise ValueError("param_filter selects no drafter weight: nothing to train.")
    return trainable


class Trainer:
    """Trains ``objective.drafter`` (weights selected by ``param_filter``) with ``accelerate``.

    * ``train_dataset`` items are dicts for ``collate_fn`` (default: right-padded ``input_ids``/``loss_mask`` plus
      precomputed ``target_hidden`` when the items carry it).
    * ``feature_fn(batch) -> batch`` adds what the dataset lacks (e.g. :class:`OnlineFeatures`); it runs on the
      device, before the objective, without grad.
    * ``eval_fn(drafter) -> dict`` runs every ``eval_every`` steps and at the end, on the main process
      (e.g. :class:`TauEvaluator`).

    Data order is a pure function of ``(seed, micro_step)``: a fresh permutation per epoch, sharded over processes;
    anchors are drawn from a generator seeded by ``(seed, micro_step, process)``. With weights, optimizer and step
    counters in ``checkpoints/step-N`` (``checkpoints.py``), a resumed run continues exactly where the killed one was.
    """

    def __init__(
        self,
        objective: nn.Module,
        train_dataset: Any,
        args: TrainingArguments,
        *,
        feature_fn: Callable[[dict], dict] | None = None,
        collate_fn: Callable[[list], dict] = collate_sequences,
        param_filter: Callable[[str], bool] = backbone_parameters,
        eval_fn: Callable[[nn.Module], dict] | None = None,
        accelerator: Any = None,
        run_info: dict[str, Any] | None = None,
    ):
        from accelerate import Accelerator

        self.args = args
        self.out_dir = Path(args.out_dir)
        # `accelerate launch --multi_gpu --num_processes N` on a machine without GPUs: N gloo processes on the CPU
        cpu_processes = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
        self.accelerator = accelerator or Accelerator(
            mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum,
            cpu=cpu_processes or None,
        )
        self.objective = objective
        self.dataset = train_dataset
        self.feature_fn = feature_fn
        self.collate_fn = collate_fn
        self.eval_fn = eval_fn
        self.run_info = dict(run_info or {})
        self.param_filter = param_filter
        trainable = _select_trainable(objective.drafter, param_filter)
        self.trainable_names = [n for n, p in objective.drafter.named_parameters() if p.requires_grad]
        world = self.accelerator.num_processes
        self.micro_per_epoch = len(train_dataset) // (args.batch_size * world)
        if self.micro_per_epoch == 0:
            raise ValueError(
                f"The dataset has {len(train_dataset)} sequences, fewer than one global batch "
                f"({args.batch_size} x {world} processes)."
            )
        steps_per_epoch = self.micro_per_epoch / args.grad_accum
        # the steps ``epochs`` / ``max_steps`` set; a time budget may fit fewer (``_fit_to_budget``)
        self.step_cap = int(args.max_steps) if args.max_steps else max(1, int(args.epochs * steps_per_epoch))
        self._set_schedule(self.step_cap)
        optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay, betas=ADAMW_BETAS)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self._schedule(step))
        self.model, self.optimizer = self.accelerator.prepare(objective, optimizer)
        # the schedule is a pure function of the step: restored from trainer_state.json, never pickled
        self.state = _State()
        self.trainable_params = trainable
        self._clock: Callable[[], float] = time.perf_counter  # the time budget's clock (tests give their own)

    def _set_schedule(self, total_steps: int) -> None:
        """Warm-up and cosine over ``total_steps`` (the scheduler reads it at its next step)."""
        self.total_steps = total_steps
        self.warmup_steps = int(math.ceil(self.args.warmup_ratio * total_steps))
        self._schedule = _lr_lambda(total_steps, self.warmup_steps, self.args.min_lr_ratio)

    def _reschedule(self, total_steps: int) -> None:
        """``_set_schedule``, and the optimizer's rate set at once to the new schedule's at the current step."""
        import warnings

        self._set_schedule(total_steps)
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended, nothing is skipped
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.last_epoch = self.state.step - 1
            self.scheduler.step()

    # --- data order ----------------------------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.args.seed, epoch]).permutation(len(self.dataset))

    def _batches_from(self, micro_step: int):
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        bs = self.args.batch_size
        while True:
            epoch, k = divmod(micro_step, self.micro_per_epoch)
            perm = self._permutation(epoch)
            for j in range(k, self.micro_per_epoch):
                chunk = perm[j * bs * world : (j + 1) * bs * world]
                yield chunk[rank * bs : (rank + 1) * bs].tolist()
            micro_step = (epoch + 1) * self.micro_per_epoch

    def _loader(self, micro_step: int):
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=self._batches_from(micro_step), collate_fn=self.collate_fn,
            num_workers=self.args.num_workers,
        )
        return iter(loader)

    def _anchor_generators(self, micro_step: int) -> list[torch.Generator]:
        """One generator per local row, seeded by ``(seed, micro_step, row of the global batch)``: a sequence gets the
        same anchors whether the global batch runs on one process or is split over many."""
        bs, rank = self.args.batch_size, self.accelerator.process_index
        seeds = [((self.args.seed * 1_000_003 + micro_step) * 1009 + rank * bs + i) % (2**63) for i in range(bs)]
        return [torch.Generator().manual_seed(seed) for seed in seeds]

    def _global_mean(self, loss: torch.Tensor, metrics: dict[str, Any]) -> torch.Tensor:
        """The loss as a share of the whole global micro-batch's: ``local_sum * world / global_weight``.

        Gradients are averaged over processes, so this makes a step equal to one process's step over the same global
        batch (the weighted mean over all of its labels), whatever the number of processes."""
        acc = self.accelerator
        if acc.num_processes == 1 or "loss_weight" not in metrics:
            return loss
        local = metrics["loss_weight"].detach().to(device=acc.device, dtype=torch.float64).reshape(1)
        total = acc.reduce(local.clone(), reduction="sum")
        return loss * (local * acc.num_processes / total.clamp_min(1e-12)).to(loss.dtype).reshape(())

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        return write_checkpoint(self.accelerator, self.model, self.optimizer, dataclasses.asdict(self.state),
                                self.out_dir, self.args.keep_checkpoints)

    def load_checkpoint(self, path: Path) -> None:
        self.state = _State(**read_checkpoint(self.accelerator, self.model, self.optimizer, path))
        # a schedule a time budget fit goes on as it was fit (a resumed run gets no second fit)
        self._reschedule(self.state.total_steps or self.step_cap)
        if self.accelerator.is_main_process:
            truncate_log(self.out_dir / LOG_FILE, self.state.step)

    def _log(self, record: dict[str, Any]) -> None:
        if self.accelerator.is_main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with (self.out_dir / LOG_FILE).open("a") as handle:
                handle.write(json.dumps(record) + "\n")

    # --- evaluation ----------------------------------------------------------------------------------------------
    def evaluate(self, limit: int | None = -1) -> dict[str, Any]:
        if self.eval_fn is None:
            return {}
        result: dict[str, Any] = {}
        if self.accelerator.is_main_process:
            drafter = self.accelerator.unwrap_model(self.model).drafter
            result = self.eval_fn(drafter) if limit == -1 else self.eval_fn(drafter, limit=limit)
        self.accelerator.wait_for_everyone()
        return result

    def _periodic_evaluation(self, record: dict[str, Any]) -> float:
        """Every ``eval_every`` steps (not the last): evaluate, add the result to ``record``; its seconds."""
        args, step = self.args, self.state.step
        if not (args.eval_every and step % args.eval_every == 0 and step < self.total_steps):
            return 0.0
        result = self.evaluate()
        if result:
            self.state.last_eval = {"step": step, **result}
            record.update(result)
            self.accelerator.print(f"[hf-retrace] step {step}: tau {result['tau']:.3f} on "
                                   f"{result['eval_prompts']} prompts ({result['eval_seconds']:.0f} s)")
        return result.get("eval_seconds", 0.0)

    def _starting_evaluation(self) -> float:
        """With periodic evaluations, τ of the drafter the run starts from, logged as step 0 (the learning curve's
        origin: a fine-tuned drafter's starting point, a fresh one's ~1); a log left by a start killed before its
        first checkpoint is cleared first. Its seconds (0 without one)."""
        if self.accelerator.is_main_process:
            truncate_log(self.out_dir / LOG_FILE, -1)
        if not (self.args.eval_every and self.eval_fn is not None):
            return 0.0
        result = self.evaluate()
        if result:
            self._log({"step": 0, "tokens": 0, "labels": 0, "seconds": 0.0, **result})
            self.accelerator.print(f"[hf-retrace] step 0: tau {result['tau']:.3f} on {result['eval_prompts']} prompts "
                                   f"({result['eval_seconds']:.0f} s), before training")
        return result.get("eval_seconds", 0.0)

    # --- a time budget -------------------------------------------------------------------------------------------
    def _agreed(self, value: float, largest: bool) -> float:
        """The largest (or smallest) of ``value`` over every process: decisions that end or reshape the loop must be
        the same on all of them."""
        if self.accelerator.num_processes == 1:
            return value
        values = self.accelerator.gather(torch.tensor([float(value)], device=self.accelerator.device))
        return float(values.max() if largest else values.min())

    def _fit_to_budget(self, budget: TimeBudget) -> None:
        """Fit the schedule to the steps the rest of ``budget`` holds at the speed measured so far (periodic
        evaluations priced at the latest one's seconds), at most ``step_cap``; recorded, so a resume keeps it."""
        per_step = budget.seconds_per_step()
        if self.args.eval_every and self.eval_fn is not None:
            per_step += budget.eval_seconds / self.args.eval_every
        more = int(BUDGET_SAFETY * max(budget.remaining(), 0.0) / max(per_step, 1e-9))
        total = int(self._agreed(min(self.step_cap, self.state.step + more), largest=False))
        self.state.total_steps = total
        self._reschedule(total)
        self.accelerator.print(
            f"[hf-retrace] time budget: {budget.seconds / 60:.1f} min, {per_step:.3g} s a step here: the schedule "
            f"now ends at step {total}" + (f" (the cap, --epochs / --max-steps: {self.step_cap})"
                                           if total == self.step_cap else f" (of {self.step_cap} without it)"))

    # --- the loop ------------------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Optimizer steps up to ``total_steps`` (from the latest checkpoint with ``resume``); the run's totals."""
        from tqdm.auto import tqdm

        acc, args = self.accelerator, self.args
        if args.resume:
            ckpt = latest_checkpoint(self.out_dir)
            if ckpt is not None:
                self.load_checkpoint(ckpt)
                acc.print(f"[hf-retrace] resumed from {ckpt} (step {self.state.step}/{self.total_steps})")
        if acc.is_main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        budget = TimeBudget(args.max_seconds, self._clock) if args.max_seconds else None
        eval_seconds = self._starting_evaluation() if self.state.step == 0 else 0.0
        fit_due = budget is not None and not self.state.total_steps
        if budget is not None:
            budget.loop_started(eval_seconds)
        stopped_by_budget = False
        self.model.train()
        batches = self._loader(self.state.micro_step)
        started = time.perf_counter()
        seconds_before = self.state.seconds
        tokens_start = self.state.tokens
        bar = tqdm(
            total=self.total_steps, initial=self.state.step, desc="train", unit="step",
            disable=not (args.progress and acc.is_main_process), mininterval=10, dynamic_ncols=True,
        )
        while self.state.step < self.total_steps:
            sums = self._accumulate(batches)
            loss_value, acc_all, acc_slot = self._reduce_step(sums)
            elapsed = time.perf_counter() - started
            self.state.seconds = seconds_before + elapsed
            tok_s = (self.state.tokens - tokens_start) / max(elapsed, 1e-9)
            record = {
                "step": self.state.step, "loss": loss_value, "acc": acc_all, "tau_proxy": tau_proxy(torch.tensor(acc_slot)),
                "lr": self.scheduler.get_last_lr()[0],
                "grad_norm": float(sums.grad_norm) if sums.grad_norm is not None else None,
                "tokens": self.state.tokens, "labels": self.state.labels, "tok_s": tok_s,
                "seconds": self.state.seconds, "acc_slot": [round(a, 4) for a in acc_slot],
            }
            eval_seconds = self._periodic_evaluation(record)
            started += eval_seconds  # keep tok/s about training
            if budget is not None:
                budget.step_done(eval_seconds)
                if fit_due and budget.fit_ready():
                    self._fit_to_budget(budget)
                    fit_due = False
                    bar.total = self.total_steps
            if self.state.step % args.log_every == 0 or "tau" in record:
                self._log(record)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", acc=f"{acc_all:.3f}", tok_s=f"{tok_s:.0f}", refresh=False)
            if args.save_every and self.state.step % args.save_every == 0 and self.state.step < self.total_steps:
                self.save_checkpoint()
            if (budget is not None and self.state.step < self.total_steps
                    and self._agreed(budget.remaining() <= 0, largest=True)):
                stopped_by_budget = True
                break
        bar.close()
        latest = latest_checkpoint(self.out_dir)
        if self.state.step and (latest is None or latest.name != f"step-{self.state.step}"):
            self.save_checkpoint()
        if stopped_by_budget:
            acc.print(f"[hf-retrace] the time budget ({args.max_seconds / 60:.1f} min) ran out at step "
                      f"{self.state.step} of {self.total_steps}, before the schedule's end; a checkpoint is saved and "
                      f"--resume goes on with the same schedule")
        return {"steps": self.state.step, "tokens": self.state.tokens, "labels": self.state.labels,
                "seconds": self.state.seconds, "last_eval": self.state.last_eval, "total_steps": self.total_steps,
                "stopped_by_time_budget": stopped_by_budget}

    def _accumulate(self, batches: Iterator[dict[str, Any]]) -> _StepSums:
        """One optimizer step on this process: ``grad_accum`` micro-batches, then clip, step, schedule, zero."""
        acc, args = self.accelerator, self.args
        block = getattr(self.objective.drafter.config, "block_size", 16)
        sums = _StepSums(slot_correct=torch.zeros(block - 1), slot_counts=torch.zeros(block - 1))
        for _ in range(args.grad_accum):
            batch = _to_device(next(batches), acc.device)
            if self.feature_fn is not None:
                batch = self.feature_fn(batch)
            rows = batch["input_ids"].shape[0]
            batch["anchor_generator"] = self._anchor_generators(self.state.micro_step)[:rows]
            with acc.accumulate(self.model):
                loss, metrics = self.model(batch)
                loss = self._global_mean(loss, metrics)
                acc.backward(loss)
                if acc.sync_gradients:
                    sums.grad_norm = acc.clip_grad_norm_(self.trainable_params, args.max_grad_norm)
                self.optimizer.step()
                if acc.sync_gradients:
                    self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
            self.state.micro_step += 1
            sums.loss += float(loss.detach()) / args.grad_accum
            sums.slot_correct += metrics["slot_correct"].float().cpu()
            sums.slot_counts += metrics["slot_counts"].float().cpu()
            sums.tokens += int(metrics["num_tokens"])
            sums.labels += int(metrics["num_labels"])
        return sums

    def _reduce_step(self, sums: _StepSums) -> tuple[float, float, list[float]]:
        """Sum one step over processes into the state; its loss, acceptance and per-slot acceptance."""
        acc = self.accelerator
        totals = torch.tensor([sums.loss, sums.tokens, sums.labels], dtype=torch.float64, device=acc.device)
        totals = acc.reduce(totals, reduction="sum")
        per_slot = acc.reduce(torch.stack([sums.slot_correct, sums.slot_counts]).to(acc.device), reduction="sum").cpu()
        self.state.step += 1
        self.state.tokens += int(totals[1])
        self.state.labels += int(totals[2])
        acc_slot = (per_slot[0] / per_slot[1].clamp_min(1)).tolist()
        acc_all = float(per_slot[0].sum() / per_slot[1].sum().clamp_min(1))
        return float(totals[0]) / acc.num_processes, acc_all, acc_slot

    def finish(self, teardown_timeout: float | None = TEARDOWN_TIMEOUT_S) -> None:
        """Wait for every process, then tear the process group down: a process that left while another still held
        a gloo connection aborted (``terminate called without an active exception``).

        Call it last: with several processes, a teardown still running after ``teardown_timeout`` seconds (gloo's
        ``destroy_process_group`` now and then never returns: pytorch/pytorch#75097) ends this process with exit
        status 0 and a warning, instead of a run whose every output is written hanging forever. ``None`` waits."""
        self.accelerator.wait_for_everyone()
        if self.accelerator.num_processes == 1 or teardown_timeout is None:
            self.accelerator.end_training()
            return
        exit_if_still_running(self.accelerator.end_training, teardown_timeout,
                              "[hf-retrace] warning: the process group's teardown hung (pytorch/pytorch#75097) after "
                              "every output was written; this process exits now.")

    def unwrapped_drafter(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model).drafter

    def save_drafter(self, out_dir: str | os.PathLike[str] | None = None, dtype: str | None = None) -> Path:
        """``save_pretrained`` of the drafter (safetensors) in ``dtype`` (default ``args.save_dtype``)."""
        out = Path(out_dir or self.out_dir)
        dtype = dtype or self.args.save_dtype
        if self.accelerator.is_main_process:
            drafter = self.unwrapped_drafter()
            original = next(drafter.parameters()).dtype
            save_in_dtype(drafter, out, dtype)
            drafter.to(original)
        self.accelerator.wait_for_everyone()
        return out
