"""Stop exactly where plain decoding stops, although a round commits several tokens at once.

transformers' assisted loop checks the stopping criteria once per round, on the sequence after the round: a stop
string or a custom criterion met by a token in the middle of an accepted block is missed (or seen late), and the call
returns tokens plain ``generate`` never produces. :class:`PerTokenStopping` checks the criteria at every token a round
committed, as plain decoding would, ends the loop at the first token where one is met, and :func:`trim_output` cuts
the returned sequence (and per-token scores/logits) there. A streamer sees exactly the tokens plain decoding streams:
:class:`StopAwareStreamer` holds a round's tokens until the round's stop check has run.

Each criterion is called, for each committed token, with what plain decoding would pass it there: the sequence up to
that token and ``scores`` up to that token (the loop's tuple of processed scores, one per generated token, when
``return_dict_in_generate`` and ``output_scores`` are set; ``None`` otherwise, as in plain decoding). Criteria never
see ``output_logits`` (the loop passes them none, in plain decoding as here).

Time limits (``max_time``) are left to the loop's own check at the end of a round: whether plain decoding would have
run out of time at an earlier token is not knowable, and the output is cut by time either way. With
``return_dict_in_generate``, ``sequences``, ``scores`` and ``logits`` are cut; per-round hidden states and attentions
are returned as the loop produced them. The target's cache is cropped to what plain decoding holds at the stop (the
``sequence length - 1`` positions before the last token), the returned one and a cache the caller passed in alike, so
that ``generate(out.sequences, past_key_values=out.past_key_values)`` continues as it would after plain decoding
(:func:`crop_cache`; where a crop cannot be exact, the returned cache is dropped with a warning).

What is exact in fp32 (and float64): the tokens, i.e. ``sequences``, the streamed tokens and where each call stops.
``scores`` and ``logits`` are the target's own, but from a verify forward over several tokens, which rounds differently
from one-token decoding: in fp32 they match plain ``generate``'s to about 1e-5 (6e-5 seen on SmolLM2-135M), not bit for
bit; with a float64 target, to float32 rounding (the loop hands them out in float32). The cache's K/V differ alike.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList


class StopAwareStreamer:
    """Forwards to ``streamer`` only the tokens before the first stop; holds each round's tokens until it is checked."""

    def __init__(self, streamer: Any, stopping: "PerTokenStopping"):
        self.streamer, self.stopping = streamer, stopping
        self.held: list[torch.Tensor] = []
        stopping.streamer = self

    def put(self, value: torch.Tensor) -> None:
        self.held.append(value)

    def release(self, keep: int | None) -> None:
        """Forward the held tokens; with ``keep``, only the first ``keep`` of them (the round stopped there)."""
        held = torch.cat([v.reshape(-1) for v in self.held]) if self.held else None
        self.held = []
        if held is None:
            return
        if keep is not None:
            held = held[:keep]
        if held.numel():
            self.streamer.put(held[None] if held.dim() == 1 else held)

    def end(self) -> None:
        if self.stopping.stop_at is None:
            self.release(None)
        self.held = []
        self.streamer.end()


class PerTokenStopping(StoppingCriteriaList):
    """The loop's stopping criteria, checked at every committed token instead of once per round (batch size 1)."""

    def __init__(self, criteria: StoppingCriteriaList, prompt_length: int, generators: list | None = None):
        super().__init__(criteria)
        # the call's candidate generator(s), filled when the loop builds one: transformers 4.57 also runs the criteria
        # on each round's unverified candidate, which must not count as committed
        self.generators = generators if generators is not None else []
        self.prompt_length = prompt_length
        self.checked = prompt_length  # sequence lengths up to this one have been checked
        self.stop_at: int | None = None  # the sequence length at which plain decoding stops
        self.streamer: StopAwareStreamer | None = None
        self.cache: Any = None  # the target's cache the loop writes (a caller's own, or the one generate made)
        self._per_token = [c for c in criteria if not isinstance(c, MaxTimeCriteria)]
        self._timed = [c for c in criteria if isinstance(c, MaxTimeCriteria)]

    @staticmethod
    def _met(criteria: list, input_ids: torch.LongTensor, scores: Any, kwargs: dict) -> bool:
        return any(bool(c(input_ids, scores, **kwargs).any()) for c in criteria)

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        length = input_ids.shape[1]
        candidate = any(input_ids is getattr(g, "last_candidates", None) for g in self.generators)
        if candidate and length <= self.checked:
            # 4.57 commits nothing from a "finished" candidate without drafts, but plain decoding never checks the
            # prompt (or a token twice): a prompt that already meets a criterion must still get its tokens
            return torch.zeros((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)
        if length <= self.prompt_length or candidate:
            return super().__call__(input_ids, scores, **kwargs)  # nothing committed to check: as the loop had it
        start = self.checked
        if self.stop_at is None:
            self.stop_at = self._first_stop(input_ids, scores, kwargs, start)
        self.checked = length
        if self.streamer is not None:
            self.streamer.release(None if self.stop_at is None else self.stop_at - start)
        done = self.stop_at is not None or self._met(self._timed, input_ids, scores, kwargs)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    def _first_stop(self, input_ids: torch.LongTensor, scores: Any, kwargs: dict, start: int) -> int | None:
        """The first sequence length after ``start`` at which a criterion is met (None: none is), read with one
        transfer to the host: every criterion is called on every prefix the round committed, in order, with what plain
        decoding would pass it there (in the round where a stop falls, also on the prefixes after it; those results
        are not used)."""
        ends = range(start + 1, input_ids.shape[1] + 1)
        if not self._per_token or not ends:
            return None
        met = [torch.as_tensor(c(input_ids[:, :end], self._scores_up_to(scores, end), **kwargs)).to(input_ids.device)
               .reshape(-1).any() for end in ends for c in self._per_token]
        hits = torch.stack(met).view(len(ends), len(self._per_token)).any(-1).tolist()  # the round's one transfer
        return next((end for end, hit in zip(ends, hits) if hit), None)

    def _scores_up_to(self, scores: Any, end: int) -> Any:
        """What plain decoding passes its criteria after the token at ``end - 1``: the scores of the tokens generated up
        to it (one per token), not those of the whole round."""
        if isinstance(scores, (tuple, list)):
            return tuple(scores[: end - self.prompt_length])
        return scores  # None (scores not recorded): plain decoding passes None too

    def trim(self, output: Any) -> Any:
        """``output`` cut where plain decoding stops, the target's cache cropped to match; the call's stats count the
        tokens returned, not those the last round committed past the stop."""
        if self.stop_at is None:
            return output
        for generator in self.generators:
            generator.stats.cut_at(self.stop_at - self.prompt_length)
        return trim_output(output, self.stop_at, self.prompt_length, cache=self.cache)


def _returned_cache(output: Any) -> tuple[str | None, Any]:
    """(field name, cache) of a ``generate`` output: ``cache`` (transformers 5.24+) or ``past_key_values``."""
    for name in ("cache", "past_key_values"):
        if name in getattr(output, "keys", lambda: ())():
            return name, output[name]
    return None, None


def _evicted_layers(cache: Any) -> list[str]:
    """Layers of ``cache`` that no longer hold every position: cropping them would not give back the states dropped
    already (a sliding window filled past its size, a recurrent state that cannot roll back)."""
    if getattr(cache, "is_croppable", True) is False:
        return [type(cache).__name__]
    evicted = []
    for index, layer in enumerate(getattr(cache, "layers", ())):
        window = getattr(layer, "sliding_window", None)
        if window and layer.get_seq_length() >= window:
            evicted.append(f"layer {index} ({type(layer).__name__}, window {window})")
        elif getattr(layer, "is_croppable", True) is False:
            evicted.append(f"layer {index} ({type(layer).__name__})")
    return evicted


def crop_cache(cache: Any, length: int) -> bool:
    """Crop the target's ``cache`` to its first ``length`` positions; False, and ``cache`` untouched, where that crop
    cannot be exact (:func:`_evicted_layers`, or a cache without ``crop``). A negative ``crop`` removes that many
    positions in transformers 4.57 and 5.x alike."""
    excess = cache.get_seq_length() - length
    if excess <= 0:
        return True
    if not hasattr(cache, "crop") or _evicted_layers(cache):
        return False
    cache.crop(-excess)
    return True


def trim_output(output: Any, stop_at: int | None, prompt_length: int, cache: Any = None) -> Any:
    """``output`` of the assisted loop cut to the first ``stop_at`` positions (the sequence, and the per-token scores,
    logits, hidden states and attentions), and the target's cache (the returned one, and ``cache``, the one the loop
    wrote) cropped to the ``stop_at - 1`` positions plain decoding holds there (the last token's K/V is never
    computed)."""
    if stop_at is None:
        return output
    sequences = output if isinstance(output, torch.Tensor) else getattr(output, "sequences", None)
    if sequences is None or sequences.shape[1] <= stop_at:
        return output
    field, returned = _returned_cache(output)
    for kept in {id(c): c for c in (returned, cache) if c is not None and hasattr(c, "get_seq_length")}.values():
        if crop_cache(kept, stop_at - 1):
            continue
        if kept is returned:  # a cache that disagrees with the sequence would continue it wrongly: none at all
            output[field] = None
            advice = "It is left out of the output (None): continue from the returned sequence alone."
        elif getattr(kept, "_is_user_defined", False):  # the caller's own (5.x marks it); generate's own is dropped
            advice = "Do not reuse that cache: continue from the returned sequence with a new one."
        else:
            continue
        warnings.warn(
            f"generate stopped inside a drafted round, and the target's {type(kept).__name__} cannot be cropped back "
            f"to the stop ({', '.join(_evicted_layers(kept)) or 'it has no crop'}): it holds "
            f"{sequences.shape[1] - stop_at} position(s) past the returned sequence. {advice}",
            stacklevel=3,
        )
    if isinstance(output, torch.Tensor):
        return output[:, :stop_at]
    output.sequences = output.sequences[:, :stop_at]
    for name in ("scores", "logits", "hidden_states", "attentions"):  # one entry per new token, each
        steps = getattr(output, name, None)
        if steps is not None:
            setattr(output, name, tuple(steps[: stop_at - prompt_length]))
    return output
