"""ReTraceConfig: the DFlash drafter's shape plus the ReTrace switches.

Reads the z-lab DFlash layouts as they are published (``model_type: qwen3``, ``block_size`` at the top level or
inside ``dflash_config``, ``dflash_config.mask_token_id`` and ``dflash_config.target_layer_ids``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PretrainedConfig

RETRACE_ABLATIONS = ("full", "no_correction", "no_gate", "tokens_only")
# what a drafter holds: no ReTrace module, one with a zero output projection (drafts exactly as the backbone), a trained one
RETRACE_STATES = ("absent", "untrained", "trained")
PROPOSAL_MODES = ("argmax", "sample")  # under sampling: sample-and-match argmax drafts, or sampled drafts + rejection


def build_target_layer_ids(num_target_layers: int, num_draft_features: int) -> list[int]:
    """DFlash's default choice of tapped target layers: evenly spread from layer 1 to layer L-3 (0-based)."""
    if num_draft_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_features - 1))) for i in range(num_draft_features)]


def layer_columns(stored: Sequence[int], layers: Sequence[int], hidden_size: int) -> list[slice]:
    """The columns of each of ``layers`` in the concatenated tapped states of ``stored`` (layer ``stored[k]`` at
    ``k * hidden_size`` onwards, the drafter's input layout); every one of ``layers`` must be among ``stored``."""
    stored = list(stored)
    return [slice(stored.index(i) * hidden_size, (stored.index(i) + 1) * hidden_size) for i in layers]


def layers_out_of_range(target_layer_ids: Any, num_layers: int) -> list[int]:
    """The tapped layer ids that a ``num_layers``-layer target does not have (the one range rule)."""
    return [i for i in target_layer_ids if not 0 <= i < num_layers]


def drafter_target_mismatches(drafter_config: Any, target_config: Any) -> list[str]:
    """Why a drafter cannot draft for a target, read from the two configs (empty: it fits). The one rule, used by
    ``generate``'s dispatch, the benchmark and training: a DFlash drafter borrows the target's embeddings, lm_head and
    hidden states, so vocabulary, width and depth must be the target's."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    d = drafter_config
    problems = []
    if d.vocab_size != text.vocab_size:
        problems.append(f"the drafter was built for a vocabulary of {d.vocab_size} tokens (vocab_size) but the target "
                        f"has {text.vocab_size}")
    if d.hidden_size != text.hidden_size:
        problems.append(f"the drafter's hidden size is {d.hidden_size} but the target has {text.hidden_size}")
    bad = layers_out_of_range(d.target_layer_ids, text.num_hidden_layers)
    if bad:
        problems.append(f"the drafter reads target layers {d.target_layer_ids}, but the target has only "
                        f"{text.num_hidden_layers} layers (target_layer_ids {bad} out of range)")
    if d.num_target_layers not in (None, text.num_hidden_layers):
        problems.append(f"the drafter was built for a {d.num_target_layers}-layer target (num_target_layers) and "
                        f"the target has {text.num_hidden_layers}")
    if not d.learned_mask_embedding and d.mask_token_id is not None and not 0 <= d.mask_token_id < text.vocab_size:
        problems.append(f"the drafter's mask_token_id {d.mask_token_id} is not a row of the target's embeddings")
    return problems


MAX_DRAFTER_PARAMETERS = 20_000_000_000  # refuse absurd configs before a single weight is allocated


def _stored_layout(fields: dict[str, Any], kwargs: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The fields that other stored layouts give, read from (and removed from) ``kwargs``: z-lab's (the DFlash fields
    in a nested ``dflash_config``; ``model_type`` qwen3, so no ReTrace module), transformers 5's ``rope_parameters`` /
    4.x's ``rope_scaling``, and this package's older ReTrace keys; keys no drafter reads are dropped."""
    dflash = kwargs.pop("dflash_config", None) or {}
    found = {name: dflash[name] for name in ("block_size", "mask_token_id", "target_layer_ids", "input_embedding_scale")
             if name in dflash}
    if "sliding_window" in dflash and fields["sliding_window"] is None:
        found["sliding_window"] = dflash["sliding_window"]
    found["retrace"] = _retrace_state(fields["retrace"], kwargs.pop("retrace_trained", False))
    kwargs.pop("use_retrace", None)  # an older run-time switch: the round policy decides now
    if kwargs.pop("model_type", model_type) != model_type:
        found["retrace"] = "absent"  # a published DFlash checkpoint: no ReTrace module until one is added
    rope = kwargs.pop("rope_parameters", None) or kwargs.pop("rope_scaling", None) or {}
    found["rope_theta"] = rope.get("rope_theta", fields["rope_theta"])
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(
            f"ReTraceConfig supports plain RoPE only, but the checkpoint asks for rope_type={rope_type!r}. "
            "Open an issue with the checkpoint name."
        )
    for unused in ("use_sliding_window", "max_window_layers", "tie_word_embeddings", "use_cache", "auto_map"):
        kwargs.pop(unused, None)
    return found


def _normalised(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields with their derived defaults (``head_dim``, ``layer_types``, ``retrace_hidden_size``) and types."""
    out = dict(fields)
    if out["head_dim"] is None:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if out["layer_types"] is None:
        out["layer_types"] = ["full_attention"] * out["num_hidden_layers"]
    out["retrace_hidden_size"] = out["retrace_hidden_size"] or out["hidden_size"]
    out["layer_types"] = list(out["layer_types"])
    out["target_layer_ids"] = None if out["target_layer_ids"] is None else list(out["target_layer_ids"])
    for name, cast in (("rope_theta", float), ("input_embedding_scale", float), ("block_size", int), ("lookup", bool),
                       ("lookup_min_ngram", int), ("lookup_max_ngram", int), ("lookup_num_tokens", int),
                       ("lookup_start_tokens", int)):
        out[name] = cast(out[name])
    return out


def _retrace_state(retrace: str | bool, trained: bool = False) -> str:
    """The ReTrace state from a config's ``retrace`` (a state, or the bool of configs saved before, with their
    ``retrace_trained``)."""
    if isinstance(retrace, bool):
        return ("trained" if trained else "untrained") if retrace else "absent"
    return retrace


class ReTraceConfig(PretrainedConfig):
    r"""Configuration of a :class:`~hf_retrace.ReTraceDrafter`.

    DFlash fields: the drafter is a stack of Qwen3-style decoder layers (``hidden_size`` ... ``head_dim``) that reads
    the target's hidden states at ``target_layer_ids`` and drafts ``block_size - 1`` tokens per forward from the block
    ``[anchor, MASK x (block_size - 1)]``. ``vocab_size`` and ``hidden_size`` must equal the target's: the drafter
    borrows the target's embedding table and ``lm_head``. ``mask_token_id`` is a row of the target's embedding table,
    or ``None`` with ``learned_mask_embedding=True`` (the drafter then owns a mask vector). ``draft_vocab_size``
    (optional, ours) restricts drafting to that many token ids (the buffer ``draft_vocab``, e.g. the tokens of the
    training responses): the target's ``lm_head`` rows for them are all the drafter scores, which makes a drafting
    round cheaper on small targets. Tokens outside it are never drafted; the target still produces them.

    ReTrace: ``retrace`` says what the drafter holds, one of ``RETRACE_STATES``: ``"absent"`` (no module: a plain DFlash
    drafter), ``"untrained"`` (a module with a zero output projection, which drafts exactly as the backbone) or
    ``"trained"``; ``retrace_ablation`` is the variant the module was trained as (one of ``RETRACE_ABLATIONS``).
    Whether a call fuses the rejected suffix is the call's round policy (``RoundPolicy.retrace``; the shipped policy
    turns it on exactly for a trained module; ``drafter.with_policy(retrace=True)`` for one call). Configs saved
    before (``retrace`` a bool, ``retrace_trained``, ``use_retrace``) load as the same state.

    Round shape (ours): ``draft_confidence_threshold`` cuts a block before the first slot after slot 1 whose top draft
    probability falls below it (``None``: full blocks; the shipped drafter carries a value calibrated on training
    prompts).
    ``lookup`` adds context lookup as a second source: a round whose newest ``lookup_min_ngram``..``lookup_max_ngram``
    tokens occurred earlier in the context proposes up to ``lookup_num_tokens`` tokens that followed them, and
    skips the drafter forward; its budget starts at ``lookup_start_tokens``, doubles after a fully accepted lookup
    block and falls back after a rejection (:func:`~hf_retrace.generation.lookup.next_lookup_budget`).

    Example::

        config = ReTraceConfig(hidden_size=576, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                               head_dim=64, intermediate_size=1536, vocab_size=49152, block_size=16,
                               target_layer_ids=[1, 8, 14, 20, 27], num_target_layers=30, mask_token_id=0)
    """

    model_type = "retrace_drafter"

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 12288,
        num_hidden_layers: int = 5,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 1_000_000.0,
        max_position_embeddings: int = 40960,
        attention_bias: bool = False,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        num_target_layers: int | None = None,
        learned_mask_embedding: bool = False,
        input_embedding_scale: float = 1.0,
        draft_vocab_size: int | None = None,
        retrace: str | bool = "untrained",
        retrace_hidden_size: int | None = None,
        retrace_ablation: str = "full",
        draft_confidence_threshold: float | None = None,
        lookup: bool = False,
        lookup_min_ngram: int = 2,
        lookup_max_ngram: int = 4,
        lookup_num_tokens: int = 10,
        lookup_start_tokens: int = 2,
        proposal_mode: str = "argmax",
        **kwargs: Any,
    ):
        fields = {name: value for name, value in locals().items() if name not in ("self", "kwargs", "__class__")}
        fields.update(_stored_layout(fields, kwargs, self.model_type))
        for name, value in _normalised(fields).items():
            setattr(self, name, value)
        super().__init__(tie_word_embeddings=False, **kwargs)
        # validated when a drafter is built: transformers instantiates a default config to diff against

    def validate_drafter_fields(self) -> None:
        """Raise a ValueError that says what to fix when the DFlash fields cannot describe a working drafter."""
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2 (one anchor + one drafted slot), got {self.block_size}.")
        if self.mask_token_id is None and not self.learned_mask_embedding:
            raise ValueError(
                "The drafter config has no mask_token_id. Set `mask_token_id` to a row of the target's embedding "
                "table (for Qwen3: 151669), or `learned_mask_embedding=True` to give the drafter its own mask vector."
            )
        if not self.target_layer_ids:
            raise ValueError(
                "The drafter config has no target_layer_ids (which target layers the drafter reads). Set them, e.g. "
                "`build_target_layer_ids(num_target_layers, 5)`."
            )
        if self.proposal_mode not in PROPOSAL_MODES:
            raise ValueError(f"proposal_mode must be one of {PROPOSAL_MODES}, got {self.proposal_mode!r}.")
        if self.retrace not in RETRACE_STATES:
            raise ValueError(f"retrace must be one of {RETRACE_STATES} (what the drafter holds), got {self.retrace!r}.")
        if self.retrace_ablation not in RETRACE_ABLATIONS:
            raise ValueError(f"retrace_ablation must be one of {RETRACE_ABLATIONS}, got {self.retrace_ablation!r}.")
        dims = {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim}
        bad = {k: v for k, v in dims.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"The drafter config has invalid dimensions {bad}: each must be a positive integer.")
        h, n = self.hidden_size, len(self.target_layer_ids)
        params = self.num_hidden_layers * (4 * h * h + 3 * h * self.intermediate_size) + n * h * h
        if params > MAX_DRAFTER_PARAMETERS:
            raise ValueError(
                f"The drafter config describes ~{params / 1e9:.0f}B parameters (hidden {h}, intermediate "
                f"{self.intermediate_size}, {self.num_hidden_layers} layers), more than any drafter "
                f"({MAX_DRAFTER_PARAMETERS / 1e9:.0f}B): the config is corrupt or not a drafter's. Nothing was allocated."
            )
        threshold = self.draft_confidence_threshold
        if threshold is not None and not 0.0 <= threshold < 1.0:
            raise ValueError(
                f"draft_confidence_threshold must be in [0, 1) (the drafter's own top probability below which a block "
                f"is cut) or None for full blocks, got {threshold!r}."
            )
        if not 1 <= self.lookup_min_ngram <= self.lookup_max_ngram:
            raise ValueError(
                f"lookup needs 1 <= lookup_min_ngram <= lookup_max_ngram, got {self.lookup_min_ngram} and "
                f"{self.lookup_max_ngram}."
            )
        if self.lookup_num_tokens < 1:
            raise ValueError(f"lookup_num_tokens must be at least 1, got {self.lookup_num_tokens}.")
        if not 1 <= self.lookup_start_tokens <= self.lookup_num_tokens:
            raise ValueError(
                f"lookup_start_tokens (a lookup round's first budget) must be in 1..lookup_num_tokens "
                f"({self.lookup_num_tokens}), got {self.lookup_start_tokens}."
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}."
            )
