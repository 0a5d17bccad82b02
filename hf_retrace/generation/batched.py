"""Batch > 1 with a drafter: per-row rounds over one target cache, every unfinished row verified in one forward.

transformers' assisted loop is batch-1 only, so a left-padded batch runs this loop of ours, entered through the same
hook (:mod:`.dispatch`). Each row keeps its own round (a :class:`~.candidate_generator.ReTraceCandidateGenerator`'s
sources: the drafter's context cache, the lookup index, ReTrace's carry, the guard and the stats), and proposes on its
own unpadded tokens and positions. One drafter forward drafts every running row's block (:mod:`.batched_drafter`);
each row's round then cuts, chooses and scores its own block (the draft head runs per row). One target forward
verifies all unfinished rows: ``[rows, max k + 1]``, short blocks padded on the right.

The target cache stays exact for ragged acceptance by keeping every verified slot and masking out, in the 2-D
attention mask, the slots a row did not commit (rejected drafts and the right padding): a later query never attends
to them, and each row's position ids count its committed tokens only (as plain decoding numbers a left-padded row).
So every row's attention sees exactly the keys and positions of plain batched ``generate``; only the order of the
floating-point sums differs (a verify over several tokens), as at batch 1. When the masked slots a compaction would
remove outnumber the committed ones, the cache is compacted (:mod:`.batched_cache`: each row's committed slots
gathered to the right, its left padding grown).
A finished row leaves the batch (its cache row is dropped): it neither drafts nor costs verify work any more.

Each row's tokens are those of plain batched ``generate`` on the same padded batch (greedy, fp32): its logits
processors see the row's padded sequence, its stopping criteria are checked at every committed token, a finished row
is padded with ``pad_token_id`` as plain pads it (or, when the call has no EOS criterion, keeps decoding as plain does
until every row stopped). Under sampling each row follows the target's law (sample-and-match, or rejection sampling
for sampled proposals: transformers' ``_speculative_sampling``).

Example::

    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    out = target.generate(**batch, assistant_model=drafter, max_new_tokens=128)
"""

from __future__ import annotations

import copy
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import utils as generation_utils
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)
from transformers.generation.stopping_criteria import MaxTimeCriteria

from ..machine import onednn_matmuls
from ..stats import GenerationStats, last_stats_slot
from . import batched_cache
from .batched_drafter import BatchedDrafterForward, batches_drafts
from .candidate_generator import ReTraceCandidateGenerator
from .policy import RoundPolicy
from .proposal import Proposal, RoundInputs, Verdict
from .target_features import TargetTap, cache_kwargs

__all__ = ["batch_size_of", "batched_assisted_decoding", "check_batch", "left_padded", "left_padding",
           "pad_token_id_of", "row_processors"]

# what generate hands the assisted loop for a decoder-only prompt; anything else is refused at batch > 1
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "logits_to_keep", "cache", "past_key_values", "use_cache",
                       "cache_position", "output_attentions", "output_hidden_states", "return_dict"}


def batch_size_of(original: Any, target: Any, args: tuple, kwargs: dict) -> int:
    """The number of rows in an ``_assisted_decoding`` call's ``input_ids`` (1 when they cannot be read)."""
    bound = inspect.signature(original).bind(target, *args, **kwargs)
    input_ids = bound.arguments.get("input_ids")
    return int(input_ids.shape[0]) if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else 1


def pad_token_id_of(generation_config: Any) -> int:
    """The id a call pads with: the generation config's ``pad_token_id``, else its (first) EOS id, else 0."""
    pad = generation_config.pad_token_id
    if pad is None:
        pad = generation_config.eos_token_id
        pad = pad[0] if isinstance(pad, (list, tuple)) else pad
    return int(pad) if pad is not None else 0


def left_padded(rows: list[list[int]], pad: int, device: Any = None) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of token-id lists padded on the left with ``pad`` (what a tokenizer with
    ``padding_side="left"`` returns), on ``device``."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention_mask[b, width - len(row) :] = 1
    return dict(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` number of left-padding positions per row; raises a ValueError for a mask that is not left padding
    (zeros after a one, or a row with no token)."""
    mask = attention_mask.long()
    pads = (mask.cumsum(-1) == 0).sum(-1)
    width = mask.shape[1]
    expected = torch.arange(width, device=mask.device)[None] >= pads[:, None]
    if not bool((expected.long() == mask).all()):
        raise ValueError(
            "The batch's attention_mask is not left padding (a row has a masked position after a token): a batch with "
            "a drafter must be padded on the left, as decoder-only generation needs anyway. Tokenize with "
            "padding_side='left' (tokenizer(prompts, padding=True, padding_side='left', return_tensors='pt'))."
        )
    if bool((pads == width).any()):
        row = int((pads == width).nonzero()[0, 0])
        raise ValueError(f"Row {row} of the batch is all padding (an empty prompt): the target needs at least one "
                         "token to continue from. Drop the row, or give it at least one token (e.g. the BOS token).")
    return pads


def check_batch(target: Any, input_ids: torch.Tensor, model_kwargs: dict, generation_config: Any,
                check_prompt: Callable[[torch.Tensor], None], logits_processor: Any = None, streamer: Any = None,
                synced_gpus: bool = False) -> torch.Tensor:
    """Raise a ValueError saying what to do for a batched call the batch loop cannot run exactly, before the target
    runs; return the attention mask (all ones when none was given). Every row is also checked as a prompt of its own
    by ``check_prompt(row_ids)`` (the call's ``check_prompt``, ``checks.check_inputs``: ids in the vocabulary, the
    target's context)."""
    rows = input_ids.shape[0]
    refused = []
    if streamer is not None:
        refused.append("a streamer (it takes one sequence's tokens; rows here commit different numbers of tokens per "
                       "round): drop `streamer`, or stream one prompt per call")
    if synced_gpus:
        refused.append("synced_gpus=True (the batch loop runs on one process): drop synced_gpus")
    config = generation_config
    if config.return_dict_in_generate and (config.output_scores or config.output_logits):
        refused.append("output_scores / output_logits (plain decoding keeps scoring a finished row's padding, which "
                       "this loop, where a finished row costs nothing, never computes): drop them, or call generate "
                       "once per prompt")
    if config.return_dict_in_generate and (config.output_attentions or config.output_hidden_states):
        refused.append("output_attentions / output_hidden_states (not split per row yet): drop them, or call "
                       "generate once per prompt")
    if getattr(target.config, "is_encoder_decoder", False):
        refused.append("an encoder-decoder target: drafters draft for decoder-only targets")
    text_config = target.config.get_text_config()
    layer_types = getattr(text_config, "layer_types", None) or []
    sliding = any(kind != "full_attention" for kind in layer_types) or (
        getattr(text_config, "sliding_window", None) is not None and getattr(text_config, "use_sliding_window", True)
        and not layer_types)
    if sliding:
        refused.append("a target with sliding-window (or other non-full) attention layers: the batch loop keeps "
                       "masked slots in the cache, which a window counts")
    extra = sorted(set(model_kwargs) - _KNOWN_MODEL_KWARGS)
    if extra or model_kwargs.get("inputs_embeds") is not None:
        refused.append(f"the model inputs {', '.join(extra or ['inputs_embeds'])} (a batch with a drafter takes "
                       "input_ids and attention_mask only): pass the token ids and their attention mask")
    if refused:
        raise ValueError(f"hf_retrace runs a batch of {rows} rows with a drafter, but not with " + "; nor with ".join(
            refused) + ". (Or drop `assistant_model` for plain batched generate.)")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
        raise ValueError("generate was given a pre-filled cache: the drafter has no target hidden states for the "
                         "cached prefix. Pass the full prompts without `past_key_values`.")
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)} but input_ids "
                         f"{list(input_ids.shape)}: pass the batch's own mask (the tokenizer's, padding_side='left').")
    pads = left_padding(attention_mask)
    for row in range(rows):
        try:
            check_prompt(input_ids[row : row + 1, int(pads[row]) :])
        except ValueError as error:
            raise ValueError(f"Row {row} of the batch: {error}") from None
    return attention_mask


def _accept_greedy(drafts: torch.Tensor, selected: torch.Tensor) -> int:
    """How many drafts ``[k]`` equal the target's choices ``[k + 1]`` before the first difference (greedy, and
    sample-and-match under sampling: transformers' assisted loop's rule, with a row dimension taken out)."""
    k = drafts.shape[0]
    return int((drafts == selected[:k]).long().cumprod(0).sum()) if k else 0


_SPECULATIVE_SAMPLING_ARGS = inspect.signature(generation_utils._speculative_sampling).parameters


def _accept_sampled(drafts: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Rejection sampling of one row's sampled drafts (transformers' ``_speculative_sampling``, the lossless rule): the
    committed tokens ``[n + 1]``. 4.57's version takes an ``is_done_candidate`` flag (the EOS cut happens here)."""
    extra = {"is_done_candidate": False} if "is_done_candidate" in _SPECULATIVE_SAMPLING_ARGS else {}
    k = drafts.shape[0]
    valid, _ = generation_utils._speculative_sampling(drafts[None], draft_logits, k, target_logits[None], **extra)
    return valid[0]


def _for_row(function: Any, row: int) -> Any:
    return lambda batch_id, ids: function(row, ids)


def row_processors(logits_processor: Any, row: int) -> LogitsProcessorList:
    """The call's processors as row ``row`` alone sees them, for calls on that row's ``[1, L]`` sequence.

    transformers' processors are row-wise functions of ``(input_ids, scores)`` except those holding one value per row
    of the batch: the repetition penalty's ``prompt_ignore_length`` (5.x skips each row's left padding), the encoder
    penalties' prompt ids and n-grams (a decoder-only target's prompt), and ``prefix_allowed_tokens_fn``, which is
    called with the row's index. Each of those gets a copy holding that row's value; every other processor is shared
    (a user's own processor must be a row-wise function too, as it is for plain batched decoding)."""
    processors = []
    for processor in logits_processor or []:
        if isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(
                getattr(processor, "prompt_ignore_length", None), torch.Tensor):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = processor.prompt_ignore_length[row : row + 1]
        elif isinstance(processor, EncoderRepetitionPenaltyLogitsProcessor):
            processor = copy.copy(processor)
            processor.encoder_input_ids = processor.encoder_input_ids[row : row + 1]
        elif isinstance(processor, EncoderNoRepeatNGramLogitsProcessor):
            processor = copy.copy(processor)
            processor.generated_ngrams, processor.batch_size = [processor.generated_ngrams[row]], 1
        elif isinstance(processor, PrefixConstrainedLogitsProcessor):
            processor = copy.copy(processor)
            processor._prefix_allowed_tokens_fn = _for_row(processor._prefix_allowed_tokens_fn, row)
        processors.append(processor)
    return LogitsProcessorList(processors)


@dataclass
class _Row:
    """One row's state: its padded sequence (what the target and its processors see), its round, and where it is."""

    index: int
    padding: int
    sequence: torch.Tensor  # [P + t], the left padding included
    generator: ReTraceCandidateGenerator
    processors: LogitsProcessorList  # the call's logits processors, as this row sees them
    pending: torch.Tensor | None = None  # the newest committed token: the target has no K/V for it yet
    proposal: Proposal | None = None
    drafts: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    stop_length: int | None = None  # the sequence length at which a stopping criterion was met

    def unpadded(self) -> torch.Tensor:
        return self.sequence[self.padding :][None]


class BatchedLoop:
    """One batched call; see the module. ``run()`` returns the padded ``sequences`` ``[B, P + longest row]``."""

    def __init__(self, target: Any, drafter: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 generation_config: Any, logits_processor: Any, stopping_criteria: Any, policy: RoundPolicy):
        self.target, self.drafter, self.config, self.policy = target, drafter, generation_config, policy
        criteria = list(stopping_criteria if stopping_criteria is not None else StoppingCriteriaList())
        self.per_token_criteria = StoppingCriteriaList([c for c in criteria if not isinstance(c, MaxTimeCriteria)])
        self.time_criteria = StoppingCriteriaList([c for c in criteria if isinstance(c, MaxTimeCriteria)])
        # plain decoding pads a finished row only when an EOS criterion exists; otherwise it keeps decoding it
        self.pads_finished = any(hasattr(c, "eos_token_id") for c in criteria)
        pad = generation_config.pad_token_id
        self.pad_token_id = int(pad if not isinstance(pad, (list, tuple)) else pad[0]) if pad is not None else 0
        self.input_ids, self.attention_mask = input_ids, attention_mask.long()
        self.prompt_width = input_ids.shape[1]
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.tap = TargetTap(target, drafter.config.target_layer_ids, False)
        self.forward_extra = dict(self.tap.model_kwargs_overrides)
        pads = left_padding(attention_mask)
        self.rows = []
        for b in range(input_ids.shape[0]):
            processors = row_processors(logits_processor, b)
            generator = ReTraceCandidateGenerator(drafter, target, generation_config, processors,
                                                  prompt_length=input_ids.shape[1] - int(pads[b]), policy=policy,
                                                  rows=input_ids.shape[0])
            generator.close()  # its own tap is not used: this loop taps the target once for all rows
            self.rows.append(_Row(b, int(pads[b]), input_ids[b].clone(), generator, processors))
        self.verify_seconds = self.draft_seconds = 0.0  # the batch's shared forwards, counted once
        sources = [row.generator.drafter_source for row in self.rows]
        # one drafter forward for all rows' blocks (else each row's source runs its own)
        self.shared_drafts = BatchedDrafterForward(drafter) if batches_drafts(drafter, sources) else None

    def close(self) -> None:
        self.tap.close()

    # --- the target side -----------------------------------------------------------------------------------------
    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any,
                 last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp32 logits [R, W or 1, V], tapped states [R, W, n * H])`` of one target forward over ``tokens``."""
        extra = dict(self.forward_extra)
        if last_only and "logits_to_keep" in inspect.signature(self.target.forward).parameters:
            extra["logits_to_keep"] = 1
        outputs = self.target(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                              **cache_kwargs(self.target, cache), **extra)
        return outputs.logits.float(), self.tap.window(outputs)

    def _choose(self, row: _Row, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(committed tokens [n + 1], processed logits [k + 1, V])`` for one row's verified block."""
        k = row.drafts.shape[0]
        processed = logits.clone()
        if len(row.processors):
            ids = torch.cat([row.sequence, row.drafts])[None]
            width = row.sequence.shape[0]
            for i in range(k + 1):  # what plain decoding passes its processors at each of these positions
                processed[i] = row.processors(ids[:, : width + i], processed[i : i + 1])[0]
        if self.do_sample and row.proposal is not None and row.proposal.logits is not None and k:
            return _accept_sampled(row.drafts, row.proposal.logits.to(processed.device).float(), processed), processed
        if self.do_sample:
            selected = torch.multinomial(processed.softmax(-1), num_samples=1)[:, 0]
        else:
            selected = processed.argmax(-1)
        n = _accept_greedy(row.drafts, selected)
        return selected[: n + 1], processed

    def _commit(self, row: _Row, tokens: torch.Tensor) -> int:
        """Append ``tokens`` one by one, checking the stopping criteria after each as plain decoding does; returns how
        many were appended (fewer when a criterion is met inside the block or the row reaches max_length)."""
        appended = 0
        for token in tokens:
            if row.sequence.shape[0] >= self.max_length or (row.stop_length is not None and not self._runs_on(row)):
                break
            row.sequence = torch.cat([row.sequence, token.view(1)])
            appended += 1
            if row.stop_length is None and bool(self.per_token_criteria(row.sequence[None], None).any()):
                row.stop_length = row.sequence.shape[0]
        return appended

    def _runs_on(self, row: _Row) -> bool:
        """Whether the row still needs tokens: before max_length and its stop, or, with no EOS criterion (plain
        decoding then keeps decoding a stopped row), until the longest stop once every row has stopped."""
        if row.sequence.shape[0] >= self.max_length:
            return False
        if row.stop_length is None:
            return True
        if self.pads_finished:
            return False
        if any(other.stop_length is None for other in self.rows):
            return True
        return row.sequence.shape[0] < max(other.stop_length for other in self.rows)

    # --- the loop ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self) -> torch.Tensor:
        cache = DynamicCache()
        mask = self.attention_mask
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        logits, window = self._forward(self.input_ids, positions, mask, cache, last_only=True)
        live = list(self.rows)  # the rows in the cache, in its row order
        next_position = mask.sum(-1)
        for r, row in enumerate(live):
            tokens, _ = self._choose(row, logits[r, -1:])
            self._commit(row, tokens)
            row.pending = tokens[:1]
            row.generator.drafter_source.read(window[r : r + 1, row.padding :], row.sequence.shape[0] - row.padding - 1)
        timed_out = bool(self.time_criteria(self.input_ids, None).any()) if len(self.time_criteria) else False
        while not timed_out:
            keep = [r for r, row in enumerate(live) if self._runs_on(row)]
            if not keep:
                break
            if len(keep) < len(live):  # finished rows leave the batch: no drafting, no verify work
                cache.batch_select_indices(torch.tensor(keep, device=mask.device))
                mask, next_position = mask[keep], next_position[keep]
                live = [live[r] for r in keep]
                if self.shared_drafts is not None:
                    self.shared_drafts.keep(keep)
            if self.shared_drafts is not None and any(self.max_length - row.sequence.shape[0] > 1 for row in live):
                started = time.perf_counter()
                with onednn_matmuls(self.policy.drafter_onednn):  # as the tuner priced the batch's drafter round
                    self.shared_drafts.draft([row.generator.drafter_source for row in live],
                                             torch.stack([row.sequence[-1] for row in live]))
                self.draft_seconds += time.perf_counter() - started
            for row in live:
                self._propose(row)
            tokens, slot_mask = self._verify_batch(live, mask)
            verify_positions = next_position[:, None] + torch.arange(tokens.shape[1], device=mask.device)[None]
            started = time.perf_counter()
            logits, window = self._forward(tokens, verify_positions, torch.cat([mask, slot_mask], 1), cache)
            self.verify_seconds += time.perf_counter() - started
            committed_slots = torch.zeros_like(slot_mask)
            for r, row in enumerate(live):
                k = row.drafts.shape[0]
                chosen, processed = self._choose(row, logits[r, : k + 1])
                appended = self._commit(row, chosen)
                accepted = chosen.shape[0] - 1
                committed_slots[r, : accepted + 1] = 1  # the pending token's slot and the accepted drafts'
                next_position[r] += accepted + 1
                row.pending = chosen[-1:]
                if row.proposal is not None and appended:  # (none: every row stopped before this one's turn)
                    verdict = Verdict(min(accepted, appended - 1), row.unpadded(), processed[None])
                    row.generator.round.observe(row.proposal, verdict)
                anchor = row.sequence.shape[0] - row.padding - 1
                if self._runs_on(row):
                    row.generator.drafter_source.read(window[r : r + 1, : k + 1], anchor)
            mask = torch.cat([mask, committed_slots], 1)
            mask = batched_cache.compact_when_worth_it(cache, mask)
            if len(self.time_criteria):
                timed_out = bool(self.time_criteria(self.input_ids, None).any())
        return self._sequences()

    def _verify_batch(self, live: list[_Row], mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[rows, max k + 1]``: each row's pending token and drafts, right-padded; and the mask of its real slots."""
        width = max(row.drafts.shape[0] for row in live) + 1
        tokens = torch.full((len(live), width), self.pad_token_id, dtype=torch.long, device=mask.device)
        slot_mask = torch.zeros((len(live), width), dtype=mask.dtype, device=mask.device)
        for r, row in enumerate(live):
            block = torch.cat([row.pending, row.drafts])
            tokens[r, : block.shape[0]] = block
            slot_mask[r, : block.shape[0]] = 1
        return tokens, slot_mask

    def _propose(self, row: _Row) -> None:
        """The row's round: its drafts (none when the round proposes nothing, e.g. no room or the guard backs off)."""
        generator = row.generator
        started = time.perf_counter()
        sequence = row.unpadded()
        anchor = sequence.shape[1] - 1
        room = self.max_length - row.sequence.shape[0] - 1
        lookup = generator.lookup
        proposal = generator.round.propose(RoundInputs(anchor, room, sequence),
                                           len(lookup.index) if lookup is not None else None)
        generator.stats.draft_seconds += time.perf_counter() - started
        if proposal is None or len(proposal) == 0:
            row.proposal, row.drafts = None, sequence.new_zeros(0)
            return
        row.proposal, row.drafts = proposal, proposal.tokens[0].to(sequence.device)

    def _sequences(self) -> torch.Tensor:
        """``[B, P + longest row]``: each row as plain batched decoding returns it (padded after its stop)."""
        ends = [row.stop_length if row.stop_length is not None and self.pads_finished else row.sequence.shape[0]
                for row in self.rows]
        if not self.pads_finished and all(row.stop_length is not None for row in self.rows):
            ends = [min(row.sequence.shape[0], max(r.stop_length for r in self.rows)) for row in self.rows]
        width = max(ends)
        out = torch.full((len(self.rows), width), self.pad_token_id, dtype=torch.long, device=self.input_ids.device)
        for row, end in zip(self.rows, ends):
            out[row.index, :end] = row.sequence[:end]
        return out

    def stats(self) -> GenerationStats:
        """The call's stats pooled over rows (τ over every row's rounds); the batch's verify time counted once."""
        for row in self.rows:
            row.generator.stats.new_tokens = row.sequence.shape[0] - self.prompt_width
        pooled = GenerationStats.pooled(row.generator.stats for row in self.rows)
        pooled.verify_seconds = self.verify_seconds
        pooled.draft_seconds += self.draft_seconds
        return pooled


def batched_assisted_decoding(call: Any, original: Any, args: tuple, kwargs: dict) -> Any:
    """The batched ``call`` (dispatch's :class:`~.dispatch.DrafterCall`) in place of transformers' ``_assisted_decoding``
    (``original``): checked before the target runs (each row by ``call.check_prompt``), its policy resolved for its
    batch size (``call.resolve(rows)``), decoded plainly (``call.decode_plainly``) where that policy does not
    speculate, else by :class:`BatchedLoop`. (Dispatch hands the call in: it imports this module.)"""

    target = call.target
    arguments = inspect.signature(original).bind(target, *args, **kwargs).arguments
    input_ids, config = arguments["input_ids"], arguments["generation_config"]
    model_kwargs = dict(arguments.get("model_kwargs") or {})
    attention_mask = check_batch(target, input_ids, model_kwargs, config, call.check_prompt,
                                 arguments.get("logits_processor"), arguments.get("streamer"),
                                 bool(arguments.get("synced_gpus")))
    policy = call.resolve(rows=input_ids.shape[0])
    if not policy.speculate:
        return call.decode_plainly(original, args, kwargs)
    loop = BatchedLoop(target, call.drafter, input_ids, attention_mask, config, arguments.get("logits_processor"),
                       arguments.get("stopping_criteria"), policy)
    try:
        with call.kernels():
            sequences = loop.run()
    finally:
        loop.close()
    last_stats_slot(call.drafter).set(loop.stats())
    if not config.return_dict_in_generate:
        return sequences
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return GenerateDecoderOnlyOutput(sequences=sequences)
