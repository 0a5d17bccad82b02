"""The README.md of a trained drafter: what it was trained for, on what, how long, and the τ it reached.

Example::

    write_model_card("runs/drafter", {"target": "SmolLM2-135M-Instruct", "steps": 1000, "tau": 3.1, ...})
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..defaults import SOURCE_FILENAME

__all__ = ["target_hub_id", "write_model_card"]


def target_hub_id(path: str) -> str | None:
    """The Hub id a target stands for: itself, or the id a converted local copy records; None for other folders."""
    info = Path(path) / SOURCE_FILENAME
    if info.is_file():
        try:
            return json.loads(info.read_text()).get("equivalent_hub_id")
        except ValueError:
            return None
    return None if Path(path).exists() else path


def write_model_card(out_dir: str | os.PathLike[str], info: dict[str, Any]) -> Path:
    """README.md for a trained drafter: target, data, tokens, steps, time, measured τ, how to use it."""
    out = Path(out_dir)
    tau = info.get("tau")
    lines = [
        "---",
        "library_name: hf-retrace",
        "tags: [speculative-decoding, dflash, retrace, drafter]",
        f"base_model: {info.get('target_hub_id') or info.get('target')}",
        "---",
        "",
        f"# DFlash drafter for {info.get('target_hub_id') or info.get('target')}",
        "",
        "A block drafter (DFlash architecture, hf_retrace format) for lossless speculative decoding with transformers.",
        "It owns no embeddings and no LM head: the target's are borrowed at run time.",
        "",
        "```python",
        "import hf_retrace, transformers",
        f"target = transformers.AutoModelForCausalLM.from_pretrained({info.get('target_hub_id') or info.get('target')!r})",
        "drafter = hf_retrace.ReTraceDrafter.from_pretrained(PATH_OR_REPO)",
        "out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256, do_sample=False)",
        "print(drafter.last_stats.mean_acceptance_length)",
        "```",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
    ]
    rows = [
        ("target", info.get("target")), ("data", info.get("data")), ("sequences", info.get("num_sequences")),
        ("tokens seen", info.get("tokens")), ("supervised draft slots", info.get("labels")),
        ("optimizer steps", info.get("steps")), ("wall time", info.get("time")), ("hardware", info.get("hardware")),
        ("stage", info.get("stage")), ("hyper-parameters", info.get("hyperparameters")),
        ("command", f"`{info['command']}`" if info.get("command") else None),
    ]
    lines += [f"| {k} | {v} |" for k, v in rows if v is not None]
    lines += ["", "## Measured acceptance length", ""]
    if tau is not None:
        lines.append(
            f"τ = **{tau:.3f}** (mean over {info.get('eval_prompts')} held-out prompts of committed tokens per target "
            f"forward, greedy, max_new_tokens={info.get('eval_max_new_tokens')}, measured with real "
            "`target.generate(..., assistant_model=drafter)`, the drafter alone in full blocks: no lookup, no cut)."
        )
    else:
        lines.append("τ was not measured (no evaluation prompts were given).")
    lines += ["", "Objective: DFlash block-wise cross-entropy with random anchors, position decay exp(-(k-1)/γ).", ""]
    path = out / "README.md"
    path.write_text("\n".join(lines))
    return path
