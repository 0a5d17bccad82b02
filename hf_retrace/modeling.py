"""The DFlash drafter: Qwen3-style layers whose attention also reads the target's context (KV injection).

One forward drafts a whole block: queries come from the block ``[anchor, MASK x (B-1)]`` only; keys and values are
``[context ; block]`` in every layer, where the context is the target's tapped hidden states fused by ``fc`` and
``hidden_norm``. Attention is non-causal; slot ``j`` predicts the token at position ``anchor + j``. The drafter owns
no embedding table and no LM head: the target's are borrowed at run time and never stored in its checkpoint.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from .configuration import PROPOSAL_MODES, ReTraceConfig, layer_columns
from .layers import DrafterLayer, RMSNorm, RotaryEmbedding
from .retrace import AlignedSuffix, ReTraceFusion
from .stats import GenerationStats, last_stats_slot


ROUND_RECORDS_FILENAME = "round_records.json.gz"  # the drafter's recorded rounds, beside its weights


class ReTraceDrafter(PreTrainedModel):
    r"""A DFlash block drafter with an optional ReTrace module, used as ``assistant_model`` in ``generate``.

    Example::

        import hf_retrace
        drafter = hf_retrace.ReTraceDrafter.from_pretrained("z-lab/Qwen3-8B-DFlash-b16")
        out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256)
        print(drafter.last_stats.mean_acceptance_length)
    """

    config_class = ReTraceConfig
    base_model_prefix = "drafter"
    main_input_name = "noise_embedding"
    supports_gradient_checkpointing = False
    _supports_sdpa = True
    _no_split_modules = ["DrafterLayer"]
    _hf_retrace_drafter = True  # the dispatch marker read by hf_retrace.generation.dispatch

    def __init__(self, config: ReTraceConfig):
        config.validate_drafter_fields()
        super().__init__(config)
        num_features = len(config.target_layer_ids)
        self.layers = nn.ModuleList([DrafterLayer(config, i) for i in range(config.num_hidden_layers)])
        self.fc = nn.Linear(num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        if config.learned_mask_embedding:
            self.mask_embedding = nn.Parameter(torch.zeros(config.hidden_size))
        if config.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size, dtype=torch.long))
        else:
            self.draft_vocab = None
        self.retrace = None if config.retrace == "absent" else ReTraceFusion(config)
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> "ReTraceDrafter":
        """``PreTrainedModel.from_pretrained`` that reads safetensors only (never a pickled ``.bin``). A weights file
        that cannot be read (cut short by an interrupted download, copy or save) raises an OSError naming it."""
        from pathlib import Path

        from huggingface_hub import try_to_load_from_cache
        from safetensors import SafetensorError, safe_open

        kwargs.setdefault("use_safetensors", True)
        try:
            return super().from_pretrained(*args, **kwargs)
        except SafetensorError as error:
            source = str(args[0] if args else kwargs.get("pretrained_model_name_or_path", ""))
            if Path(source).is_dir():
                files = sorted(Path(source).glob("*.safetensors"))
                fix = "copy the folder again from where it came (or save the drafter again)"
            else:  # a Hub id: the file sits in the Hub cache
                cached = try_to_load_from_cache(source, "model.safetensors", cache_dir=kwargs.get("cache_dir"),
                                                revision=kwargs.get("revision"))
                files = [Path(cached)] if isinstance(cached, str) else []
                fix = f"download it again: ReTraceDrafter.from_pretrained({source!r}, force_download=True)"
            unreadable = []
            for file in files:
                try:
                    with safe_open(str(file), framework="pt"):
                        pass
                except (SafetensorError, OSError):
                    unreadable.append(str(file))
            named = ", ".join(unreadable or map(str, files)) or f"the weights of {source}"
            raise OSError(f"The drafter's weights file {named} cannot be read ({error}): it is damaged or was cut "
                          f"short (an interrupted download, copy or save). Nothing was loaded: {fix}.") from error

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> None:
        """``PreTrainedModel.save_pretrained`` (and so ``push_to_hub``), plus the drafter's recorded rounds
        (``round_records.json.gz``) when its source folder has them: the round-policy tuner replays them on each
        machine (:mod:`hf_retrace.tuning`)."""
        import shutil
        from pathlib import Path

        super().save_pretrained(save_directory, *args, **kwargs)
        source = Path(str(self.name_or_path or "")) / ROUND_RECORDS_FILENAME
        target = Path(save_directory) / ROUND_RECORDS_FILENAME
        if source.is_file() and source.resolve() != target.resolve():
            shutil.copyfile(source, target)

    # --- weights -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = 0.02
        if isinstance(module, nn.Linear) and getattr(module, "zero_init", False):
            module.weight.zero_()  # ReTrace's output projection: untrained ReTrace == its DFlash backbone
        elif isinstance(module, nn.Linear):
            module.weight.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, ReTraceDrafter) and getattr(module, "mask_embedding", None) is not None:
            module.mask_embedding.normal_(mean=0.0, std=std)

    def add_retrace(self) -> ReTraceFusion:
        """Give a plain DFlash drafter an (untrained, zero-output) ReTrace module, e.g. before ReTrace training."""
        if self.retrace is None:
            self.config.retrace = "untrained"
            self.retrace = ReTraceFusion(self.config).to(device=self.device, dtype=self.dtype)
            self.retrace.apply(self._init_weights)
        return self.retrace

    @property
    def last_stats(self) -> GenerationStats | None:
        """Stats of the latest ``generate`` call made with this drafter in the current thread (None before any)."""
        return last_stats_slot(self).get()

    round_policy = None  # a view's own RoundPolicy (with_policy); None: resolved per call
    policy_changes: dict = {}  # a view's changes on top of the resolved policy (with_policy(**changes))

    def with_policy(self, policy: Any = None, **changes: Any) -> "ReTraceDrafter":
        """This drafter (the same weights, no copy) with its own round policy for the calls it is passed to.

        ``policy``: a :class:`~hf_retrace.generation.policy.RoundPolicy` used as is; ``changes``: fields replaced on
        top of the policy the call would otherwise get (the tuned one, ``HF_RETRACE_POLICY``, or the shipped one),
        e.g. ``drafter.with_policy(lookup_cap=16)``. Nothing shared is mutated: concurrent calls with different views
        never see each other's choices.
        """
        view = copy.copy(self)  # shares _parameters/_modules/_buffers; its own __dict__ for the policy
        view.round_policy = policy if policy is not None else self.round_policy
        # checked and applied per call, before the target runs (generation.policy.resolve_policy: one rule for views)
        view.policy_changes = {**self.policy_changes, **changes}
        return view

    drafter_source = None  # a view's own class for the drafter's rounds (with_drafter_source); None: DrafterSource

    def with_drafter_source(self, source: Any) -> "ReTraceDrafter":
        """This drafter (no copy) whose rounds propose through ``source``: a class taking
        :class:`~hf_retrace.generation.drafter_source.DrafterSource`'s arguments, e.g. a test's fixed proposals."""
        view = copy.copy(self)
        view.drafter_source = source
        return view

    @property
    def proposal_mode(self) -> str:
        """Under sampling: "argmax" (default; sample-and-match) or "sample" (sampled drafts + rejection sampling)."""
        return self.config.proposal_mode

    @proposal_mode.setter
    def proposal_mode(self, mode: str) -> None:
        if mode not in PROPOSAL_MODES:
            raise ValueError(f"proposal_mode must be one of {PROPOSAL_MODES}, got {mode!r}.")
        self.config.proposal_mode = mode

    _NO_GENERATION_CONFIG = (
        "hf_retrace's dispatch is not active for this target, so transformers treated the drafter as a stock "
        "assistant: call `hf_retrace.attach(target)` first (or import hf_retrace without HF_RETRACE_NO_GLOBAL_PATCH=1)."
    )

    @property
    def generation_config(self):
        # transformers' stock assistant path reads this first: reaching it means our dispatch was bypassed
        raise AttributeError(self._NO_GENERATION_CONFIG)

    @generation_config.setter
    def generation_config(self, value) -> None:  # transformers 4.x assigns None for non-generative models
        if value is not None:
            raise AttributeError("ReTraceDrafter has no generation_config; generation settings belong to the target.")

    def __getattr__(self, name: str):
        if name == "generation_config":  # a property raising AttributeError falls back here: keep its message
            raise AttributeError(self._NO_GENERATION_CONFIG)
        return super().__getattr__(name)

    def generate(self, *args, **kwargs):
        raise TypeError(
            "ReTraceDrafter drafts for a target model and cannot generate on its own. Pass it to the target instead: "
            "`target.generate(**inputs, assistant_model=drafter)` (after `import hf_retrace`)."
        )

    # --- the DFlash pieces ---------------------------------------------------------------------------------------
    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Fuse the concatenated tapped target states ``[.., n*H]`` into context features ``[.., H]``."""
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def block_embeddings(
        self,
        anchor_ids: torch.Tensor,
        input_embeddings: nn.Module,
        aligned_suffix: AlignedSuffix | None = None,
        ablation: str = "full",
    ) -> torch.Tensor:
        """Embeddings of ``[anchor, MASK x (B-1)]`` per row of ``anchor_ids`` (shape ``[b]``), ReTrace-fused if given.

        ``input_embeddings`` is the target's embedding table; slot 0 always stays the real anchor token. Whether to
        fuse is the caller's per-call choice: it passes ``aligned_suffix`` (and ``ablation``) only when ReTrace is on.
        """
        block_size = self.config.block_size
        anchor = input_embeddings(anchor_ids[:, None]).to(self.dtype)  # [b, 1, H]
        mask = self.mask_vector(input_embeddings).to(anchor.device)
        masks = mask.expand(anchor.shape[0], block_size - 1, -1)
        if aligned_suffix is not None:
            if self.retrace is None:
                raise ValueError("this drafter has no ReTrace module: call block_embeddings without aligned_suffix.")
            masks = self.retrace(masks, aligned_suffix, input_embeddings, ablation)
        embeds = torch.cat([anchor, masks], dim=1)
        return embeds * self.config.input_embedding_scale if self.config.input_embedding_scale != 1.0 else embeds

    # --- scoring against the draft head: the one rule for generation, training and the cost probes ---------------
    def draft_head(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight, bias)``: the target ``lm_head``'s rows the drafter scores (all of them, or those of
        ``draft_vocab``), on the head's device and in its dtype; without a draft vocabulary the head's own tensors (no
        copy). Slice it once per call (or cache it) and pass it to :meth:`compute_logits`."""
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        if self.draft_vocab is None:
            return weight, bias
        rows = self.draft_vocab.to(weight.device)
        return weight[rows], None if bias is None else bias[rows]

    @staticmethod
    def compute_logits(hidden: torch.Tensor, head: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """``[..., Vd]`` float32 scores of the drafter's states ``hidden`` ``[..., H]`` against ``head`` (from
        :meth:`draft_head`), on the head's device. The states are cast to the head's dtype (the head is never copied)
        and scored as a 2-D matmul (a 3-D slice would take matmul's batched path, which copies the whole head)."""
        weight, bias = head
        rows = hidden.reshape(-1, hidden.shape[-1]).to(weight.device, weight.dtype)
        return F.linear(rows, weight, bias).float().view(*hidden.shape[:-1], weight.shape[0])

    def draft_token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Target token ids of indices into the draft head's rows (the identity without a draft vocabulary), on
        ``index``'s device."""
        return index if self.draft_vocab is None else self.draft_vocab.to(index.device)[index]

    def draft_index(self, token_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index into the draft head's rows, in_vocab)`` for target token ids (identity without a draft
        vocabulary; tokens outside it get index 0 and ``in_vocab`` False)."""
        if self.draft_vocab is None:
            return token_ids, torch.ones_like(token_ids, dtype=torch.bool)
        vocab = self.draft_vocab.to(token_ids.device)
        lookup = torch.full((vocab_size,), -1, dtype=torch.long, device=token_ids.device)
        lookup[vocab] = torch.arange(vocab.numel(), device=token_ids.device)
        index = lookup[token_ids]
        return index.clamp_min(0), index >= 0

    def full_vocab_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-head scores spread over the target's ``vocab_size`` tokens; tokens outside the draft vocabulary get
        ``-inf`` (never proposed)."""
        if self.draft_vocab is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab.to(logits.device), logits)

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Restrict drafting to ``token_ids`` (e.g. the most frequent tokens of the training responses)."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).unique(sorted=True)
        self.config.draft_vocab_size = int(token_ids.numel())
        if "draft_vocab" in self._buffers:
            del self._buffers["draft_vocab"]
        elif hasattr(self, "draft_vocab"):
            del self.draft_vocab
        self.register_buffer("draft_vocab", token_ids.to(self.device))

    def set_target_layers(self, layer_ids: Sequence[int]) -> None:
        """Read the target's layers ``layer_ids`` (every layer it reads now among them, in any order): the input
        projection keeps its columns of each layer it read and gains zero columns for the new ones, so the drafter
        computes what it did (up to the order a matmul sums in) until training moves them: a trained drafter given
        more of the target's depth without starting over."""
        old, new = [int(i) for i in self.config.target_layer_ids], [int(i) for i in layer_ids]
        missing = [i for i in old if i not in new]
        if missing or not new or len(set(new)) != len(new):
            raise ValueError(
                f"The drafter reads target layers {old}; it can be given {new} only if every layer it reads is among "
                f"them, each once (missing: {missing}). Pass a list that keeps {old} and adds the new layers; to read "
                "fewer layers, train a drafter from scratch.")
        if self.retrace is not None:
            raise ValueError("Give a drafter new target layers before its ReTrace module is added (add_retrace): the "
                             "module is trained on the backbone as it is.")
        h, weight = self.config.hidden_size, self.fc.weight.detach()
        grown = weight.new_zeros(h, len(new) * h)
        # each old layer's block to that layer's place; a layer read twice before adds its two blocks: the same function
        for block, columns in zip(weight.split(h, dim=1), layer_columns(new, old, h)):
            grown[:, columns] += block
        self.fc = nn.Linear(len(new) * h, h, bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.fc.weight.copy_(grown)
        self.config.target_layer_ids = new

    def mask_vector(self, input_embeddings: nn.Module) -> torch.Tensor:
        """The MASK embedding: the drafter's own learned vector, or the target's row ``mask_token_id``."""
        if self.config.learned_mask_embedding:
            return self.mask_embedding
        weight = input_embeddings.weight
        return weight[self.config.mask_token_id].to(self.dtype)

    def forward(
        self,
        target_hidden: torch.Tensor | None = None,
        noise_embedding: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any | None = None,
        use_cache: bool = False,
        attention_mask: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Draft one (or, in training, many) blocks; returns the block's normed hidden states ``[b, q_len, H]``.

        Call-compatible with the z-lab reference drafter: ``target_hidden`` are the concatenated tapped target states
        of the context positions not yet in ``past_key_values``; ``position_ids`` cover ``[those positions ; block]``.
        ``context`` may be given instead of ``target_hidden`` when it is already projected. ``attention_mask`` is an
        optional boolean ``[b, 1, q_len, kv_len]`` (True = may attend), used by training's many-block layout.
        """
        if noise_embedding is None:
            raise ValueError("ReTraceDrafter.forward needs `noise_embedding` (the embedded block).")
        hidden_states = noise_embedding.to(self.dtype)
        if context is None:
            if target_hidden is None:
                raise ValueError("ReTraceDrafter.forward needs `target_hidden` (or a projected `context`).")
            context = self.project_context(target_hidden)
        q_len, ctx_len = hidden_states.shape[1], context.shape[1]
        if position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(past, past + ctx_len + q_len, device=hidden_states.device)[None]
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        if position_ids.shape[-1] != ctx_len + q_len:
            raise ValueError(
                f"position_ids must cover the new context and the block ({ctx_len} + {q_len} positions), "
                f"got {position_ids.shape[-1]}."
            )
        cos, sin = self.rotary_emb(position_ids, hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, context, cos, sin, attention_mask, past_key_values)
        return self.norm(hidden_states)
