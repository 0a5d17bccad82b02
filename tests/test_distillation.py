"""Top-k distillation: the target's top-k store (`hf-retrace data topk`), its alignment in the objective (the token
at anchor + k is predicted at position anchor + k - 1), the loss against a direct computation, and the CLI end to end
on a tiny saved target, with its errors before any model loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import ListDataset, tiny_target, tiny_training_folder

from hf_retrace.cli import main
from hf_retrace.training.drafter_init import drafter_config_from_target
from hf_retrace.training.feature_dataset import FeatureDataset
from hf_retrace.training.features import collate_sequences, tapped_hidden_states
from hf_retrace.training.objective import DFlashObjective, decay_weights
from hf_retrace.training.precomputed_features import PrecomputedFeatures, precompute_features, precompute_topk
from hf_retrace import ReTraceDrafter

VOCAB = 96


def random_sequences(n: int, seed: int = 0) -> ListDataset:
    """``n`` random sequences of 9-16 tokens (prompt = first 3 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(9, 17, (n,), generator=gen)
    return ListDataset([torch.randint(0, VOCAB, (int(L),), generator=gen) for L in lengths], prompt_len=3)


@pytest.fixture(scope="module")
def target():
    return tiny_target(family="llama", vocab_size=VOCAB, dtype=torch.float32, logit_scale=4.0).eval()


def _drafter(target, draft_vocab=None) -> ReTraceDrafter:
    config = drafter_config_from_target(target.config, num_hidden_layers=1, block_size=4, target_layer_ids=[0, 1])
    torch.manual_seed(1)
    drafter = ReTraceDrafter(config).float()
    if draft_vocab is not None:
        drafter.set_draft_vocab(draft_vocab)
    return drafter


def test_the_store_holds_the_targets_top_k_of_every_position(target, tmp_path):
    data = random_sequences(7)
    manifest = precompute_topk(target, data, tmp_path / "topk", k=5, shard_sequences=3, max_batch_tokens=40,
                               progress=False)
    assert manifest["complete"] and manifest["kind"] == "topk" and manifest["feature_size"] == 10
    assert len(manifest["shards"]) == 3
    # resumable: a second call returns the same manifest at once
    assert precompute_topk(target, data, tmp_path / "topk", k=5, shard_sequences=3,
                           progress=False)["shards"] == manifest["shards"]
    store = PrecomputedFeatures(tmp_path / "topk", kind="topk")
    for i in range(len(data)):
        ids = data[i]["input_ids"][None]
        with torch.no_grad():
            ref = target(input_ids=ids).logits[0].float().log_softmax(-1).topk(5, dim=-1)
        rows = store[i]
        assert rows.shape == (ids.shape[1], 10)
        assert torch.equal(rows[:, :5].long(), ref.indices)
        torch.testing.assert_close(rows[:, 5:], ref.values, atol=1e-5, rtol=1e-5)
    # the two stores are told apart, with what to do
    with pytest.raises(ValueError, match="holds 'topk' data, not 'hidden'"):
        PrecomputedFeatures(tmp_path / "topk")
    precompute_features(target, data, tmp_path / "feats", [0, 1], progress=False)
    with pytest.raises(ValueError, match="holds 'hidden' data, not 'topk'"):
        PrecomputedFeatures(tmp_path / "feats", kind="topk")
    with pytest.raises(ValueError, match="holds top-k distributions, which have no layers to select"):
        PrecomputedFeatures(tmp_path / "topk", kind="topk", layers=[0])
    with pytest.raises(ValueError, match=r"other settings \(\['feature_size'\] differ\)"):
        precompute_topk(target, data, tmp_path / "topk", k=4, shard_sequences=3, progress=False)


def _batch(target, data, topk_dir, rows):
    dataset = FeatureDataset(data, topk=PrecomputedFeatures(topk_dir, kind="topk"))
    batch = collate_sequences([dataset[i] for i in rows])
    batch["target_hidden"] = tapped_hidden_states(target, batch["input_ids"], batch["attention_mask"], [0, 1])
    return batch


def _slot_logits(objective, batch, anchors, anchor_valid):
    """The drafter's log-probabilities over its scored rows at every slot ``[b, N, B-1, V']``, as the objective makes
    them (its own forward pieces), and the valid-label mask."""
    drafter = objective.drafter
    b, t = batch["input_ids"].shape
    embeds, position_ids, mask = objective.block_inputs(batch["input_ids"], anchors, anchor_valid, t)
    hidden = drafter(target_hidden=batch["target_hidden"], noise_embedding=embeds, position_ids=position_ids,
                     attention_mask=mask).reshape(b, anchors.shape[1], objective.block_size, -1)[:, :, 1:]
    weight, bias = objective._draft_head(hidden.dtype, hidden.device)
    lengths = batch["attention_mask"].sum(1)
    _, valid = objective.labels(batch["input_ids"], batch["loss_mask"], lengths, anchors, anchor_valid)
    return torch.nn.functional.linear(hidden, weight, bias).log_softmax(-1), valid


@pytest.mark.parametrize("with_draft_vocab", [False, True])
def test_the_distillation_term_equals_a_direct_computation(target, tmp_path, with_draft_vocab):
    data = random_sequences(4, seed=2)
    precompute_topk(target, data, tmp_path / "topk", k=6, progress=False)
    # a draft vocabulary that leaves out some of the target's top-6 tokens (renormalised over the rest)
    vocab = torch.arange(0, VOCAB, 2) if with_draft_vocab else None
    drafter = _drafter(target, vocab)
    batch = _batch(target, data, tmp_path / "topk", [0, 1, 2])
    anchors = torch.tensor([[3, 5, 7], [4, 6, 3], [3, 4, 5]])
    anchor_valid = torch.ones_like(anchors, dtype=torch.bool)
    batch.update(anchors=anchors, anchor_valid=anchor_valid)
    hard_obj = DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings(), gamma=4.0)
    soft_obj = DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings(), gamma=4.0,
                               distill_weight=1.0)
    mixed_obj = DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings(), gamma=4.0,
                                distill_weight=0.25)
    with torch.no_grad():
        log_q, valid = _slot_logits(soft_obj, batch, anchors, anchor_valid)
        if with_draft_vocab:  # label tokens outside the draft vocabulary carry no loss at all
            labels, _ = soft_obj.labels(batch["input_ids"], batch["loss_mask"], batch["attention_mask"].sum(1),
                                        anchors, anchor_valid)
            valid = valid & soft_obj.draft_index(labels)[1]
        position = {int(t): i for i, t in enumerate(vocab.tolist())} if with_draft_vocab else None
        weights = decay_weights(4, 4.0)
        total = norm = 0.0
        for r, n, j in valid.nonzero().tolist():
            row = int(anchors[r, n]) + j  # the slot predicts token anchor + j + 1: the target's row anchor + j
            ids = batch["target_topk"][r, row, :6].long().tolist()
            log_p = batch["target_topk"][r, row, 6:]
            keep = [i for i, t in enumerate(ids) if position is None or t in position]
            p = log_p[keep].softmax(-1) if keep else torch.zeros(0)
            cols = [ids[i] if position is None else position[ids[i]] for i in keep]
            total += float(weights[j]) * -(p * log_q[r, n, j, cols]).sum().item()
            norm += float(weights[j])
        expected = total / norm
        soft, _ = soft_obj(batch)
        hard, _ = hard_obj(batch)
        mixed, _ = mixed_obj(batch)
    assert valid.sum() > 10
    assert soft.item() == pytest.approx(expected, rel=1e-5)
    assert abs(soft.item() - hard.item()) > 1e-3  # the distributions are not the one-hot labels here
    assert mixed.item() == pytest.approx(0.75 * hard.item() + 0.25 * soft.item(), rel=1e-5)


def test_a_one_hot_store_of_the_labels_gives_the_hard_loss(target, tmp_path):
    """k = 1 with the stored token set to the sequence's own next token: the distillation term is the label loss, so
    the row alignment (position anchor + k - 1) is the labels' own."""
    data = random_sequences(3, seed=4)
    precompute_topk(target, data, tmp_path / "topk", k=1, progress=False)
    drafter = _drafter(target)
    batch = _batch(target, data, tmp_path / "topk", [0, 1, 2])
    topk = torch.zeros_like(batch["target_topk"])
    topk[:, :-1, 0] = batch["input_ids"][:, 1:].float()  # row p holds token p + 1, log-probability 0
    batch["target_topk"] = topk
    batch["anchor_generator"] = torch.Generator().manual_seed(0)
    soft_obj = DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings(), num_anchors=4,
                               distill_weight=1.0)
    hard_obj = DFlashObjective(drafter, target.get_input_embeddings(), target.get_output_embeddings(), num_anchors=4)
    soft, _ = soft_obj(batch)
    batch["anchor_generator"] = torch.Generator().manual_seed(0)
    hard, _ = hard_obj(batch)
    assert soft.item() == pytest.approx(hard.item(), rel=1e-6)
    batch.pop("target_topk")
    with pytest.raises(ValueError, match="hf-retrace data topk"):
        soft_obj(batch)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny saved target with its tokenizer and 12 tokenized training sequences."""
    return tiny_training_folder(tmp_path_factory.mktemp("distill"), num_answers=12, response_words=10,
                                vocab_size=VOCAB)


def _train_argv(root, out, *extra):
    return ["train", "--target", str(root / "target"), "--data", str(root / "tok"), "--out", str(out),
            "--block-size", "4", "--num-layers", "1", "--target-layer-ids", "0,1", "--num-anchors", "3",
            "--batch-size", "2", "--max-steps", "3", "--target-dtype", "float32", "--save-dtype", "float32",
            "--num-threads", "1", "--no-progress", *extra]


def test_the_cli_trains_with_the_distillation_term(tiny_run, tmp_path):
    root = tiny_run
    assert main(["data", "topk", "--target", str(root / "target"), "--data", str(root / "tok"), "--out",
                 str(tmp_path / "topk"), "--k", "4", "--limit", "8", "--dtype", "float32"]) == 0
    # 8 sequences covered, 12 read: refused before any model loads, with the two ways out
    with pytest.raises(SystemExit, match=r"covers the first 8 sequences but training reads the first 12.*--limit 12"):
        main(_train_argv(root, tmp_path / "refused", "--distill-weight", "0.5", "--topk-dir", str(tmp_path / "topk")))
    assert main(_train_argv(root, tmp_path / "run", "--distill-weight", "0.5", "--topk-dir", str(tmp_path / "topk"),
                            "--max-sequences", "8")) == 0
    settings = json.loads((tmp_path / "run" / "run_settings.json").read_text())
    assert settings["distill_weight"] == 0.5
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log if "loss" in row] == [1, 2, 3]
    assert all(np.isfinite(row["loss"]) for row in log if "loss" in row)
    assert "top-k distillation weight 0.5" in (tmp_path / "run" / "README.md").read_text()


@pytest.mark.parametrize("extra, message", [
    (["--distill-weight", "1.5"], r"--distill-weight must be in \[0, 1\]"),
    (["--distill-weight", "0.5"], "--distill-weight needs the target's top-k distributions: run `hf-retrace data topk"),
    (["--topk-dir", "x"], "--topk-dir is read only with --distill-weight > 0"),
    (["--distill-weight", "0.5", "--topk-dir", "nowhere"], "--topk-dir nowhere: no features.json"),
])
def test_bad_distillation_flags_are_refused_before_any_model_loads(tiny_run, tmp_path, extra, message):
    argv = _train_argv(tiny_run, tmp_path / "out", *extra)
    argv[argv.index("--target") + 1] = "no/such-model"  # loading it would fail differently
    with pytest.raises(SystemExit, match=message):
        main(argv)
    assert not (tmp_path / "out").exists()


def test_a_features_folder_is_refused_as_topk_dir_and_the_reverse(tiny_run, tmp_path):
    root = tiny_run
    assert main(["data", "features", "--target", str(root / "target"), "--data", str(root / "tok"), "--out",
                 str(tmp_path / "feats"), "--target-layer-ids", "0,1", "--dtype", "float32"]) == 0
    assert main(["data", "topk", "--target", str(root / "target"), "--data", str(root / "tok"), "--out",
                 str(tmp_path / "topk"), "--k", "2", "--dtype", "float32"]) == 0
    with pytest.raises(SystemExit, match="--topk-dir .* holds what `hf-retrace data features` writes"):
        main(_train_argv(root, tmp_path / "a", "--distill-weight", "0.5", "--topk-dir", str(tmp_path / "feats")))
    with pytest.raises(SystemExit, match="--features-dir .* holds what `hf-retrace data topk` writes"):
        main(_train_argv(root, tmp_path / "b", "--features-dir", str(tmp_path / "topk")))
    # and `data topk` into the features folder overwrites nothing
    with pytest.raises(SystemExit, match="other settings"):
        main(["data", "topk", "--target", str(root / "target"), "--data", str(root / "tok"), "--out",
              str(tmp_path / "feats"), "--k", "2", "--dtype", "float32"])
    assert PrecomputedFeatures(tmp_path / "feats").manifest["complete"]
    # a k beyond the target's vocabulary is refused before anything is written
    with pytest.raises(SystemExit, match=f"k must be between 1 and the target's vocabulary size {VOCAB}, got 1000"):
        main(["data", "topk", "--target", str(root / "target"), "--data", str(root / "tok"), "--out",
              str(tmp_path / "big"), "--k", "1000", "--dtype", "float32"])
    assert not (tmp_path / "big").exists()


def test_data_that_grew_keeps_its_features_and_training_computes_the_rest(tiny_run, tmp_path):
    """`data tokenize` grows a folder by a new response shard, `train --features-dir` accepts the features made before
    and computes the new sequences' ones; features of other data are refused before any model loads."""
    root = tiny_run
    answers = [json.loads(line) for line in (root / "answers.jsonl").read_text().splitlines()]
    shards = tmp_path / "responses"
    shards.mkdir()
    (shards / "responses-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in answers[:8]))
    (tmp_path / "held.jsonl").write_text(json.dumps({"id": "r3", "prompt": "kept for evaluation"}) + "\n")
    tokenize = ["data", "tokenize", "--target", str(root / "target"), "--responses", str(shards), "--out",
                str(tmp_path / "tok"), "--max-length", "64", "--exclude-ids", str(tmp_path / "held.jsonl")]
    assert main(tokenize) == 0
    assert main(["data", "features", "--target", str(root / "target"), "--data", str(tmp_path / "tok"), "--out",
                 str(tmp_path / "feats"), "--target-layer-ids", "0,1", "--dtype", "float32"]) == 0
    assert PrecomputedFeatures(tmp_path / "feats").manifest["num_sequences"] == 7  # r3 left out

    (shards / "responses-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in answers[8:]))
    assert main(tokenize) == 0
    assert json.loads((tmp_path / "tok" / "manifest.json").read_text())["num_sequences"] == 11
    argv = _train_argv(root, tmp_path / "run", "--features-dir", str(tmp_path / "feats"))
    argv[argv.index("--data") + 1] = str(tmp_path / "tok")
    assert main(argv) == 0
    store = PrecomputedFeatures(tmp_path / "feats")
    assert store.manifest["complete"] and len(store) == 11

    argv = _train_argv(root, tmp_path / "other", "--features-dir", str(tmp_path / "feats"))  # root/tok: other data
    argv[argv.index("--target") + 1] = "no/such-model"
    with pytest.raises(SystemExit, match="--features-dir .* does not belong to --data .*features-00000.bin holds other"):
        main(argv)
    assert not (tmp_path / "other").exists()


def test_one_features_folder_trains_drafters_that_tap_some_of_its_layers(tiny_run, tmp_path):
    """`train --features-dir` reads the drafter's layers out of a store that taps more (one pass over the data for a
    tapped-layer A/B); a store that lacks one of them is refused, naming both lists."""
    root = tiny_run
    assert main(["data", "features", "--target", str(root / "target"), "--data", str(root / "tok"), "--out",
                 str(tmp_path / "feats"), "--target-layer-ids", "0,1", "--dtype", "float32"]) == 0
    argv = _train_argv(root, tmp_path / "run", "--features-dir", str(tmp_path / "feats"))
    argv[argv.index("--target-layer-ids") + 1] = "1"
    assert main(argv) == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["target_layer_ids"] == [1]
    assert PrecomputedFeatures(tmp_path / "feats").manifest["target_layer_ids"] == [0, 1]  # the store unchanged

    assert main(["data", "features", "--target", str(root / "target"), "--data", str(root / "tok"), "--out",
                 str(tmp_path / "one"), "--target-layer-ids", "1", "--dtype", "float32"]) == 0
    with pytest.raises(SystemExit, match=r"--features-dir holds target layers \[1\] but the drafter reads \[0, 1\]"):
        main(_train_argv(root, tmp_path / "refused", "--features-dir", str(tmp_path / "one")))

    # the trained one-layer drafter given the store's other layer too: zero input columns for it, trained from there
    grown = _train_argv(root, tmp_path / "grown", "--features-dir", str(tmp_path / "feats"), "--init-from",
                        str(tmp_path / "run"))
    grown[grown.index("--target-layer-ids") + 1] = "0,1"
    assert main(grown) == 0
    assert json.loads((tmp_path / "grown" / "config.json").read_text())["target_layer_ids"] == [0, 1]
    assert "target layers [1] -> [0, 1] (zero input columns for the new ones)" in (
        tmp_path / "grown" / "README.md").read_text()
    trained = ReTraceDrafter.from_pretrained(tmp_path / "grown", dtype=torch.float32).fc.weight
    assert trained.shape[1] == 2 * trained.shape[0] and trained[:, : trained.shape[0]].abs().sum() > 0  # it learned
    grown[grown.index("--target-layer-ids") + 1] = "0"  # drops the layer it reads: refused, nothing written
    grown[grown.index("--out") + 1] = str(tmp_path / "dropped")
    with pytest.raises(SystemExit, match=r"--target-layer-ids 0: The drafter reads target layers \[1\].*missing: \[1\]"):
        main(grown)
    assert not (tmp_path / "dropped" / "config.json").exists()


def test_a_fine_tuned_drafter_takes_the_draft_vocabulary_of_its_new_data(tiny_run, tmp_path):
    """--draft-vocab-size with --init-from re-selects the vocabulary from --data (the head rows are the target's,
    frozen: nothing learned is lost); without it the drafter keeps its own."""
    from transformers import AutoConfig

    from hf_retrace import ReTraceDrafter
    from hf_retrace.training.drafter_init import frequent_response_tokens

    root = tiny_run
    config = AutoConfig.from_pretrained(root / "target")

    def fine_tune(out, *extra):  # --init-from takes the layers from the checkpoint: no --target-layer-ids
        argv = _train_argv(root, out, "--init-from", str(tmp_path / "first"), *extra)
        at = argv.index("--target-layer-ids")
        return main(argv[:at] + argv[at + 2 :])

    def most_frequent(size):
        return sorted(frequent_response_tokens(str(root / "tok"), size, config).tolist())

    assert main(_train_argv(root, tmp_path / "first", "--draft-vocab-size", "6")) == 0
    first = ReTraceDrafter.from_pretrained(tmp_path / "first")
    assert first.draft_vocab.tolist() == most_frequent(6)
    (tmp_path / "first" / "round_records.json.gz").write_bytes(b"the first drafter's rounds")
    assert fine_tune(tmp_path / "kept") == 0
    # new weights: the first drafter's recorded rounds do not travel with them (the tuner would replay the wrong drafter)
    assert not (tmp_path / "kept" / "round_records.json.gz").exists()
    assert ReTraceDrafter.from_pretrained(tmp_path / "kept").draft_vocab.tolist() == most_frequent(6)
    assert fine_tune(tmp_path / "wider", "--draft-vocab-size", "12") == 0
    wider = ReTraceDrafter.from_pretrained(tmp_path / "wider")
    assert wider.config.draft_vocab_size == 12 and wider.draft_vocab.tolist() == most_frequent(12)
    assert "re-selected; it had 6" in (tmp_path / "wider" / "README.md").read_text()
