"""Record the rounds a drafter ships (``round_records.json.gz``): what the round-policy tuner replays on each machine.

On held-out *training* prompts (never dev or benchmark prompts):

1. the target answers greedily (T=0) and by sampling (T=1, the pure tempered law of :func:`~hf_retrace.sampling.
   sampling_kwargs`); for every anchor of each answer, one teacher-forced pass records the drafter's full block and its
   top probabilities (:func:`record_answers`);
2. ``generate`` with sampled proposals (rejection sampling) and full blocks records real rounds, ``(slot
   confidences, accepted)``, for the proposal-mode choice at T>0.

Nothing here is timed: costs belong to the machine that runs the drafter and are measured there
(:mod:`hf_retrace.tuning`). Run it once per drafter, on any machine.

Example::

    records = record_round_records(target, drafter, prompt_ids, max_new_tokens=128)
    records.save("path/to/drafter")
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..generation.policy import RoundPolicy
from ..sampling import sampling_kwargs
from ..tuning.records import AnswerRecord, RoundRecords
from .features import collate_sequences, tapped_hidden_states
from .objective import DFlashObjective

__all__ = ["greedy_answer", "record_answers", "record_round_records"]


@torch.no_grad()
def record_answers(target: Any, drafter: Any, sequences: Iterable[dict[str, torch.Tensor]],
                   anchors_per_pass: int = 96) -> list[AnswerRecord]:
    """Teacher-forced drafts at every anchor of each answer (items of a tokenized dataset: ``input_ids``,
    ``loss_mask``; the answer is the loss-masked part)."""
    objective = DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings())
    device = next(drafter.parameters()).device
    records = []
    for item in sequences:
        batch = collate_sequences([item])
        length = int(batch["attention_mask"].sum())
        ids = batch["input_ids"][:, :length].to(device)
        answer = batch["loss_mask"][0, :length].nonzero()
        if len(answer) == 0 or int(answer[0]) >= length - 1:
            continue  # no answer token to draft after
        start = int(answer[0])
        features = tapped_hidden_states(target, ids, None, drafter.config.target_layer_ids).to(drafter.dtype)
        drafts, confidences = [], []
        for chunk in torch.arange(start, length - 1, device=device).split(anchors_per_pass):
            anchors = chunk[None]
            d, _, top = objective.backbone_drafts(ids, features, anchors, torch.ones_like(anchors, dtype=torch.bool))
            drafts += d[0].tolist()
            confidences += top[0].tolist()
        records.append(AnswerRecord(ids[0].tolist(), start, drafts, confidences))
    return records


def _answer_item(prompt: torch.Tensor, answer: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": answer[0].cpu(), "loss_mask": (torch.arange(answer.shape[1]) >= prompt.shape[1]).long()}


@torch.inference_mode()
def greedy_answer(target: Any, prompt: torch.Tensor, max_new_tokens: int) -> dict[str, torch.Tensor]:
    """The target's greedy answer to ``prompt`` (``[1, n]`` ids) as an item :func:`record_answers` reads."""
    return _answer_item(prompt, target.generate(prompt, **sampling_kwargs(0, max_new_tokens)))


@torch.inference_mode()
def record_round_records(target: Any, drafter: Any, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int = 128,
                         temperature: float = 1.0, seed: int = 0, progress: bool = True) -> RoundRecords:
    """Record ``drafter``'s rounds on ``prompt_ids`` (held-out training prompts): greedy and sampled answers with
    teacher-forced blocks, and full-block rounds with sampled proposals."""
    if not prompt_ids:
        raise ValueError("recording needs at least one prompt (held-out training prompts, never benchmark prompts).")
    device = target.get_input_embeddings().weight.device
    sampling = sampling_kwargs(temperature, max_new_tokens)
    # full blocks whose confidences are kept (cut 0: every slot is confident), no lookup, ReTrace off
    sampled_proposals = drafter.with_policy(RoundPolicy(confidence_cut=0.0, proposal_mode="sample", source="recording"))
    greedy, sampled, rounds = [], [], []
    for i, ids in enumerate(prompt_ids):
        prompt = torch.tensor([list(ids)], device=device)
        greedy.append(greedy_answer(target, prompt, max_new_tokens))
        torch.manual_seed(seed + i)
        sampled.append(_answer_item(prompt, target.generate(prompt, **sampling)))
        torch.manual_seed(seed + i)
        target.generate(prompt, assistant_model=sampled_proposals, **sampling)
        stats = sampled_proposals.last_stats
        rounds += [(list(c), length - 1) for c, length in zip(stats.slot_confidences, stats.acceptance_lengths)]
        if progress:
            print(f"[hf-retrace] recorded prompt {i + 1}/{len(prompt_ids)}", flush=True)
    return RoundRecords(
        block_size=drafter.config.block_size,
        greedy=record_answers(target, drafter, greedy),
        sampled=record_answers(target, drafter, sampled),
        sample_rounds=rounds,
        temperature=temperature,
        made_with={"prompts": len(prompt_ids), "max_new_tokens": max_new_tokens, "seed": seed,
                   "dtype": str(target.dtype).removeprefix("torch.")},
    )
