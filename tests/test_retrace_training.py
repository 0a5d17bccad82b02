"""The ReTrace training stage: exact verification signals, alignment with the next block, fusion-only training."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_drafter, tiny_target

from hf_retrace.training.feature_dataset import FeatureDataset
from hf_retrace.training.retrace_stage import ReTraceObjective
from hf_retrace.training.trainer import Trainer, TrainingArguments, retrace_parameters


@pytest.fixture(scope="module")
def models():
    target = tiny_target(family="llama", seed=0, dtype=torch.float32, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=5, retrace="untrained", dtype=torch.float32)
    return target, drafter


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 95, (2, 30), generator=gen)
    loss_mask = torch.zeros(2, 30, dtype=torch.bool)
    loss_mask[:, 8:] = True
    attention_mask = torch.ones(2, 30, dtype=torch.long)
    attention_mask[1, 25:] = 0
    return dict(input_ids=ids, loss_mask=loss_mask, attention_mask=attention_mask,
                anchor_generator=torch.Generator().manual_seed(seed))


def test_exact_verification_equals_a_target_forward_per_anchor(models):
    """All blocks of a sequence are verified in one forward (block-causal 4D mask on the sequence's cache)."""
    target, drafter = models
    objective = ReTraceObjective(drafter, target, num_anchors=4)
    batch = _batch()
    first = objective._first_pass(batch)
    checked = 0
    for row in range(2):
        for j in range(first["anchors"].shape[1]):
            if not first["anchor_valid"][row, j]:
                continue
            s = int(first["anchors"][row, j])
            sequence = torch.cat([batch["input_ids"][row, : s + 1], first["drafts"][row, j]])[None]
            with torch.no_grad():
                out = target(sequence, output_hidden_states=True)
            probs = out.logits[0, s : s + 4].softmax(-1)  # row s+j-1 predicts position s+j
            p, t = probs.max(-1)
            assert torch.equal(t, first["target_tokens"][row, j])
            torch.testing.assert_close(p, first["target_probs"][row, j], rtol=1e-4, atol=1e-5)
            rows = torch.cat([out.hidden_states[i + 1][0, s + 1 : s + 5] for i in drafter.config.target_layer_ids], -1)
            torch.testing.assert_close(first["target_features"][row, j], drafter.project_context(rows),
                                       rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 4


def test_next_block_starts_after_the_correction_and_keeps_the_rest():
    b, n_blocks, block = 1, 2, 5
    first = {
        "accepted": torch.tensor([[1, 4]]),  # block 0: n=1 -> keep slots 3,4; block 1: all 4 accepted -> nothing
        "anchors": torch.tensor([[10, 20]]),
        "drafter_hidden": torch.arange(b * n_blocks * 4 * 2, dtype=torch.float32).view(b, n_blocks, 4, 2),
        "drafts": torch.tensor([[[1, 2, 3, 4], [5, 6, 7, 8]]]),
        "target_tokens": torch.tensor([[[1, 9, 3, 9], [5, 6, 7, 8]]]),
        "target_probs": torch.full((b, n_blocks, 4), 0.5),
        "target_features": torch.zeros(b, n_blocks, 4, 2),
    }
    next_anchors, aligned = ReTraceObjective.align_next_block(first, block)
    assert next_anchors.tolist() == [[12, 25]]
    # block 0: old slots 3, 4 (positions 13, 14) land on new slots 1, 2 of the block anchored at 12
    assert aligned.valid.tolist() == [[True, True, False, False], [False, False, False, False]]
    assert aligned.rejected_tokens[0].tolist() == [3, 4, 0, 0]
    assert torch.equal(aligned.drafter_hidden[0, :2], first["drafter_hidden"][0, 0, 2:])


def test_fusion_stage_trains_only_retrace_and_lowers_its_loss(models, tmp_path):
    target, _ = models
    drafter = tiny_drafter(target, block_size=5, retrace="untrained", dtype=torch.float32, seed=3)
    backbone = {k: v.clone() for k, v in drafter.state_dict().items() if not k.startswith("retrace.")}
    objective = ReTraceObjective(drafter, target, num_anchors=6)
    # the target's own greedy answers, as in real drafter data: its verdict on rejected drafts is informative
    prompt = torch.randint(0, 95, (1, 8), generator=torch.Generator().manual_seed(1))
    sequence = target.generate(prompt, max_new_tokens=22, do_sample=False)[0]
    items = [{"input_ids": sequence, "loss_mask": torch.arange(30) >= 8}] * 8

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return len(items)

        def __getitem__(self, i):
            return dict(items[i])

        def sequence_lengths(self):
            return [30] * len(items)

    args = TrainingArguments(out_dir=str(tmp_path), batch_size=1, grad_accum=1, lr=1e-2, max_steps=40,
                             progress=False, save_every=0, warmup_ratio=0.0)
    trainer = Trainer(objective, FeatureDataset(Items()), args, param_filter=retrace_parameters)
    assert all(name.startswith("retrace.") for name in trainer.trainable_names)
    trainer.train()
    import json

    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert sum(r["loss"] for r in log[-5:]) / 5 < 0.6 * sum(r["loss"] for r in log[:5]) / 5
    for key, value in drafter.state_dict().items():
        if key in backbone:
            assert torch.equal(value, backbone[key]), f"backbone weight {key} changed"
    assert drafter.retrace.output_projection.weight.abs().sum() > 0
    assert drafter.config.retrace == "trained"
