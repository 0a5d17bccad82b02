"""transformers' own DFlash path (``speculation_type="dflash"``) driven by the weights of a :class:`ReTraceDrafter`.

The drafter's DFlash backbone and ``MuseGlimmerAssistantModel`` are the same architecture (Qwen3-style layers with
QK-norm whose keys/values are ``[projected target context ; block]``, non-causal, plain RoPE); only weight names and
two inputs differ:

=====================================  =====================================
``ReTraceDrafter``                      ``MuseGlimmerAssistantModel``
=====================================  =====================================
``layers.{i}.*``                        ``layers.{i}.*`` (same names inside)
``fc.weight``                           ``encoder.fc.weight``
``hidden_norm.weight``                  ``encoder.output_norm_enc.weight``
``norm.weight``                         ``norm.weight``
``mask_embedding`` (learned mask)       none: a forward pre-hook puts it into ``noise_embeds``
``retrace.*``                           none: the native path has no ReTrace
``draft_vocab`` (draft vocabulary)      none: the native path scores every ``lm_head`` row
=====================================  =====================================

transformers' ``DFlashTokenCandidateGenerator`` embeds ``[anchor, mask_token_id x (B-1)]`` with the target's table.
A drafter with a learned mask vector (or an ``input_embedding_scale``) gets a pre-hook that rewrites those embeddings
exactly as ``ReTraceDrafter.block_embeddings`` builds them; the generator and the assisted loop stay stock.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import torch
from torch import nn

__all__ = [
    "build_native_assistant",
    "convert_state_dict",
    "native_assistant_config",
    "native_dflash_unavailable_reason",
]

_RENAMES = (
    (re.compile(r"^fc\.weight$"), "encoder.fc.weight"),
    (re.compile(r"^hidden_norm\.weight$"), "encoder.output_norm_enc.weight"),
    (re.compile(r"^norm\.weight$"), "norm.weight"),
    (re.compile(r"^(layers\.\d+\.(self_attn\.[qkvo]_proj|self_attn\.[qk]_norm|mlp\.(gate|up|down)_proj"
                r"|input_layernorm|post_attention_layernorm)\.weight)$"), r"\1"),
)
_DROPPED = re.compile(r"^(mask_embedding|retrace\..*)$|draft_vocab$")


def native_dflash_unavailable_reason(drafter_config: Any = None) -> str | None:
    """Why the native path cannot run here (None when it can): the installed transformers, or the drafter's shape."""
    if importlib.util.find_spec("transformers.models.muse_glimmer_assistant") is None:
        return "unavailable: the installed transformers has no MuseGlimmerAssistantModel (native DFlash needs 5.15+)"
    try:
        from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator  # noqa: F401
    except ImportError:
        return "unavailable: the installed transformers has no DFlashTokenCandidateGenerator"
    if drafter_config is not None:
        if getattr(drafter_config, "attention_bias", False):
            return "unavailable: the drafter has attention biases, which MuseGlimmerAssistantModel lacks"
        if drafter_config.hidden_act != "silu":
            return f"unavailable: the drafter's activation is {drafter_config.hidden_act!r}, the native model's is silu"
    return None


def native_assistant_config(drafter_config: Any):
    """The ``MuseGlimmerAssistantConfig`` with the drafter's shape (DFlash fields only; ReTrace has no native form)."""
    from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantConfig

    dcfg = drafter_config
    return MuseGlimmerAssistantConfig(
        hidden_size=dcfg.hidden_size,
        intermediate_size=dcfg.intermediate_size,
        num_hidden_layers=dcfg.num_hidden_layers,
        num_attention_heads=dcfg.num_attention_heads,
        num_key_value_heads=dcfg.num_key_value_heads,
        head_dim=dcfg.head_dim,
        rms_norm_eps=dcfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": dcfg.rope_theta},
        max_position_embeddings=dcfg.max_position_embeddings,
        sliding_window=dcfg.sliding_window or dcfg.max_position_embeddings,
        layer_types=list(dcfg.layer_types),
        hidden_act=dcfg.hidden_act,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        block_size=dcfg.block_size,
        # a learned mask vector replaces this row in the pre-hook; any valid row keeps the generator happy
        mask_token_id=0 if dcfg.learned_mask_embedding else dcfg.mask_token_id,
        target_layer_ids=list(dcfg.target_layer_ids),
    )


def convert_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a ``ReTraceDrafter`` state dict to ``MuseGlimmerAssistantModel`` names; drop the ReTrace-only weights.

    Raises ValueError on a name it does not know, so a new drafter weight can never be silently dropped.
    """
    converted = {}
    for name, tensor in state_dict.items():
        if _DROPPED.match(name):
            continue
        for pattern, replacement in _RENAMES:
            if pattern.match(name):
                converted[pattern.sub(replacement, name)] = tensor
                break
        else:
            raise ValueError(f"convert_state_dict: no MuseGlimmerAssistantModel name for the drafter weight {name!r}")
    return converted


def build_native_assistant(drafter: Any) -> nn.Module:
    """A ``MuseGlimmerAssistantModel`` with ``drafter``'s DFlash weights, for ``generate(speculation_type="dflash")``.

    Example::

        assistant = build_native_assistant(drafter)
        out = target.generate(input_ids, assistant_model=assistant, speculation_type="dflash", max_new_tokens=64)
    """
    reason = native_dflash_unavailable_reason(drafter.config)
    if reason is not None:
        raise RuntimeError(f"transformers' native DFlash path is {reason}")
    from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantModel

    assistant = MuseGlimmerAssistantModel(native_assistant_config(drafter.config))
    assistant.load_state_dict(convert_state_dict(drafter.state_dict()), strict=True)
    assistant.to(device=drafter.device, dtype=drafter.dtype).eval()
    dcfg = drafter.config
    if dcfg.learned_mask_embedding or dcfg.input_embedding_scale != 1.0:
        mask = drafter.mask_embedding.detach().clone() if dcfg.learned_mask_embedding else None
        assistant.register_forward_pre_hook(_block_embedding_hook(mask, dcfg.input_embedding_scale), with_kwargs=True)
    assistant.last_stats = None  # read by side_by_side.timed_generate like a ReTraceDrafter's; the bench fills it
    return assistant


def _block_embedding_hook(mask: torch.Tensor | None, scale: float):
    """Rebuild ``noise_embeds`` as ``ReTraceDrafter.block_embeddings`` does: learned mask rows, then the scale."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        noise = kwargs["noise_embeds"].to(module.dtype)
        if mask is not None:
            masks = mask.to(noise.device, noise.dtype).expand(noise.shape[0], noise.shape[1] - 1, -1)
            noise = torch.cat([noise[:, :1], masks], dim=1)
        kwargs["noise_embeds"] = noise * scale if scale != 1.0 else noise
        return args, kwargs

    return hook
