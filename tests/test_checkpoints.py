"""Published z-lab DFlash checkpoints load as they are, and the drafter's forward matches a plain re-implementation."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import tiny_drafter, tiny_target
from safetensors.torch import save_file
from transformers import AutoModel, DynamicCache

from hf_retrace import ReTraceConfig, ReTraceDrafter
from hf_retrace.generation.policy import shipped_policy

H, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 64, 4, 2, 16, 128, 2, 96


def write_zlab_checkpoint(folder: Path, block_size_in: str = "top", seed: int = 0) -> dict[str, torch.Tensor]:
    """A checkpoint in the published z-lab layout: model_type qwen3, dflash_config, bare `layers.*` weight names."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * LAYERS,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB,
        "num_target_layers": 4,
        "torch_dtype": "float32",
        "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 2]},
    }
    if block_size_in == "top":
        config["block_size"] = 4
    else:
        config["dflash_config"]["block_size"] = 4
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.08):
        return (torch.randn(*shape, generator=gen) * scale).contiguous()

    weights = {"fc.weight": rand(H, 2 * H), "hidden_norm.weight": 1 + rand(H), "norm.weight": 1 + rand(H)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, H),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, H),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, H),
            p + "self_attn.o_proj.weight": rand(H, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": 1 + rand(HEAD_DIM),
            p + "self_attn.k_norm.weight": 1 + rand(HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(FFN, H),
            p + "mlp.up_proj.weight": rand(FFN, H),
            p + "mlp.down_proj.weight": rand(H, FFN),
            p + "input_layernorm.weight": 1 + rand(H),
            p + "post_attention_layernorm.weight": 1 + rand(H),
        }
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return weights


def reference_forward(w, target_hidden, noise, positions, theta=1e6, eps=1e-6):
    """DFlash written out plainly: no cache, every key recomputed, attention without a mask."""

    def rms(x, weight):
        return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x [heads, T, d]; neox layout: dimension i pairs with i + d/2
        d = x.shape[-1]
        freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angle = pos.double()[:, None] * freq[None]  # [T, d/2]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        cos, sin = torch.cos(angle), torch.sin(angle)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    ctx = rms(target_hidden @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = noise
    q_len, c_len = noise.shape[0], ctx.shape[0]
    for i in range(LAYERS):
        p = f"layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = rms((x @ w[p + "self_attn.q_proj.weight"].T).view(q_len, HEADS, HEAD_DIM), w[p + "self_attn.q_norm.weight"])
        both = torch.cat([ctx, x])
        k = rms(
            (both @ w[p + "self_attn.k_proj.weight"].T).view(c_len + q_len, KV_HEADS, HEAD_DIM),
            w[p + "self_attn.k_norm.weight"],
        )
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(c_len + q_len, KV_HEADS, HEAD_DIM)
        q = rope(q.transpose(0, 1), positions[c_len:])
        k = rope(k.transpose(0, 1), positions)
        v = v.transpose(0, 1)
        group = HEADS // KV_HEADS
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        attn = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(HEAD_DIM), dim=-1) @ v
        h = h + attn.transpose(0, 1).reshape(q_len, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"])


@pytest.mark.parametrize("block_size_in", ["top", "dflash_config"])
def test_zlab_checkpoint_loads_and_forward_matches_plain_implementation(tmp_path, block_size_in):
    weights = write_zlab_checkpoint(tmp_path / "zlab", block_size_in)
    drafter, info = ReTraceDrafter.from_pretrained(tmp_path / "zlab", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert drafter.config.block_size == 4 and drafter.config.mask_token_id == VOCAB - 1
    assert drafter.config.target_layer_ids == [0, 2]
    assert drafter.retrace is None and drafter.config.retrace == "absent"  # a plain DFlash checkpoint: no ReTrace
    drafter = drafter.double().eval()
    w = {k: v.double() for k, v in weights.items()}
    gen = torch.Generator().manual_seed(1)
    target_hidden = torch.randn(1, 9, 2 * H, generator=gen, dtype=torch.float64)
    noise = torch.randn(1, 4, H, generator=gen, dtype=torch.float64)
    positions = torch.arange(13)
    with torch.no_grad():
        ours = drafter(target_hidden=target_hidden, noise_embedding=noise, position_ids=positions[None])
    expected = reference_forward(w, target_hidden[0], noise[0], positions)
    torch.testing.assert_close(ours[0], expected, rtol=1e-10, atol=1e-10)


def test_cached_context_equals_full_recompute(tmp_path):
    """Feeding the context in chunks through the drafter cache (as generate does) equals one full forward."""
    weights = write_zlab_checkpoint(tmp_path / "zlab")
    drafter = ReTraceDrafter.from_pretrained(tmp_path / "zlab").double().eval()
    w = {k: v.double() for k, v in weights.items()}
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(1, 20, 2 * H, generator=gen, dtype=torch.float64)
    cache = DynamicCache()
    seen = 0
    for chunk in (7, 1, 3, 4):  # prefill, then accepted lengths
        noise = torch.randn(1, 4, H, generator=gen, dtype=torch.float64)
        anchor = seen + chunk
        with torch.no_grad():
            out = drafter(
                target_hidden=features[:, seen:anchor],
                noise_embedding=noise,
                position_ids=torch.arange(seen, anchor + 4)[None],
                past_key_values=cache,
                use_cache=True,
            )
        cache.crop(-4)
        seen = anchor
        expected = reference_forward(w, features[0, :anchor], noise[0], torch.arange(anchor + 4))
        torch.testing.assert_close(out[0], expected, rtol=1e-10, atol=1e-10)


def test_hub_id_loads_from_local_cache_offline(tmp_path):
    """The Hub path (`from_pretrained("z-lab/...")`) through a local Hugging Face cache with HF_HUB_OFFLINE=1."""
    snapshot = tmp_path / "hub" / "models--z-lab--Tiny-DFlash-b4" / "snapshots" / ("a" * 40)
    write_zlab_checkpoint(snapshot)
    refs = snapshot.parent.parent / "refs"
    refs.mkdir()
    (refs / "main").write_text("a" * 40)
    script = textwrap.dedent(
        """
        import hf_retrace
        d = hf_retrace.ReTraceDrafter.from_pretrained("z-lab/Tiny-DFlash-b4")
        print("OK", d.config.block_size, d.config.target_layer_ids, d.config.mask_token_id)
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), HF_HOME=str(tmp_path / "home"))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"OK 4 [0, 2] {VOCAB - 1}" in result.stdout


def test_save_pretrained_round_trip_and_auto_model(tmp_path):
    """Our own layout saves safetensors only, without the target's embeddings or lm_head, and loads via AutoModel."""
    target = tiny_target()
    drafter = tiny_drafter(target, retrace="random")
    drafter.save_pretrained(tmp_path / "ours")
    files = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert "model.safetensors" in files and not any(f.endswith(".bin") for f in files)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert any(k.startswith("retrace.") for k in keys)
    loaded = AutoModel.from_pretrained(tmp_path / "ours")
    assert isinstance(loaded, ReTraceDrafter)
    assert loaded.config.retrace == "trained" and shipped_policy(loaded.config).retrace
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a.to(b.dtype), b), name


def test_learned_mask_embedding_drafter_generates_losslessly(tmp_path):
    """A drafter with its own mask vector, for targets whose vocabulary has no spare row."""
    target = tiny_target(seed=2)
    drafter = tiny_drafter(target, learned_mask_embedding=True)
    assert drafter.config.mask_token_id is None
    drafter.save_pretrained(tmp_path / "learned")
    drafter = ReTraceDrafter.from_pretrained(tmp_path / "learned").double()
    prompt = torch.randint(0, 95, (1, 6), generator=torch.Generator().manual_seed(0))
    reference = target.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(prompt, assistant_model=drafter, max_new_tokens=20, do_sample=False), reference)


def test_config_without_mask_or_layers_is_refused():
    with pytest.raises(ValueError, match="mask_token_id"):
        ReTraceDrafter(ReTraceConfig(target_layer_ids=[1], mask_token_id=None, num_hidden_layers=1))
    with pytest.raises(ValueError, match="target_layer_ids"):
        ReTraceDrafter(ReTraceConfig(mask_token_id=3, target_layer_ids=None, num_hidden_layers=1))


@pytest.mark.parametrize("stage, trained", [("backbone", False), ("retrace", True)])
def test_export_of_a_stopped_run_keeps_its_weights_and_the_module_state(tmp_path, stage, trained):
    """A run stopped before its end exports from its latest checkpoint; a ReTrace-stage run's module comes out
    trained (on by default), although the run recorded its config before training it."""
    from hf_retrace.training.checkpoints import DRAFTER_INIT, RUN_SETTINGS, export_checkpoint

    target = tiny_target(dtype=torch.float32)
    drafter = tiny_drafter(target, retrace="random", dtype=torch.float32)
    drafter.config.retrace = "untrained"
    run, step = tmp_path / "run", tmp_path / "run" / "checkpoints" / "step-3"
    step.mkdir(parents=True)
    (run / DRAFTER_INIT).write_text(json.dumps({"init": "test", "config": json.loads(drafter.config.to_json_string())}))
    (run / RUN_SETTINGS).write_text(json.dumps({"stage": stage}))
    weights = {f"drafter.{k}": v.contiguous() for k, v in drafter.state_dict().items()}
    save_file(weights, str(step / "model.safetensors"))
    (step / "trainer_state.json").write_text(json.dumps({"step": 3}))
    out = export_checkpoint(run, tmp_path / "export", dtype="float32")
    loaded = ReTraceDrafter.from_pretrained(out)
    assert loaded.config.retrace == ("trained" if trained else "untrained")
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
