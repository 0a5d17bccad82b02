"""`hf-retrace export`: a drafter's DFlash backbone in the z-lab layout, proved with the reference implementation.

The reference is the PyPI package `dflash==0.1.0` (z-lab's own DFlashDraftModel; a test-only dependency installed by
the README's test command). Its drafts for the exported folder must equal ours block for block in float64.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import scripted_source, tiny_drafter, tiny_target
from transformers import DynamicCache

from hf_retrace import ReTraceDrafter
from hf_retrace.cli import main
from hf_retrace.export import ExportError, export_zlab


def _recorded_rounds(target, drafter, prompt, max_new_tokens):
    """Run a real greedy generate with ``drafter`` and return (committed ids, our drafts) of every drafted round."""
    rounds = []

    class Recording(scripted_source()):
        def propose(self, inputs):
            proposal = super().propose(inputs)
            rounds.append((inputs.sequence.clone(), proposal.tokens.clone()))
            return proposal

    target.generate(prompt, assistant_model=drafter.with_drafter_source(Recording), max_new_tokens=max_new_tokens,
                    do_sample=False)
    return [(ids, drafts) for ids, drafts in rounds if drafts.shape[1] > 0]


def _reference_drafts(reference, target, ids, num_drafts):
    """The z-lab drafter's greedy block for the context ``ids`` (anchor = last token), from a fresh target forward."""
    start = ids.shape[1] - 1
    out = target(ids[:, :start], output_hidden_states=True)
    from dflash.model import extract_context_feature

    target_hidden = extract_context_feature(out.hidden_states, reference.target_layer_ids)
    block = torch.full((1, reference.block_size), reference.mask_token_id, dtype=torch.long)
    block[:, 0] = ids[:, start]
    hidden = reference(
        target_hidden=target_hidden,
        noise_embedding=target.get_input_embeddings()(block),
        position_ids=torch.arange(start + reference.block_size)[None],
        past_key_values=DynamicCache(),
        use_cache=False,
    )[:, 1:]
    return reference.compute_logits(hidden, target.lm_head).argmax(-1)[:, :num_drafts]


@pytest.mark.parametrize("layers,block_size", [(1, 4), (2, 6)])
def test_exported_drafter_drafts_equal_ours_under_the_reference_implementation(tmp_path, layers, block_size):
    pytest.importorskip("dflash.model", reason="the reference implementation: pip install --no-deps dflash==0.1.0")
    from dflash.model import DFlashDraftModel

    target = tiny_target(logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=block_size, num_layers=layers, seed=3)
    export_zlab(drafter, tmp_path / "zlab")
    config = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": drafter.config.mask_token_id,
                                       "target_layer_ids": drafter.config.target_layer_ids}

    reference = DFlashDraftModel.from_pretrained(tmp_path / "zlab", dtype=torch.float64).eval()
    assert reference.block_size == block_size and reference.target_layer_ids == drafter.config.target_layer_ids
    prompt = torch.randint(0, target.config.vocab_size - 1, (1, 9), generator=torch.Generator().manual_seed(0))
    rounds = _recorded_rounds(target, drafter, prompt, max_new_tokens=40)
    assert len(rounds) >= 5
    with torch.no_grad():
        for ids, ours in rounds:
            theirs = _reference_drafts(reference, target, ids, ours.shape[1])
            assert torch.equal(theirs, ours), f"round at length {ids.shape[1]}: reference {theirs} vs ours {ours}"


def test_export_round_trips_through_our_loader(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=5, num_layers=2, retrace="random")
    export_zlab(drafter, tmp_path / "zlab")
    loaded = ReTraceDrafter.from_pretrained(tmp_path / "zlab", dtype=torch.float64)
    assert loaded.retrace is None, "the ReTrace module is not part of DFlash: the export leaves it out"
    ours = {k: v for k, v in drafter.state_dict().items() if not k.startswith("retrace.")}
    theirs = loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name
    assert loaded.config.block_size == 5 and loaded.config.target_layer_ids == drafter.config.target_layer_ids
    assert loaded.config.mask_token_id == drafter.config.mask_token_id


@pytest.mark.parametrize("kind", ["learned_mask", "draft_vocab"])
def test_export_refuses_a_drafter_the_reference_cannot_express(tmp_path, kind):
    target = tiny_target()
    drafter = tiny_drafter(target, learned_mask_embedding=kind == "learned_mask",
                           draft_vocab_size=40 if kind == "draft_vocab" else None)
    with pytest.raises(ExportError, match="--mask-token-id" if kind == "learned_mask" else "--draft-vocab-size"):
        export_zlab(drafter, tmp_path / "zlab")
    assert not (tmp_path / "zlab").exists(), "nothing is written when the export is refused"


def test_export_command_refuses_a_non_empty_folder_and_writes_an_empty_one(tmp_path, capsys):
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "ours")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not empty"):
        main(["export", "--drafter", str(tmp_path / "ours"), "--out", str(busy)])
    assert (busy / "notes.txt").read_text() == "keep me" and len(list(busy.iterdir())) == 1
    assert main(["export", "--drafter", str(tmp_path / "ours"), "--out", str(tmp_path / "zlab"), "--dtype", "fp32"]) == 0
    assert {p.name for p in (tmp_path / "zlab").iterdir()} == {"config.json", "model.safetensors"}
