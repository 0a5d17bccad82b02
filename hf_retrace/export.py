"""Export a drafter's DFlash backbone in the z-lab layout, the one serving engines and the reference implementation load.

The layout (as the published z-lab checkpoints): ``config.json`` of a Qwen3 config with ``architectures:
["DFlashDraftModel"]``, ``block_size`` and ``num_target_layers`` at the top level and ``dflash_config:
{mask_token_id, target_layer_ids}``; ``model.safetensors`` with bare ``fc.* hidden_norm.* norm.* layers.*`` names.
The reference drafter embeds the block through the target's table (row ``mask_token_id`` for MASK) and scores the
target's whole vocabulary, so a drafter with a learned mask vector or a draft vocabulary has no z-lab equivalent:
the export refuses it and says what to train instead. A ReTrace module is not part of DFlash and is left out (the
exported drafter is the backbone alone), which the export says.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .modeling import ReTraceDrafter

ZLAB_ARCHITECTURE = "DFlashDraftModel"
BACKBONE_PREFIXES = ("fc.", "hidden_norm.", "norm.", "layers.")


class ExportError(ValueError):
    """The drafter cannot be written in the requested layout; the message says why and what to do."""


def zlab_incompatibilities(drafter: ReTraceDrafter) -> list[str]:
    """What keeps ``drafter``'s drafts from being reproduced by the z-lab reference drafter (empty: exportable)."""
    config = drafter.config
    problems = []
    if config.learned_mask_embedding:
        problems.append(
            "it has a learned mask embedding, while the z-lab drafter embeds MASK as the target's row `mask_token_id`: "
            "train with `--mask-token-id ID` (a token id of the target that the answers never use)"
        )
    if config.draft_vocab_size:
        problems.append(
            f"it drafts from a draft vocabulary of {config.draft_vocab_size} tokens, while the z-lab drafter scores the "
            "target's whole vocabulary (its argmax could pick a token ours never drafts): train without "
            "`--draft-vocab-size`"
        )
    return problems


def _zlab_config(drafter: ReTraceDrafter, dtype: torch.dtype) -> dict:
    from transformers import Qwen3Config

    c = drafter.config
    qwen3 = Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        attention_bias=c.attention_bias, attention_dropout=0.0, layer_types=list(c.layer_types),
        sliding_window=c.sliding_window, use_sliding_window=c.sliding_window is not None,
        tie_word_embeddings=False,
    )
    out = qwen3.to_dict()
    for unused in ("transformers_version", "_name_or_path"):
        out.pop(unused, None)
    out.update(
        architectures=[ZLAB_ARCHITECTURE],
        model_type="qwen3",
        block_size=c.block_size,
        num_target_layers=c.num_target_layers,
        dtype=str(dtype).removeprefix("torch."),
        torch_dtype=str(dtype).removeprefix("torch."),
        dflash_config={"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
    )
    if c.input_embedding_scale != 1.0:
        out["dflash_config"]["input_embedding_scale"] = c.input_embedding_scale
    return out


def export_zlab(drafter: ReTraceDrafter | str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
                overwrite: bool = False) -> Path:
    """Write ``drafter``'s DFlash backbone to ``out_dir`` in the z-lab layout; returns the folder.

    ``drafter`` is a :class:`ReTraceDrafter` or a folder/Hub id to load one from. ``dtype`` defaults to the drafter's.
    Raises :class:`ExportError` before writing anything when the drafter has no z-lab equivalent or ``out_dir``
    already holds files (pass ``overwrite=True`` to replace them).
    """
    if not isinstance(drafter, ReTraceDrafter):
        drafter = ReTraceDrafter.from_pretrained(drafter)
    problems = zlab_incompatibilities(drafter)
    if problems:
        raise ExportError("This drafter cannot be exported in the z-lab DFlash layout: " + "; ".join(problems) + ".")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder; pick another --out.")
    source = Path(getattr(drafter, "name_or_path", "") or "")
    if out.is_dir() and source.is_dir() and out.resolve() == source.resolve():
        raise ExportError(f"{out} is the folder the drafter was loaded from: the export would replace its config and "
                          "weights with the z-lab layout's (and drop its ReTrace module). Pick another --out; "
                          "--overwrite never writes into the source drafter.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} is not empty; pick an empty folder or pass overwrite=True (--overwrite).")
    dtype = dtype or drafter.dtype
    weights = {
        name: tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        for name, tensor in drafter.state_dict().items()
        if name.startswith(BACKBONE_PREFIXES)
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_zlab_config(drafter, dtype), indent=2) + "\n")
    return out
