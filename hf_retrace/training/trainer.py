"""The training loop (one CPU, one GPU or many with ``accelerate launch``) and the drafter's initialisation.

The loop is stage-agnostic: it trains whatever ``objective`` module it is given (``forward(batch) -> (loss,
metrics)``, with the drafter at ``objective.drafter``), only the drafter weights that ``param_filter(name)`` selects
(names relative to the drafter, e.g. ``layers.0.mlp.up_proj.weight``, ``retrace.gate.weight``). The DFlash backbone
stage uses :class:`~hf_retrace.training.objective.DFlashObjective` with :func:`backbone_parameters`; a ReTrace
stage passes its own objective and :func:`retrace_parameters` (the backbone stays frozen) and reuses everything else:
data order, checkpoints, resume, logs, τ evaluation, saving.

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
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..configuration import ReTraceConfig, build_target_layer_ids, drafter_target_mismatches
from ..loading import torch_dtype
from ..stats import GenerationStats
from .features import collate_sequences
from .objective import tau_proxy

__all__ = [
    "TauEvaluator",
    "Trainer",
    "TrainingArguments",
    "backbone_parameters",
    "check_drafter_matches_target",
    "copy_target_layers",
    "init_from_target_statistics",
    "drafter_config_from_target",
    "latest_checkpoint",
    "retrace_parameters",
    "write_model_card",
]

CHECKPOINTS = "checkpoints"
CHECKPOINT_MODEL = "model.safetensors"
CHECKPOINT_OPTIMIZER = "optimizer.pt"  # tensors and numbers only: loaded with weights_only=True
TRAINER_STATE = "trainer_state.json"
LOG_FILE = "train_log.jsonl"
SUMMARY_FILE = "training_summary.json"
ADAMW_BETAS = (0.9, 0.95)


def backbone_parameters(name: str) -> bool:
    """The DFlash stage trains every drafter weight except the ReTrace module's."""
    return not name.startswith("retrace.")


def retrace_parameters(name: str) -> bool:
    """The ReTrace stage trains only ``retrace.*`` (backbone frozen)."""
    return name.startswith("retrace.")


# ---------------------------------------------------------------------------------------------------------------
# Initialisation
# ---------------------------------------------------------------------------------------------------------------


def _rope_theta(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    if theta is None:
        theta = getattr(config, "rope_theta", None)
    return float(theta if theta is not None else 10000.0)


def drafter_config_from_target(
    target_config: Any,
    *,
    num_hidden_layers: int = 3,
    block_size: int = 16,
    num_target_features: int = 5,
    target_layer_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    retrace: bool = False,
) -> ReTraceConfig:
    """A drafter config shaped like the target (hidden size, heads, head_dim, FFN, vocab, RoPE theta).

    ``target_layer_ids`` defaults to ``build_target_layer_ids(L, num_target_features)``. Without ``mask_token_id``
    the drafter owns a learned mask vector (``learned_mask_embedding=True``).
    """
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    num_layers = text.num_hidden_layers
    ids = list(target_layer_ids) if target_layer_ids is not None else build_target_layer_ids(num_layers, num_target_features)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return ReTraceConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        head_dim=head_dim,
        hidden_act=getattr(text, "hidden_act", "silu"),
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(text),
        max_position_embeddings=getattr(text, "max_position_embeddings", 40960),
        attention_bias=bool(getattr(text, "attention_bias", False)),
        block_size=block_size,
        mask_token_id=mask_token_id,
        learned_mask_embedding=mask_token_id is None,
        target_layer_ids=ids,
        num_target_layers=num_layers,
        retrace=retrace,
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
    )


def check_drafter_matches_target(drafter_config: ReTraceConfig, target_config: Any, target_name: str = "the target") -> None:
    """Raise a ValueError (what differs, what to do) when the drafter cannot be trained for this target."""
    problems = drafter_target_mismatches(drafter_config, target_config)
    if problems:
        raise ValueError(
            f"The drafter does not match {target_name}: " + "; ".join(problems) + ". A DFlash drafter borrows the "
            "target's embeddings, lm_head and hidden states: initialise from scratch for this target, or use a "
            "drafter trained for it."
        )


@torch.no_grad()
def init_from_target_statistics(drafter: nn.Module, target: nn.Module) -> None:
    """Start a fresh drafter's learned mask vector at the scale of the target's embedding rows.

    The block's slot 0 is a real token embedding (elementwise std ~0.14 for SmolLM2) and its MASK slots must live in
    the same residual-stream scale, not at the generic 0.02. (The final ``norm`` keeps weight 1: copying the target's
    final-norm weight, ~1.8 for SmolLM2, makes the random initial logits hotter and the first loss higher.)
    """
    if getattr(drafter, "mask_embedding", None) is not None:
        std = target.get_input_embeddings().weight.float().std().item()
        drafter.mask_embedding.normal_(mean=0.0, std=std)


_LAYER_KEYS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)


@torch.no_grad()
def copy_target_layers(drafter: nn.Module, target: nn.Module, source_layers: Sequence[int] | None = None) -> dict[int, int]:
    """Initialise drafter layer ``i`` from target decoder layer ``source_layers[i]`` (Llama/Qwen weight names).

    Default source: the target's last ``num_hidden_layers`` layers. Weights the target layer lacks (e.g. the
    drafter's q/k norms for a Llama target) keep their fresh initialisation. Returns ``{drafter_i: target_j}``.
    """
    from ..generation.target_features import decoder_layers

    layers = decoder_layers(target)
    n = len(drafter.layers)
    if source_layers is None:
        source_layers = list(range(len(layers) - n, len(layers)))
    source_layers = list(source_layers)
    if len(source_layers) != n:
        raise ValueError(f"copy_target_layers: {len(source_layers)} source layers for {n} drafter layers.")
    bad = [j for j in source_layers if not 0 <= j < len(layers)]
    if bad:
        raise ValueError(f"copy_target_layers: target layers {bad} do not exist (the target has {len(layers)}).")
    for i, j in enumerate(source_layers):
        src = layers[j].state_dict()
        dst = drafter.layers[i].state_dict()
        for key in _LAYER_KEYS:
            if key in src and key in dst:
                if src[key].shape != dst[key].shape:
                    raise ValueError(f"copy_target_layers: {key} has shape {tuple(src[key].shape)} in the target, "
                                     f"{tuple(dst[key].shape)} in the drafter.")
                dst[key].copy_(src[key].to(dst[key].dtype))
    return dict(enumerate(source_layers))


# ---------------------------------------------------------------------------------------------------------------
# τ evaluation through real generate
# ---------------------------------------------------------------------------------------------------------------


class TauEvaluator:
    """Measures τ with REAL ``target.generate(ids, assistant_model=drafter, do_sample=False)`` on held-out prompts.

    ``prompts`` are token-id lists (already chat-templated). τ is the DFlash protocol's: the mean over prompts of
    each call's ``drafter.last_stats.mean_acceptance_length``. ``limit`` evaluates only the first prompts (cheap
    periodic evals); ``evaluate(drafter, limit=None)`` runs them all.
    """

    def __init__(self, target: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                 limit: int | None = None):
        import hf_retrace  # noqa: F401  (installs the generate hook)

        if not prompts:
            raise ValueError("TauEvaluator needs at least one prompt.")
        self.target = target
        self.prompts = [list(map(int, p)) for p in prompts]
        self.max_new_tokens = max_new_tokens
        self.limit = limit

    @torch.no_grad()
    def __call__(self, drafter: nn.Module, limit: int | None = -1) -> dict[str, Any]:
        limit = self.limit if limit == -1 else limit
        prompts = self.prompts[:limit] if limit else self.prompts
        was_training = drafter.training
        drafter.eval()
        device = next(self.target.parameters()).device
        all_stats = []
        started = time.perf_counter()
        try:
            for ids in prompts:
                input_ids = torch.tensor([ids], device=device)
                pad = self.target.generation_config.pad_token_id
                if pad is None:
                    pad = self.target.generation_config.eos_token_id
                    pad = pad[0] if isinstance(pad, (list, tuple)) else pad
                self.target.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=drafter,
                    max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=pad,
                )
                if drafter.last_stats is not None:
                    all_stats.append(drafter.last_stats)
        finally:
            drafter.train(was_training)
        pooled = GenerationStats.pooled(all_stats)
        return {
            "tau": GenerationStats.mean_tau_per_request(all_stats) or 0.0,
            "tau_pooled": pooled.mean_acceptance_length,
            "eval_prompts": len(prompts),
            "eval_rounds": pooled.rounds,
            "eval_seconds": time.perf_counter() - started,
        }


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------


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


def _lr_lambda(total_steps: int, warmup_steps: int, min_ratio: float) -> Callable[[int], float]:
    def schedule(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return schedule


def _fsync_folder(folder: Path) -> None:
    """Flush every file of ``folder`` and the folder itself, so a rename after it never exposes torn files."""
    for path in folder.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_checkpoint(out_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete ``out_dir/checkpoints/step-N`` (it holds ``trainer_state.json``), or None."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    found = []
    for path in root.iterdir():
        match = re.fullmatch(r"step-(\d+)", path.name)
        if match and (path / TRAINER_STATE).is_file():
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


class Trainer:
    """Trains ``objective.drafter`` (weights selected by ``param_filter``) with ``accelerate``.

    * ``train_dataset`` items are dicts for ``collate_fn`` (default: right-padded ``input_ids``/``loss_mask`` plus
      precomputed ``target_hidden`` when the items carry it).
    * ``feature_fn(batch) -> batch`` adds what the dataset lacks (e.g. :class:`OnlineFeatures`); it runs on the
      device, before the objective, without grad.
    * ``eval_fn(drafter) -> dict`` runs every ``eval_every`` steps and at the end, on the main process
      (e.g. :class:`TauEvaluator`).

    Data order is a pure function of ``(seed, micro_step)``: a fresh permutation per epoch, sharded over processes;
    anchors are drawn from a generator seeded by ``(seed, micro_step, process)``. With model, optimizer, scheduler
    and RNG states in ``checkpoints/step-N`` (``accelerator.save_state``), a resumed run continues exactly where
    the killed one was.
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
        drafter = objective.drafter
        trainable = []
        for name, param in drafter.named_parameters():
            keep = bool(param_filter(name))
            param.requires_grad_(keep)
            if keep:
                trainable.append(param)
        if not trainable:
            raise ValueError("param_filter selects no drafter weight: nothing to train.")
        self.trainable_names = [n for n, p in drafter.named_parameters() if p.requires_grad]
        world = self.accelerator.num_processes
        self.micro_per_epoch = len(train_dataset) // (args.batch_size * world)
        if self.micro_per_epoch == 0:
            raise ValueError(
                f"The dataset has {len(train_dataset)} sequences, fewer than one global batch "
                f"({args.batch_size} x {world} processes)."
            )
        steps_per_epoch = self.micro_per_epoch / args.grad_accum
        self.total_steps = int(args.max_steps) if args.max_steps else max(1, int(args.epochs * steps_per_epoch))
        self.warmup_steps = int(math.ceil(args.warmup_ratio * self.total_steps))
        optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay, betas=ADAMW_BETAS)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, _lr_lambda(self.total_steps, self.warmup_steps, args.min_lr_ratio)
        )
        self.model, self.optimizer = self.accelerator.prepare(objective, optimizer)
        # the schedule is a pure function of the step: restored from trainer_state.json, never pickled
        self.state = _State()
        self.trainable_params = trainable

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
        acc = self.accelerator
        root = self.out_dir / CHECKPOINTS
        final = root / f"step-{self.state.step}"
        tmp = root / f"step-{self.state.step}.tmp"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            root.mkdir(parents=True, exist_ok=True)
        acc.wait_for_everyone()
        if acc.is_main_process:  # weights and optimizer are replicated across processes: one copy, no pickle
            from safetensors.torch import save_file

            tmp.mkdir(parents=True, exist_ok=True)
            model_state = acc.unwrap_model(self.model).state_dict()
            save_file({k: v.detach().contiguous() for k, v in model_state.items()}, str(tmp / CHECKPOINT_MODEL))
            torch.save(self.optimizer.state_dict(), tmp / CHECKPOINT_OPTIMIZER)
            (tmp / TRAINER_STATE).write_text(json.dumps(dataclasses.asdict(self.state), indent=2))
            _fsync_folder(tmp)
            shutil.rmtree(final, ignore_errors=True)
            tmp.replace(final)
            kept = sorted(
                (int(m.group(1)), p) for p in root.iterdir() if (m := re.fullmatch(r"step-(\d+)", p.name))
            )
            for _, old in kept[: -self.args.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return final

    def load_checkpoint(self, path: Path) -> None:
        import warnings

        from safetensors.torch import load_file

        self.accelerator.unwrap_model(self.model).load_state_dict(load_file(str(path / CHECKPOINT_MODEL)))
        optimizer_file = path / CHECKPOINT_OPTIMIZER
        if not optimizer_file.exists():
            optimizer_file = path / "optimizer.bin"  # checkpoints written by accelerate's save_state
        self.optimizer.load_state_dict(torch.load(optimizer_file, map_location="cpu", weights_only=True))
        self.state = _State(**json.loads((path / TRAINER_STATE).read_text()))
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended, nothing is skipped
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.last_epoch = self.state.step - 1
            self.scheduler.step()
        self._truncate_log(self.state.step)

    def _truncate_log(self, step: int) -> None:
        """Drop log lines of steps after the checkpoint (they will be redone)."""
        path = self.out_dir / LOG_FILE
        if not self.accelerator.is_main_process or not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a kill mid-write: drop it
                continue
            if record.get("step", 0) <= step:
                kept.append(line)
        path.write_text("".join(line + "\n" for line in kept))

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

    # --- the loop ------------------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        acc, args = self.accelerator, self.args
        if args.resume:
            ckpt = latest_checkpoint(self.out_dir)
            if ckpt is not None:
                self.load_checkpoint(ckpt)
                acc.print(f"[hf-retrace] resumed from {ckpt} (step {self.state.step}/{self.total_steps})")
        if acc.is_main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.model.train()
        batches = self._loader(self.state.micro_step)
        started = time.perf_counter()
        seconds_before = self.state.seconds
        tokens_start = self.state.tokens
        bar = tqdm(
            total=self.total_steps, initial=self.state.step, desc="train", unit="step",
            disable=not (args.progress and acc.is_main_process), mininterval=10, dynamic_ncols=True,
        )
        block = getattr(self.objective.drafter.config, "block_size", 16)
        while self.state.step < self.total_steps:
            sums: dict[str, Any] = {"loss": 0.0, "acc": 0.0}
            slot_correct = torch.zeros(block - 1)
            slot_counts = torch.zeros(block - 1)
            step_tokens = step_labels = 0
            grad_norm = None
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
                        grad_norm = acc.clip_grad_norm_(self.trainable_params, args.max_grad_norm)
                    self.optimizer.step()
                    if acc.sync_gradients:
                        self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                self.state.micro_step += 1
                sums["loss"] += float(loss.detach()) / args.grad_accum
                slot_correct += metrics["slot_correct"].float().cpu()
                slot_counts += metrics["slot_counts"].float().cpu()
                step_tokens += int(metrics["num_tokens"])
                step_labels += int(metrics["num_labels"])
            # totals over processes
            totals = torch.tensor([sums["loss"], step_tokens, step_labels], dtype=torch.float64, device=acc.device)
            totals = acc.reduce(totals, reduction="sum")
            per_slot = acc.reduce(torch.stack([slot_correct, slot_counts]).to(acc.device), reduction="sum").cpu()
            loss_value = float(totals[0]) / acc.num_processes
            acc_slot = (per_slot[0] / per_slot[1].clamp_min(1)).tolist()
            acc_all = float(per_slot[0].sum() / per_slot[1].sum().clamp_min(1))
            self.state.step += 1
            self.state.tokens += int(totals[1])
            self.state.labels += int(totals[2])
            elapsed = time.perf_counter() - started
            self.state.seconds = seconds_before + elapsed
            tok_s = (self.state.tokens - tokens_start) / max(elapsed, 1e-9)
            record = {
                "step": self.state.step, "loss": loss_value, "acc": acc_all, "tau_proxy": tau_proxy(torch.tensor(acc_slot)),
                "lr": self.scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens": self.state.tokens, "labels": self.state.labels, "tok_s": tok_s,
                "seconds": self.state.seconds, "acc_slot": [round(a, 4) for a in acc_slot],
            }
            if args.eval_every and self.state.step % args.eval_every == 0 and self.state.step < self.total_steps:
                result = self.evaluate()
                if result:
                    self.state.last_eval = {"step": self.state.step, **result}
                    record.update(result)
                    acc.print(f"[hf-retrace] step {self.state.step}: tau {result['tau']:.3f} on "
                              f"{result['eval_prompts']} prompts ({result['eval_seconds']:.0f} s)")
                started += result.get("eval_seconds", 0.0)  # keep tok/s about training
            if self.state.step % args.log_every == 0 or "tau" in record:
                self._log(record)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", acc=f"{acc_all:.3f}", tok_s=f"{tok_s:.0f}", refresh=False)
            if args.save_every and self.state.step % args.save_every == 0 and self.state.step < self.total_steps:
                self.save_checkpoint()
        bar.close()
        if self.state.step and (latest_checkpoint(self.out_dir) is None
                                or latest_checkpoint(self.out_dir).name != f"step-{self.state.step}"):
            self.save_checkpoint()
        return {"steps": self.state.step, "tokens": self.state.tokens, "labels": self.state.labels,
                "seconds": self.state.seconds, "last_eval": self.state.last_eval}

    def unwrapped_drafter(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model).drafter

    def save_drafter(self, out_dir: str | os.PathLike[str] | None = None, dtype: str | None = None) -> Path:
        """``save_pretrained`` of the drafter (safetensors) in ``dtype`` (default ``args.save_dtype``)."""
        out = Path(out_dir or self.out_dir)
        dtype = dtype or self.args.save_dtype
        if self.accelerator.is_main_process:
            drafter = self.unwrapped_drafter()
            original = next(drafter.parameters()).dtype
            _save_as(drafter, out, dtype)
            drafter.to(original)
        self.accelerator.wait_for_everyone()
        return out


def export_checkpoint(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                      checkpoint: str | os.PathLike[str] | None = None, dtype: str = "bfloat16") -> Path:
    """Save the drafter of a run's checkpoint (default: the latest) as a ``from_pretrained`` folder.

    For a run stopped before its end (killed, or cut short on purpose): the architecture comes from the run's
    ``drafter_init.json``, the weights from ``checkpoints/step-N/model.safetensors``.
    """
    from safetensors.torch import load_file

    from ..modeling import ReTraceDrafter

    run_dir = Path(run_dir)
    checkpoint = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir)
    if checkpoint is None:
        raise FileNotFoundError(f"{run_dir} has no complete checkpoint to export.")
    config = ReTraceConfig.from_dict(json.loads((run_dir / "drafter_init.json").read_text())["config"])
    state = {k.removeprefix("drafter."): v for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    if any(k.startswith("retrace.") for k in state):
        config.retrace = True
    drafter = ReTraceDrafter(config)
    drafter.load_state_dict(state, strict=True)
    _save_as(drafter, out_dir, dtype)
    return Path(out_dir)


def _save_as(drafter: nn.Module, out_dir: str | os.PathLike[str], dtype: str) -> None:
    """``save_pretrained`` (safetensors) with the weights and ``config.dtype`` in ``dtype`` (either spelling)."""
    drafter.to(torch_dtype(dtype))
    drafter.config.dtype = str(torch_dtype(dtype)).removeprefix("torch.")
    drafter.save_pretrained(out_dir, safe_serialization=True)


def write_model_card(out_dir: str | os.PathLike[str], info: dict[str, Any]) -> Path:
    """README.md for a trained drafter: target, data, tokens, steps, time, measured τ, how to use it."""
    out = Path(out_dir)
    tau = info.get("tau")
    lines = [
        "---",
        "library_name: hf-retrace",
        "tags: [speculative-decoding, dflash, retrace, drafter]",
        f"base_model: {info.get('target_hub_id') or info.get('target')}",
        "---",
        "",
        f"# DFlash drafter for {info.get('target_hub_id') or info.get('target')}",
        "",
        "A block drafter (DFlash architecture, hf_retrace format) for lossless speculative decoding with transformers.",
        "It owns no embeddings and no LM head: the target's are borrowed at run time.",
        "",
        "```python",
        "import hf_retrace, transformers",
        f"target = transformers.AutoModelForCausalLM.from_pretrained({info.get('target_hub_id') or info.get('target')!r})",
        "drafter = hf_retrace.ReTraceDrafter.from_pretrained(PATH_OR_REPO)",
        "out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256, do_sample=False)",
        "print(drafter.last_stats.mean_acceptance_length)",
        "```",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
    ]
    rows = [
        ("target", info.get("target")), ("data", info.get("data")), ("sequences", info.get("num_sequences")),
        ("tokens seen", info.get("tokens")), ("supervised draft slots", info.get("labels")),
        ("optimizer steps", info.get("steps")), ("wall time", info.get("time")), ("hardware", info.get("hardware")),
        ("stage", info.get("stage")), ("hyper-parameters", info.get("hyperparameters")),
        ("command", f"`{info['command']}`" if info.get("command") else None),
    ]
    lines += [f"| {k} | {v} |" for k, v in rows if v is not None]
    lines += ["", "## Measured acceptance length", ""]
    if tau is not None:
        lines.append(
            f"τ = **{tau:.3f}** (mean over {info.get('eval_prompts')} held-out prompts of committed tokens per target "
            f"forward, greedy, max_new_tokens={info.get('eval_max_new_tokens')}, measured with real "
            "`target.generate(..., assistant_model=drafter)`)."
        )
    else:
        lines.append("τ was not measured (no evaluation prompts were given).")
    lines += ["", "Objective: DFlash block-wise cross-entropy with random anchors, position decay exp(-(k-1)/γ).", ""]
    path = out / "README.md"
    path.write_text("\n".join(lines))
    return path
