"""A fresh drafter shaped like its target: its config, its mask vector's scale, layers copied from the target, and a
draft vocabulary of the data's most frequent response tokens.

Example::

    drafter = ReTraceDrafter(drafter_config_from_target(target.config, num_hidden_layers=3, block_size=16))
    init_from_target_statistics(drafter, target)
    copy_target_layers(drafter, target)  # the target's last 3 layers
    check_drafter_matches_target(drafter.config, target.config)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..configuration import ReTraceConfig, build_target_layer_ids, drafter_target_mismatches

__all__ = [
    "check_drafter_matches_target",
    "copy_target_layers",
    "drafter_config_from_target",
    "frequent_response_tokens",
    "init_from_target_statistics",
]


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




def frequent_response_tokens(data_dir: str, size: int, target_config: Any) -> torch.Tensor:
    """The ``size`` most frequent response tokens of the tokenized data, end-of-sequence ids always included."""
    from .data import TokenizedDataset

    vocab = target_config.get_text_config().vocab_size
    counts = np.zeros(vocab, dtype=np.int64)
    for item in TokenizedDataset(data_dir):
        counts += np.bincount(item["input_ids"][item["loss_mask"]].numpy(), minlength=vocab)[:vocab]
    eos = target_config.eos_token_id
    for token in [eos] if isinstance(eos, int) else list(eos or []):
        counts[token] = counts.max() + 1
    return torch.from_numpy(np.argsort(-counts, kind="stable")[:size].copy())
