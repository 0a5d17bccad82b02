"""Training: the DFlash objective (no leakage), online vs precomputed features, resume, end to end with real tau.

Everything runs on tiny models (CPU, a few seconds each). The end-to-end target is itself trained first on a
counting pattern (token t+1 = token t + 1 mod 40), so its greedy continuation is deterministic and learnable.
"""

from __future__ import annotations

import argparse
import copy
import json

import numpy as np
import pytest
import torch
from helpers import ListDataset, tiny_drafter, tiny_target

import hf_retrace  # noqa: F401  (installs the generate hook)
from hf_retrace import ReTraceConfig, ReTraceDrafter
from hf_retrace.training.checkpoints import latest_checkpoint
from hf_retrace.training.drafter_init import check_drafter_matches_target, copy_target_layers, drafter_config_from_target
from hf_retrace.training.evaluation import TauEvaluator
from hf_retrace.training.feature_dataset import FeatureDataset
from hf_retrace.training.features import OnlineFeatures, collate_sequences, tapped_hidden_states
from hf_retrace.training.objective import (
    DFlashObjective,
    build_block_attention_mask,
    decay_weights,
    sample_anchors,
)
from hf_retrace.training.precomputed_features import PrecomputedFeatures, precompute_features, store_fits
from hf_retrace.training.trainer import Trainer, TrainingArguments, retrace_parameters

VOCAB, CYCLE, EOS, PAD = 48, 40, 47, 46



def counting(start: int, length: int) -> torch.Tensor:
    return (start + torch.arange(length)) % CYCLE


def tiny_llama(seed: int = 0, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def counting_target():
    """A tiny Llama trained (~1-2 s) until its greedy continuation counts: t -> t+1 mod 40."""
    target = tiny_llama()
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    for _ in range(120):
        starts = torch.randint(0, CYCLE, (32,), generator=gen)
        ids = torch.stack([counting(int(s), 24) for s in starts])
        loss = target(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    prompt = counting(7, 5)[None]
    out = target.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out[0, 5:], counting(12, 20)), "the tiny target did not learn to count"
    return target


def make_drafter(target, block_size=4, layers=2, seed=1, **kw) -> ReTraceDrafter:
    kw.setdefault("target_layer_ids", [0, 1, 2])
    config = drafter_config_from_target(target.config, num_hidden_layers=layers, block_size=block_size, **kw)
    torch.manual_seed(seed)
    return ReTraceDrafter(config).float()


def objective_for(target, drafter, **kw):
    return DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings(), **kw)


# --------------------------------------------------------------------------------------------------------------
# The objective's pieces
# --------------------------------------------------------------------------------------------------------------


def test_anchor_sampling_and_weights():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]).bool()
    lengths = torch.tensor([6, 3])
    anchors, valid = sample_anchors(loss_mask, lengths, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == valid.shape == (2, 4)
    # row 0: response positions 2..5, p+1 < 6 -> 2,3,4 ; row 1: 1 (2 is last)
    assert sorted(anchors[0][valid[0]].tolist()) == [2, 3, 4] and valid[0].sum() == 3
    assert anchors[1][valid[1]].tolist() == [1] and valid[1].sum() == 1
    w = decay_weights(16, 7.0)
    assert w[0] == 1.0 and torch.allclose(w[7], torch.exp(torch.tensor(-1.0)))


def test_mask_built_from_anchor_positions():
    anchors = torch.tensor([[3, 5]])  # 2 apart with B = 4: positions overlap (3..6 and 5..8)
    mask = build_block_attention_mask(anchors, torch.tensor([[True, True]]), context_length=10, block_size=4)
    assert mask.shape == (1, 1, 8, 18)
    m = mask[0, 0]
    assert m[:4, :3].all() and not m[:4, 3:10].any()  # block 0 sees context < 3 only
    assert m[4:, :5].all() and not m[4:, 5:10].any()  # block 1 sees context < 5 only
    assert m[:4, 10:14].all() and not m[:4, 14:].any()  # own block only
    assert m[4:, 14:].all() and not m[4:, 10:14].any()


def test_no_leakage_and_equivalence_with_inference(counting_target):
    """A block's prediction ignores features at/after its anchor and other blocks, and equals the inference forward."""
    target = counting_target
    drafter = make_drafter(target, block_size=4, layers=2).eval()
    obj = objective_for(target, drafter)
    ids = counting(3, 20)[None]
    th = tapped_hidden_states(target, ids, None, drafter.config.target_layer_ids)
    anchors = torch.tensor([[6, 8, 9, 13]])  # closer than B: the SpecForge leak case
    valid = torch.ones_like(anchors, dtype=torch.bool)

    def block_out(hidden, input_ids=ids):
        emb, pos, mask = obj.block_inputs(input_ids, anchors, valid, input_ids.shape[1])
        out = drafter(target_hidden=hidden, noise_embedding=emb, position_ids=pos, attention_mask=mask)
        return out.reshape(1, 4, 4, -1)

    with torch.no_grad():
        base = block_out(th)
        j, a = 1, 8  # block 1, anchor 8
        later = th.clone()
        later[:, a:] = torch.randn_like(later[:, a:]) * 10  # features at and after the anchor
        assert torch.allclose(block_out(later)[:, j], base[:, j], atol=1e-5)
        earlier = th.clone()
        earlier[:, a - 1] += 5.0
        assert not torch.allclose(block_out(earlier)[:, j], base[:, j], atol=1e-3)
        # other blocks' anchor tokens are invisible (block 2's anchor 9 sits inside block 1's positions)
        other = ids.clone()
        other[0, 9] = (other[0, 9] + 17) % CYCLE
        changed = block_out(th, other)
        assert torch.allclose(changed[:, j], base[:, j], atol=1e-5)
        assert not torch.allclose(changed[:, 2], base[:, 2], atol=1e-3)
        # equals the inference-time forward: context = features of positions < anchor, block at anchor..anchor+B-1
        block = drafter.block_embeddings(ids[:, a], target.get_input_embeddings())
        single = drafter(target_hidden=th[:, :a], noise_embedding=block, position_ids=torch.arange(a + 4)[None])
        assert torch.allclose(single, base[:, j], atol=1e-5)


def test_loss_only_on_response_positions(counting_target):
    target = counting_target
    drafter = make_drafter(target)
    obj = objective_for(target, drafter)
    ids = counting(0, 12)[None]
    loss_mask = torch.zeros(1, 12, dtype=torch.bool)
    loss_mask[0, 4:10] = True  # positions 10, 11 are not supervised
    th = tapped_hidden_states(target, ids, None, drafter.config.target_layer_ids)
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": torch.ones_like(ids), "target_hidden": th,
             "anchors": torch.tensor([[8, 0]]), "anchor_valid": torch.tensor([[True, False]])}
    loss, metrics = obj(batch)
    assert int(metrics["num_labels"]) == 1  # anchor 8: slot 1 -> 9 supervised; 10, 11 not
    assert int(metrics["num_blocks"]) == 1 and torch.isfinite(loss)


# --------------------------------------------------------------------------------------------------------------
# Features: online == precomputed
# --------------------------------------------------------------------------------------------------------------


def _dataset(n=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(10, 24, (n,), generator=gen)
    starts = torch.randint(0, CYCLE, (n,), generator=gen)
    return ListDataset([counting(int(s), int(L)) for s, L in zip(starts, lengths)])


def test_online_and_precomputed_features_give_the_same_loss(counting_target, tmp_path):
    target = counting_target
    data = _dataset()
    drafter = make_drafter(target)
    layer_ids = drafter.config.target_layer_ids
    manifest = precompute_features(target, data, tmp_path / "feats", layer_ids, shard_sequences=5,
                                   max_batch_tokens=40, progress=False)
    assert manifest["complete"] and len(manifest["shards"]) == 3
    # resumable: a second call returns at once with the same manifest
    assert precompute_features(target, data, tmp_path / "feats", layer_ids, shard_sequences=5,
                               progress=False)["shards"] == manifest["shards"]
    stored = FeatureDataset(data, PrecomputedFeatures(tmp_path / "feats"))
    obj = objective_for(target, drafter, num_anchors=6)
    online = OnlineFeatures(target, layer_ids)
    rows = [2, 7, 11]
    batch_pre = collate_sequences([stored[i] for i in rows])
    batch_on = online(collate_sequences([data[i] for i in rows]))
    real = batch_pre["attention_mask"].bool()  # padding rows are never read (context < anchor < length)
    assert torch.allclose(batch_pre["target_hidden"][real], batch_on["target_hidden"][real], atol=1e-5)
    loss_pre, _ = obj({**batch_pre, "anchor_generator": torch.Generator().manual_seed(3)})
    loss_on, _ = obj({**batch_on, "anchor_generator": torch.Generator().manual_seed(3)})
    assert abs(loss_pre.item() - loss_on.item()) < 1e-5


def test_features_of_a_dataset_that_grew_keep_their_shards_and_compute_the_rest(counting_target, tmp_path):
    target, layer_ids = counting_target, [0, 1, 2]
    full = _dataset(17)
    first = ListDataset([item["input_ids"] for item in full.items[:12]])
    out = tmp_path / "feats"
    before = precompute_features(target, first, out, layer_ids, shard_sequences=5, progress=False)
    assert [(s["start"], s["end"]) for s in before["shards"]] == [(0, 5), (5, 10), (10, 12)]
    stamps = {s["file"]: (out / s["file"]).stat().st_mtime_ns for s in before["shards"]}
    assert store_fits(before, full) is None  # the data grew after its first 12 sequences

    grown = precompute_features(target, full, out, layer_ids, shard_sequences=5, progress=False)
    assert grown["complete"] and [(s["start"], s["end"]) for s in grown["shards"]] == [(0, 5), (5, 10), (10, 15),
                                                                                         (15, 17)]
    kept = [(out / f).stat().st_mtime_ns == stamp for f, stamp in stamps.items()]
    assert kept == [True, True, False]  # the last, shorter shard is made again with the new sequences
    fresh = precompute_features(target, full, tmp_path / "fresh", layer_ids, shard_sequences=5, progress=False)
    assert grown["shards"] == fresh["shards"]
    stored, reference = PrecomputedFeatures(out), PrecomputedFeatures(tmp_path / "fresh")
    assert len(stored) == 17 and all(torch.allclose(stored[i], reference[i], atol=1e-5) for i in range(17))

    other = _dataset(17, seed=5)  # other sequences: refused, nothing changed
    assert "nor its first sequences" in store_fits(grown, other)
    same_lengths = ListDataset([(item["input_ids"] + 1) % CYCLE for item in full.items])
    assert "holds other sequences than this dataset's 0..4" in store_fits(grown, same_lengths)
    with pytest.raises(ValueError, match="features of other data"):
        precompute_features(target, other, out, layer_ids, shard_sequences=5, progress=False)
    with pytest.raises(ValueError, match=r"\['num_sequences'\] differ"):  # a store never shrinks
        precompute_features(target, first, out, layer_ids, shard_sequences=5, progress=False)
    assert json.loads((out / "features.json").read_text()) == grown


def test_bf16_features_are_stored_bit_exact(counting_target, tmp_path):
    target = tiny_llama(seed=3, layers=2).to(torch.bfloat16).eval()
    data = _dataset(4)
    # one sequence per forward (no padding), so the online reference has the very same shapes
    precompute_features(target, data, tmp_path / "f", [0, 1], max_batch_tokens=1, progress=False)
    stored = PrecomputedFeatures(tmp_path / "f")
    assert stored.torch_dtype is torch.bfloat16
    for i in range(4):
        ids = data[i]["input_ids"][None]
        assert torch.equal(stored[i], tapped_hidden_states(target, ids, None, [0, 1])[0])


def test_a_store_of_more_layers_gives_a_drafters_layers_bit_exact(tmp_path):
    """One features pass serves drafters that tap different layers: ``layers`` reads them, in the drafter's order,
    exactly as a store made for those layers alone holds them."""
    target = tiny_llama(seed=3, layers=3).to(torch.bfloat16).eval()
    data = _dataset(4)
    precompute_features(target, data, tmp_path / "f", [0, 1, 2], max_batch_tokens=1, progress=False)
    for layers in ([2, 0], [1], [0, 1, 2], [1, 1]):
        stored = PrecomputedFeatures(tmp_path / "f", layers=layers)
        assert stored.target_layer_ids == layers
        for i in range(4):
            ids = data[i]["input_ids"][None]
            assert torch.equal(stored[i], tapped_hidden_states(target, ids, None, layers)[0])
    with pytest.raises(ValueError, match=r"holds target layers \[0, 1, 2\], so it cannot give layers \[3, 0\] "
                                         r"\(\[3\]\).*--target-layer-ids"):
        PrecomputedFeatures(tmp_path / "f", layers=[3, 0])


def test_a_features_pass_removes_the_half_shard_a_killed_pass_left(tmp_path):
    """A kill (each session's end) skips the clean-up of the shard being written, a file as large as the shard: the
    next pass over the store removes it, and writes the shard whole."""
    from test_atomic import killed_writer

    target = tiny_llama(seed=3, layers=3).eval()
    (tmp_path / "f").mkdir()
    killed_writer(tmp_path / "f" / "features-00000.bin")
    assert len(list((tmp_path / "f").glob(".features-00000.bin.*.tmp.bin"))) == 1
    precompute_features(target, _dataset(4), tmp_path / "f", [0, 2], progress=False)
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["features-00000.bin", "features.json"]
    assert len(PrecomputedFeatures(tmp_path / "f")) == 4


def test_a_trained_drafter_given_more_target_layers_drafts_what_it_did(tmp_path):
    """set_target_layers: the input projection keeps each old layer's columns (moved to that layer's new place) and
    gains zero columns for the new layers, so the drafter's blocks are unchanged, in a forward and in real generate;
    layers it reads must stay, a ReTrace module refuses, and the grown drafter saves and loads as any other."""
    target = tiny_target(vocab_size=12, num_layers=4, seed=2, logit_scale=4.0)  # few tokens: some drafts accepted
    drafter = tiny_drafter(target, target_layer_ids=[2, 0], seed=3)
    with torch.no_grad():
        drafter.fc.weight.normal_(0, 0.3)  # every column of the old layers counts
    grown = copy.deepcopy(drafter)
    grown.set_target_layers([1, 0, 3, 2])
    assert grown.config.target_layer_ids == [1, 0, 3, 2] and grown.fc.in_features == 4 * target.config.hidden_size
    ids = torch.randint(0, 11, (1, 12), generator=torch.Generator().manual_seed(0))
    block = target.get_input_embeddings()(ids[:, :6])
    positions = torch.arange(12)[None]
    before = drafter(target_hidden=tapped_hidden_states(target, ids[:, :6], None, [2, 0]), noise_embedding=block,
                     position_ids=positions)
    after = grown(target_hidden=tapped_hidden_states(target, ids[:, :6], None, [1, 0, 3, 2]), noise_embedding=block,
                  position_ids=positions)
    torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-12)
    confidences = {}  # the drafter's top probability at every drafted slot of every round of a real generate
    for name, model in (("before", drafter), ("after", grown)):
        view = model.with_policy(confidence_cut=1e-9)  # the adaptive block records them, cuts nothing
        target.generate(ids, assistant_model=view, max_new_tokens=24, do_sample=False)
        confidences[name] = view.last_stats.slot_confidences
    assert [len(row) for row in confidences["after"]] == [len(row) for row in confidences["before"]]
    assert sum(len(row) == 5 for row in confidences["before"]) > 3  # whole blocks (the last ones end the call)
    torch.testing.assert_close(torch.tensor(sum(confidences["after"], [])),
                               torch.tensor(sum(confidences["before"], [])), rtol=1e-9, atol=1e-12)
    grown.save_pretrained(tmp_path / "grown")
    loaded = ReTraceDrafter.from_pretrained(tmp_path / "grown", dtype=torch.float64)
    assert loaded.config.target_layer_ids == [1, 0, 3, 2] and torch.equal(loaded.fc.weight, grown.fc.weight)
    for layers, missing in (([1, 0, 3], r"\[2\]"), ([2, 0, 0], r"\[\]")):
        with pytest.raises(ValueError, match=rf"reads target layers \[2, 0\].*each once \(missing: {missing}\)"):
            copy.deepcopy(drafter).set_target_layers(layers)
    with pytest.raises(ValueError, match="before its ReTrace module is added"):
        tiny_drafter(target, retrace="random").set_target_layers([0, 1, 2])


# --------------------------------------------------------------------------------------------------------------
# The loop: resume, end to end
# --------------------------------------------------------------------------------------------------------------


def _trainer(target, drafter, out, *, max_steps, feature_fn=None, dataset=None, eval_fn=None, **kw):
    args = TrainingArguments(out_dir=str(out), batch_size=2, grad_accum=2, lr=3e-3, max_steps=max_steps,
                             progress=False, save_dtype="float32", **kw)
    obj = objective_for(target, drafter, num_anchors=4)
    return Trainer(obj, dataset, args, feature_fn=feature_fn or OnlineFeatures(target, drafter.config.target_layer_ids),
                   eval_fn=eval_fn)


class _Killer:
    """Online features that die (like a kill) after ``n`` micro-batches."""

    def __init__(self, inner, n):
        self.inner, self.n = inner, n

    def __call__(self, batch):
        if self.n == 0:
            raise KeyboardInterrupt("simulated kill")
        self.n -= 1
        return self.inner(batch)


def _uninterrupted_run(target, tmp_path):
    """(dataset, a factory of identically initialised drafters, the trainer of a finished 6-step run) for resume tests."""
    data = FeatureDataset(_dataset(16))
    init = make_drafter(target).state_dict()

    def fresh():
        d = make_drafter(target)
        d.load_state_dict(init)
        return d

    full = _trainer(target, fresh(), tmp_path / "full", max_steps=6, dataset=data, save_every=0)
    full.train()
    return data, fresh, full


def _assert_resumes_to(full, target, fresh, data, out_dir) -> None:
    """``--resume`` in ``out_dir`` runs to step 6 and ends with the weights of the uninterrupted run ``full``."""
    resumed = _trainer(target, fresh(), out_dir, max_steps=6, dataset=data, save_every=2, resume=True)
    assert resumed.train()["steps"] == 6
    a, b = full.unwrapped_drafter().state_dict(), resumed.unwrapped_drafter().state_dict()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-5), key


def _killed_run(target, data, fresh, out_dir, kill_at_batch: int):
    """A 6-step run (checkpoints every 2 steps) killed at its ``kill_at_batch``-th micro-batch; returns its drafter."""
    drafter = fresh()
    killed = _trainer(target, drafter, out_dir, max_steps=6, dataset=data, save_every=2,
                      feature_fn=_Killer(OnlineFeatures(target, drafter.config.target_layer_ids), kill_at_batch))
    with pytest.raises(KeyboardInterrupt):
        killed.train()
    return drafter


def test_resume_after_kill_matches_uninterrupted_run(counting_target, tmp_path):
    target = counting_target
    data, fresh, full = _uninterrupted_run(target, tmp_path)
    _killed_run(target, data, fresh, tmp_path / "killed", 7)
    # died in the middle of step 4 (its 2nd micro-batch): the last checkpoint is step-2
    assert latest_checkpoint(tmp_path / "killed").name == "step-2"
    assert not list((tmp_path / "killed").rglob("*.pkl")), "a checkpoint holds a pickle (resume would unpickle it)"
    with open(tmp_path / "killed" / "train_log.jsonl", "a") as log_file:
        log_file.write('{"step": 3, "lo')  # the kill tore the last log line
    resumed = _trainer(target, fresh(), tmp_path / "killed", max_steps=6, dataset=data, save_every=2, resume=True)
    summary = resumed.train()
    assert summary["steps"] == 6
    a, b = full.unwrapped_drafter().state_dict(), resumed.unwrapped_drafter().state_dict()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-5), key
    log = [json.loads(line) for line in (tmp_path / "killed" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]  # redone steps are not logged twice
    full_log = [json.loads(line) for line in (tmp_path / "full" / "train_log.jsonl").read_text().splitlines()]
    assert np.allclose([r["loss"] for r in log], [r["loss"] for r in full_log], atol=1e-5)


def test_a_crash_inside_a_checkpoint_save_leaves_the_previous_checkpoint_to_resume(counting_target, tmp_path,
                                                                                  monkeypatch):
    """A kill while step-4 is being written (after its weights, before its optimizer state): step-2 stays the latest
    checkpoint, no half-written folder is taken for one, and --resume ends where an uninterrupted run ends."""
    from hf_retrace.training import checkpoints

    target = counting_target
    data, fresh, full = _uninterrupted_run(target, tmp_path)
    original_save = checkpoints.torch.save

    def dies_writing_step_4(obj, path, *args, **kwargs):
        if "step-4" in str(path):
            raise KeyboardInterrupt("killed while writing step-4")
        return original_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoints.torch, "save", dies_writing_step_4)
    with pytest.raises(KeyboardInterrupt):
        _trainer(target, fresh(), tmp_path / "run", max_steps=6, dataset=data, save_every=2).train()
    monkeypatch.setattr(checkpoints.torch, "save", original_save)
    assert latest_checkpoint(tmp_path / "run").name == "step-2"
    _assert_resumes_to(full, target, fresh, data, tmp_path / "run")
    assert latest_checkpoint(tmp_path / "run").name == "step-6"


def test_resume_passes_over_a_damaged_newest_checkpoint(counting_target, tmp_path, capsys):
    """The newest checkpoint cut short (its optimizer state): --resume says which file, resumes from the newest intact
    one and ends where an uninterrupted run ends; with none intact it refuses before any model loads."""
    from hf_retrace.training.checkpoints import checkpoint_problem, step_checkpoints
    from hf_retrace.training.cli.commands import cmd_train

    target = counting_target
    data, fresh, full = _uninterrupted_run(target, tmp_path)
    _killed_run(target, data, fresh, tmp_path / "run", 9)  # died in step 5: step-2 and step-4
    newest = tmp_path / "run" / "checkpoints" / "step-4"
    optimizer_file = newest / "optimizer.pt"
    with open(optimizer_file, "r+b") as handle:
        handle.truncate(optimizer_file.stat().st_size // 2)
    assert "optimizer.pt cannot be read" in checkpoint_problem(newest)
    assert latest_checkpoint(tmp_path / "run").name == "step-2"
    _assert_resumes_to(full, target, fresh, data, tmp_path / "run")
    assert checkpoint_problem(newest) is None, "the damaged checkpoint is written anew when the run passes its step"

    for step in (4, 6):  # every checkpoint damaged: refused before the (missing) target would load
        model_file = tmp_path / "run" / "checkpoints" / f"step-{step}" / "model.safetensors"
        with open(model_file, "r+b") as handle:
            handle.truncate(10)
    assert [p.name for p in step_checkpoints(tmp_path / "run")] == ["step-6", "step-4"]  # the newest 2 are kept
    data_dir = _tokenized(tmp_path)
    with pytest.raises(SystemExit, match=r"--resume: no checkpoint in .* can be loaded \(step-6: model.safetensors "
                                         r"cannot be read.*step-4: model.safetensors"):
        cmd_train(_train_args("--target", "no/such-model", "--data", str(data_dir), "--out", str(tmp_path / "run"),
                              "--resume"))


class _Clock:
    """The time budget's clock, advanced by the steps themselves: ``seconds(step)`` a step, none elsewhere."""

    def __init__(self, trainer, seconds):
        self.now = 1000.0
        trainer._clock = lambda: self.now
        inner = trainer._accumulate

        def accumulate(batches):
            self.now += seconds(trainer.state.step)
            return inner(batches)

        trainer._accumulate = accumulate


def test_a_time_budget_fits_the_schedule_to_the_steps_it_holds_and_ends_it_low(counting_target, tmp_path):
    """1 s a step and a 40 s budget: the first 2 steps untimed, the next 10 timed (1 s each), then the 28 s left hold
    26 more steps (95 % of them): the schedule ends at step 38, its rate there near 0, the loop ends with it."""
    target = counting_target
    data = FeatureDataset(_dataset(16))  # 4 steps an epoch: 100 epochs cap it at 400
    trainer = _trainer(target, make_drafter(target), tmp_path / "run", max_steps=None, dataset=data, epochs=100,
                       save_every=0, max_seconds=40)
    _Clock(trainer, lambda step: 1.0)
    assert trainer.total_steps == 400
    summary = trainer.train()
    assert summary["steps"] == summary["total_steps"] == 38 and not summary["stopped_by_time_budget"]
    assert trainer.state.total_steps == 38 and trainer.warmup_steps == 2
    assert trainer.scheduler.get_last_lr()[0] < 0.01 * trainer.args.lr
    assert latest_checkpoint(tmp_path / "run").name == "step-38"


def test_a_time_budget_never_goes_past_the_epochs_cap(counting_target, tmp_path):
    target = counting_target
    trainer = _trainer(target, make_drafter(target), tmp_path / "run", max_steps=None,
                       dataset=FeatureDataset(_dataset(16)), epochs=4, save_every=0, max_seconds=1000)
    _Clock(trainer, lambda step: 1.0)
    summary = trainer.train()
    assert summary["steps"] == summary["total_steps"] == 16 and not summary["stopped_by_time_budget"]


def test_a_spent_time_budget_stops_the_loop_and_a_resume_keeps_the_fitted_schedule(counting_target, tmp_path, capsys):
    """Steps 3x slower after the fit: the loop stops when the 40 s are spent (step 20: 12 s, then 3 s a step), saves
    a checkpoint and says so; a resume (its own budget, its steps fast again) ends at the fitted step 38 with no new
    fit, though its own speed would have fit another."""
    target = counting_target
    data = FeatureDataset(_dataset(16))
    init = make_drafter(target).state_dict()

    def run(resume):
        drafter = make_drafter(target)
        drafter.load_state_dict(init)
        return _trainer(target, drafter, tmp_path / "run", max_steps=None, dataset=data, epochs=100, save_every=0,
                        max_seconds=40, resume=resume)

    slow = run(resume=False)
    _Clock(slow, lambda step: 1.0 if step < 12 else 3.0)
    summary = slow.train()
    assert summary["stopped_by_time_budget"] and summary["total_steps"] == 38
    assert summary["steps"] == 12 + (40 - 12 + 2) // 3 == 22  # the step that crosses the budget is the last one
    assert latest_checkpoint(tmp_path / "run").name == "step-22"
    assert "ran out at step 22 of 38" in capsys.readouterr().out
    resumed = run(resume=True)
    _Clock(resumed, lambda step: 0.1)
    summary = resumed.train()
    assert summary["steps"] == 38 and resumed.state.total_steps == 38 and not summary["stopped_by_time_budget"]
    assert "time budget:" not in capsys.readouterr().out
    assert resumed.scheduler.get_last_lr()[0] < 0.01 * resumed.args.lr


def test_end_to_end_lowers_loss_and_raises_real_tau(counting_target, tmp_path):
    target = counting_target
    drafter = make_drafter(target, block_size=4, layers=2)
    gen = torch.Generator().manual_seed(5)
    prompts = [counting(int(s), 6).tolist() for s in torch.randint(0, CYCLE, (4,), generator=gen)]
    evaluator = TauEvaluator(target, prompts, max_new_tokens=24)
    tau_before = evaluator(drafter)["tau"]
    data = FeatureDataset(_dataset(64, seed=1))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train_log.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # a start killed early
    trainer = _trainer(target, drafter, tmp_path / "run", max_steps=60, dataset=data, eval_fn=evaluator,
                       save_every=0, eval_every=30)
    summary = trainer.train()
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    # the learning curve starts at the drafter the run starts from: step 0, no tokens seen, its own tau
    assert log[0]["step"] == 0 and log[0]["tokens"] == 0 and log[0]["tau"] == pytest.approx(tau_before)
    assert [r["step"] for r in log if "tau" in r] == [0, 30] and [r["step"] for r in log].count(1) == 1
    losses = [r["loss"] for r in log if "loss" in r]
    first, last = np.mean(losses[:3]), np.mean(losses[-5:])
    assert last < 0.3 * first, (first, last)
    tau_after = trainer.evaluate(limit=None)["tau"]
    assert tau_before < 1.5 and tau_after > 3.0, (tau_before, tau_after)  # block 4: max tau is 4
    trainer.save_drafter(tmp_path / "saved", "float32")
    loaded = ReTraceDrafter.from_pretrained(tmp_path / "saved")
    assert not any(k.startswith(("embed", "lm_head")) for k in loaded.state_dict())
    assert evaluator(loaded)["tau"] == pytest.approx(tau_after)
    assert summary["steps"] == 60


def test_tau_is_measured_on_the_drafter_whatever_policy_the_machine_would_pick(counting_target, monkeypatch):
    """Training's τ: full blocks, no lookup, never the tuned policy (here `off`: plain decoding, a τ of 0)."""
    from hf_retrace.training.evaluation import evaluation_policy

    target = counting_target
    drafter = make_drafter(target, block_size=4, layers=2)
    prompts = [counting(3, 6).tolist(), counting(20, 6).tolist()]
    reference = TauEvaluator(target, prompts, max_new_tokens=16)(drafter)
    monkeypatch.setenv("HF_RETRACE_POLICY", "off")
    ids = torch.tensor([prompts[0]])
    target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=8,
                    do_sample=False, pad_token_id=PAD)
    assert drafter.last_stats is None or not drafter.last_stats.rounds  # what a user's call would do here
    measured = TauEvaluator(target, prompts, max_new_tokens=16)(drafter)
    assert measured["tau"] == pytest.approx(reference["tau"]) and measured["tau"] >= 1.0 and measured["eval_rounds"]
    policy = evaluation_policy(drafter)
    assert policy.speculate and policy.confidence_cut is None and not policy.lookup and policy.verify_costs is None


# --------------------------------------------------------------------------------------------------------------
# Initialisation, stages, CLI checks
# --------------------------------------------------------------------------------------------------------------


def test_config_from_target_mismatch_and_layer_copy(counting_target):
    target = counting_target
    config = drafter_config_from_target(target.config, num_hidden_layers=2, block_size=8)
    assert (config.hidden_size, config.vocab_size, config.head_dim) == (64, VOCAB, 16)
    assert config.learned_mask_embedding and config.mask_token_id is None
    assert config.target_layer_ids == [1] * 5  # build_target_layer_ids(4, 5): L=4 leaves only layer 1
    drafter = ReTraceDrafter(drafter_config_from_target(target.config, num_hidden_layers=2, num_target_features=2))
    mapping = copy_target_layers(drafter, target)
    assert mapping == {0: 2, 1: 3}
    assert torch.equal(drafter.layers[1].mlp.up_proj.weight, target.model.layers[3].mlp.up_proj.weight)
    other = tiny_llama(layers=2)
    with pytest.raises(ValueError, match="does not match"):
        check_drafter_matches_target(make_drafter(target, target_layer_ids=[0, 3]).config, other.config)
    with pytest.raises(ValueError, match="vocab_size"):
        bad = ReTraceConfig(**{**config.to_dict(), "vocab_size": 99})
        check_drafter_matches_target(bad, target.config)


def test_param_filter_trains_only_retrace(counting_target, tmp_path):
    target = counting_target
    drafter = make_drafter(target)
    drafter.add_retrace()
    args = TrainingArguments(out_dir=str(tmp_path), max_steps=1, progress=False)
    trainer = Trainer(objective_for(target, drafter), FeatureDataset(_dataset(4)), args,
                      feature_fn=OnlineFeatures(target, drafter.config.target_layer_ids), param_filter=retrace_parameters)
    assert trainer.trainable_names and all(n.startswith("retrace.") for n in trainer.trainable_names)
    assert not drafter.layers[0].mlp.up_proj.weight.requires_grad


def _train_args(*argv):
    from hf_retrace.training.cli.commands import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["train", *argv])


def _tokenized(tmp_path):
    data = tmp_path / "tok"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"complete": True, "num_tokens": 10, "shards": []}))
    return data


def test_cli_refuses_bad_input_before_loading_models(tmp_path):
    from hf_retrace.training.cli.commands import cmd_train

    data = _tokenized(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "something").write_text("x")
    # the target does not exist: any model loading would fail differently
    with pytest.raises(SystemExit, match="not empty"):
        cmd_train(_train_args("--target", "no/such-model", "--data", str(data), "--out", str(out)))
    # --overwrite deletes a previous run's output only, never a folder of other files
    with pytest.raises(SystemExit, match="previous run's output only"):
        cmd_train(_train_args("--target", "no/such-model", "--data", str(data), "--out", str(out), "--overwrite"))
    assert (out / "something").read_text() == "x"
    with pytest.raises(SystemExit, match="manifest"):
        cmd_train(_train_args("--target", "default", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "o2")))
    with pytest.raises(SystemExit, match="--init-from"):
        cmd_train(_train_args("--target", "default", "--data", str(data), "--out", str(tmp_path / "o3"),
                              "--stage", "retrace"))
    with pytest.raises(SystemExit, match="--max-minutes must be a positive number of minutes, got 0"):
        cmd_train(_train_args("--target", "default", "--data", str(data), "--out", str(tmp_path / "o5"),
                              "--max-minutes", "0"))
    with pytest.raises(SystemExit, match="eval-prompts"):
        cmd_train(_train_args("--target", "default", "--data", str(data), "--out", str(tmp_path / "o4"),
                              "--eval-prompts", str(tmp_path / "missing.jsonl")))
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_resume_with_changed_settings_is_refused_with_the_differences_listed(tmp_path, counting_target):
    from hf_retrace.configuration import RETRACE_STATES
    from hf_retrace.training.cli.checks import RUN_SETTINGS, check_resume_settings, run_settings

    data = _tokenized(tmp_path)
    base = ["--target", "default", "--data", str(data), "--out", str(tmp_path / "run"), "--block-size", "4"]
    drafter = make_drafter(counting_target, block_size=4)
    settings = run_settings(_train_args(*base, "--batch-size", "2"), drafter.config, num_processes=1)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / RUN_SETTINGS).write_text(json.dumps(settings))
    check_resume_settings(tmp_path / "run", settings)  # same settings: continues
    # the same global batch split over two processes is the same experiment
    check_resume_settings(tmp_path / "run", run_settings(_train_args(*base, "--batch-size", "1"), drafter.config, 2))
    changed = run_settings(_train_args(*base, "--batch-size", "4", "--lr", "1e-4"), drafter.config, 1)
    with pytest.raises(SystemExit, match=r"global_batch: 2 in the run, 4 now; lr: 0.0006 in the run, 0.0001 now"):
        check_resume_settings(tmp_path / "run", changed)
    other_shape = make_drafter(counting_target, block_size=6)
    with pytest.raises(SystemExit, match="drafter"):
        check_resume_settings(tmp_path / "run", run_settings(_train_args(*base, "--batch-size", "2"),
                                                             other_shape.config, 1))
    # the ReTrace module's presence is shape, its training state is not (a ReTrace run marks it trained as it starts);
    # recorded as a bool, as runs recorded before the state existed did
    recorded = {state: run_settings(_train_args(*base, "--batch-size", "2"), drafter.config.__class__(
        **{**drafter.config.to_dict(), "retrace": state}), 1)["drafter"]["retrace"] for state in RETRACE_STATES}
    assert recorded == {"absent": False, "untrained": True, "trained": True}


def test_cli_refuses_to_train_or_calibrate_on_held_out_benchmark_folders(tmp_path, monkeypatch):
    from hf_retrace.training.cli.commands import main

    data = _tokenized(tmp_path)
    monkeypatch.setenv("HF_RETRACE_HELD_OUT_DIRS", str(tmp_path))
    with pytest.raises(SystemExit, match="benchmark folder"):
        main(["train", "--target", "default", "--data", str(data), "--out", str(tmp_path / "o")])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    drafter = tmp_path / "d"
    tiny_drafter(tiny_target()).save_pretrained(drafter)  # a whole folder: the path checks pass, the data check refuses
    monkeypatch.setattr("hf_retrace.training.cli.commands.load_target", lambda *a: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit, match="benchmark folder"):
        main(["calibrate", "--target", "default", "--drafter", str(drafter), "--prompts", str(prompts)])
    monkeypatch.delenv("HF_RETRACE_HELD_OUT_DIRS")
    with pytest.raises(SystemExit, match="--sequences must be A:B"):
        main(["calibrate", "--target", "default", "--drafter", str(drafter), "--data", str(data), "--sequences", "x"])


def test_label_cross_entropy_equals_torch_cross_entropy_with_gradients():
    from hf_retrace.training.objective import label_cross_entropy

    torch.manual_seed(0)
    weight = torch.randn(50, 16, dtype=torch.float64)
    bias = torch.randn(50, dtype=torch.float64)
    labels = torch.randint(0, 50, (30,))
    for b in (None, bias):
        rows_a = torch.randn(30, 16, dtype=torch.float64, requires_grad=True)
        rows_b = rows_a.detach().clone().requires_grad_(True)
        lse = torch.logsumexp(torch.nn.functional.linear(rows_a, weight, b), dim=-1)
        ours = label_cross_entropy(lse, rows_a, weight, b, labels)
        ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(rows_b, weight, b), labels, reduction="none")
        torch.testing.assert_close(ours, ref)
        (ours * torch.arange(30)).sum().backward()
        (ref * torch.arange(30)).sum().backward()
        torch.testing.assert_close(rows_a.grad, rows_b.grad)


def test_a_model_card_names_two_workers_files_of_one_name_apart():
    from hf_retrace.training.cli.train_command import source_labels

    paths = ["/data/target/answers.jsonl", "/data/responses/responses-00000.jsonl",
             "/data/responses-w1/responses-00000.jsonl", "/data/responses/responses-00001.jsonl"]
    assert source_labels(paths) == ["answers.jsonl", "responses/responses-00000.jsonl",
                                    "responses-w1/responses-00000.jsonl", "responses-00001.jsonl"]
    assert source_labels([]) == []
