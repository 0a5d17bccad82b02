"""Publishing to the Hub, against a patched ``huggingface_hub`` API (nothing leaves the machine): ``hf-retrace train
--push-to-hub`` and the drafter's own ``push_to_hub`` (transformers' ``PushToHubMixin``). What is uploaded, to which
repo, a clear refusal without a token, and that the uploaded files load back with ``from_pretrained``."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
import torch
from helpers import tiny_drafter, tiny_target, tiny_training_folder
from huggingface_hub import HfApi, ModelCard, RepoUrl, constants
from huggingface_hub.errors import EntryNotFoundError

from hf_retrace import ReTraceDrafter
from hf_retrace.cli import main
from hf_retrace.training.cli.train_command import _push_to_hub
from hf_retrace.tuning.records import RECORDS_FILENAME


class FakeHub:
    """The Hub's repos as folders under ``root``: ``create_repo`` makes one, ``create_commit`` writes its files."""

    def __init__(self, root: Path):
        self.root, self.created, self.commits = root, [], []

    def create_repo(self, api, repo_id, *, token=None, private=None, exist_ok=False, **kwargs):
        self.created.append(repo_id)
        (self.root / repo_id).mkdir(parents=True, exist_ok=True)
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, api, repo_id, operations, *, commit_message=None, **kwargs):
        self.commits.append((repo_id, sorted(op.path_in_repo for op in operations), commit_message))
        for op in operations:
            dest = self.root / repo_id / op.path_in_repo
            dest.parent.mkdir(parents=True, exist_ok=True)
            with op.as_file() as f:
                dest.write_bytes(f.read())
        return types.SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0", oid="0" * 40)

    def files(self, repo_id: str) -> set[str]:
        return {str(p.relative_to(self.root / repo_id)) for p in (self.root / repo_id).rglob("*") if p.is_file()}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    fake = FakeHub(tmp_path / "hub")
    monkeypatch.setattr(HfApi, "create_repo", lambda api, repo_id, **kw: fake.create_repo(api, repo_id, **kw))
    monkeypatch.setattr(HfApi, "create_commit", lambda api, repo_id, operations, **kw:
                        fake.create_commit(api, repo_id, operations, **kw))

    def no_card_yet(cls, repo_id, *args, **kwargs):  # a new repo has no README.md: transformers writes its template
        raise EntryNotFoundError(f"{repo_id} has no README.md")

    monkeypatch.setattr(ModelCard, "load", classmethod(no_card_yet))
    return fake


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ------------------------------------------------------------------------------------- the drafter's push_to_hub


def test_drafter_push_to_hub_uploads_weights_config_and_a_card_that_load_back(hub, token):
    drafter = tiny_drafter(tiny_target(dtype=torch.float32), block_size=4, dtype=torch.float32)
    drafter.config.lookup, drafter.config.draft_confidence_threshold = True, 0.5
    drafter.push_to_hub("someone/tiny-drafter")
    assert hub.created == ["someone/tiny-drafter"]
    assert {"config.json", "model.safetensors", "README.md"} <= hub.files("someone/tiny-drafter")
    loaded = ReTraceDrafter.from_pretrained(hub.root / "someone/tiny-drafter", dtype=torch.float32)
    assert _same_weights(loaded, drafter)
    assert (loaded.config.block_size, loaded.config.lookup, loaded.config.draft_confidence_threshold) == (4, True, 0.5)


def test_drafter_push_to_hub_uploads_the_recorded_rounds_it_was_loaded_with(hub, token, tmp_path):
    folder = tmp_path / "drafter"
    tiny_drafter(tiny_target(dtype=torch.float32), block_size=4, dtype=torch.float32).save_pretrained(folder)
    (folder / RECORDS_FILENAME).write_bytes(b"recorded rounds")
    ReTraceDrafter.from_pretrained(folder).push_to_hub("someone/with-rounds")
    assert RECORDS_FILENAME in hub.files("someone/with-rounds")


# ------------------------------------------------------------------------------------- hf-retrace train --push-to-hub


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return tiny_training_folder(tmp_path_factory.mktemp("hub"), num_answers=8, response_words=10)


def _train_argv(root: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--target", str(root / "target"), "--data", str(root / "tok"), "--out", str(out),
            "--block-size", "4", "--num-layers", "1", "--target-layer-ids", "0,1", "--num-anchors", "3",
            "--batch-size", "2", "--max-steps", "2", "--target-dtype", "float32", "--save-dtype", "float32",
            "--holdout", "0", "--num-threads", "1", "--no-progress", *extra]


def test_train_push_to_hub_uploads_the_drafter_and_its_card_in_one_commit(tiny_run, tmp_path, hub, token,
                                                                           capsys):
    out = tmp_path / "run"
    assert main(_train_argv(tiny_run, out, "--push-to-hub", "someone/trained-drafter")) == 0
    assert "pushed to https://huggingface.co/someone/trained-drafter" in capsys.readouterr().out
    assert hub.created == ["someone/trained-drafter"]
    assert hub.commits == [("someone/trained-drafter", ["README.md", "config.json", "model.safetensors"],
                            "Upload hf-retrace drafter")]
    uploaded = hub.root / "someone/trained-drafter"
    assert (uploaded / "README.md").read_text() == (out / "README.md").read_text()  # our card, not a template
    assert "# DFlash drafter for" in (uploaded / "README.md").read_text()
    loaded = ReTraceDrafter.from_pretrained(uploaded, dtype=torch.float32)
    assert _same_weights(loaded, ReTraceDrafter.from_pretrained(out, dtype=torch.float32))
    assert json.loads((uploaded / "config.json").read_text())["block_size"] == 4


def test_push_uploads_the_recorded_rounds_and_keeps_the_run_s_own_files_local(tmp_path, hub, token):
    out = tmp_path / "drafter"
    tiny_drafter(tiny_target(dtype=torch.float32), block_size=4, dtype=torch.float32).save_pretrained(out)
    (out / "README.md").write_text("# card\n")
    (out / RECORDS_FILENAME).write_bytes(b"recorded rounds")
    for local in ("train_log.jsonl", "run_settings.json", "training_summary.json"):
        (out / local).write_text("{}")
    (out / "checkpoints" / "step-2").mkdir(parents=True)
    shutil.copy(out / "model.safetensors", out / "checkpoints" / "step-2" / "model.safetensors")
    _push_to_hub(out, "someone/with-rounds")
    assert hub.files("someone/with-rounds") == {"README.md", "config.json", "model.safetensors", RECORDS_FILENAME}
    assert (hub.root / "someone/with-rounds" / RECORDS_FILENAME).read_bytes() == b"recorded rounds"


def test_train_push_to_hub_without_a_token_is_refused_before_training(tiny_run, tmp_path, no_token, hub):
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"--push-to-hub someone/x needs a Hugging Face token with write access, and "
                       r"none is set: run `hf auth login` \(or set HF_TOKEN\)"):
        main(_train_argv(tiny_run, out, "--push-to-hub", "someone/x"))
    assert not out.exists() and hub.created == [] and hub.commits == []


def test_train_push_to_hub_refuses_a_malformed_repo_id_before_training(tiny_run, tmp_path, hub, token):
    with pytest.raises(SystemExit, match="--push-to-hub 'two words' is not a Hub repo id"):
        main(_train_argv(tiny_run, tmp_path / "run", "--push-to-hub", "two words"))
    assert hub.created == []
