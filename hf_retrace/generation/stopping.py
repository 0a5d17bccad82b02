"""Stop exactly where plain decoding stops, although a round commits several tokens at once.

transformers' assisted loop checks the stopping criteria once per round, on the sequence after the round: a stop
string or a custom criterion met by a token in the middle of an accepted block is missed (or seen late), and the call
returns tokens plain ``generate`` never produces. :class:`PerTokenStopping` checks the criteria at every token a round
committed, as plain decoding would, ends the loop at the first token where one is met, and :func:`trim_output` cuts
the returned sequence (and per-token scores/logits) there. A streamer sees exactly the tokens plain decoding streams:
:class:`StopAwareStreamer` holds a round's tokens until the round's stop check has run.

Time limits (``max_time``) are left to the loop's own check at the end of a round: whether plain decoding would have
run out of time at an earlier token is not knowable, and the output is cut by time either way. With
``return_dict_in_generate``, ``sequences``, ``scores`` and ``logits`` are cut; per-round hidden states and attentions
are returned as the loop produced them.
"""

from __future__ import annotations

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
            for end in range(start + 1, length + 1):  # every token the round committed, each criterion once
                if self._met(self._per_token, input_ids[:, :end], scores, kwargs):
                    self.stop_at = end
                    break
        self.checked = length
        if self.streamer is not None:
            self.streamer.release(None if self.stop_at is None else self.stop_at - start)
        done = self.stop_at is not None or self._met(self._timed, input_ids, scores, kwargs)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    def trim(self, output: Any) -> Any:
        """``output`` cut where plain decoding stops; the call's stats count the tokens returned, not those the last
        round committed past the stop."""
        if self.stop_at is None:
            return output
        for generator in self.generators:
            generator.stats.new_tokens = min(generator.stats.new_tokens, self.stop_at - self.prompt_length)
        return trim_output(output, self.stop_at, self.prompt_length)


def trim_output(output: Any, stop_at: int | None, prompt_length: int) -> Any:
    """``output`` of the assisted loop cut to the first ``stop_at`` positions (sequence, scores and logits)."""
    if stop_at is None:
        return output
    if isinstance(output, torch.Tensor):
        return output[:, :stop_at] if output.shape[1] > stop_at else output
    if getattr(output, "sequences", None) is not None and output.sequences.shape[1] > stop_at:
        output.sequences = output.sequences[:, :stop_at]
        for name in ("scores", "logits"):
            steps = getattr(output, name, None)
            if steps is not None:
                setattr(output, name, tuple(steps[: stop_at - prompt_length]))
    return output
