"""A ``generate`` call's committed tokens as one :class:`RoundInfo` per round, read by a streamer in the generating
thread (with a drafter, from that thread's live :class:`~hf_retrace.GenerationStats`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers.generation.streamers import BaseStreamer


@dataclass(frozen=True)
class RoundInfo:
    """One committed chunk: ``tokens`` = ``accepted`` accepted drafts, then the one token the target supplied.

    ``drafted == 0`` marks a round without drafts (plain decoding, the prefill, or no room left to draft).
    ``fused``: ReTrace drafted this block with the previous round's rejected suffix fused in.
    """

    tokens: tuple[int, ...]
    accepted: int = 0
    drafted: int = 0
    fused: bool = False
    seconds: float = 0.0  # since the generate call started

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted


class RoundStreamer(BaseStreamer):
    """A streamer for one ``generate`` call that hands complete :class:`RoundInfo` objects to ``sink``.

    Runs in the generating thread. With a drafter, the round info comes from that thread's live
    ``GenerationStats.round_log``: hf_retrace hands a round's tokens to the streamer once the round is verified,
    recorded and checked for stops (:mod:`hf_retrace.generation.stopping`), so each ``put`` is posted at once with the
    newest recorded round, or as a round without drafts (the prefill). Without a drafter every ``put`` is one plain
    token.

    Example: ``target.generate(ids, assistant_model=drafter, streamer=RoundStreamer(rounds.append, drafter))``
    """

    def __init__(self, sink: Callable[[RoundInfo], None], drafter: Any = None, started: float | None = None):
        self._sink = sink
        self._drafter = drafter
        self._started = time.perf_counter() if started is None else started
        self._prompt_seen = False
        self._pending: tuple[tuple[int, ...], float] | None = None
        self._rounds_read = 0

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate first echoes the prompt
            self._prompt_seen = True
            return
        tokens = tuple(int(t) for t in value.reshape(-1).tolist())
        now = time.perf_counter() - self._started
        if self._drafter is None:
            for t in tokens:
                self._sink(RoundInfo((t,), seconds=now))
            return
        self._pending = (tokens, now)
        self._post_pending()

    def end(self) -> None:
        self._post_pending()

    def _post_pending(self) -> None:
        if self._pending is None:
            return
        tokens, seconds = self._pending
        self._pending = None
        stats = self._drafter.last_stats  # this thread's stats: the live object of the running generate call
        log = stats.round_log if stats is not None else []
        if len(log) > self._rounds_read:
            accepted, drafted, fused = log[self._rounds_read]
            self._rounds_read += 1
            accepted = min(int(accepted), len(tokens) - 1)
        else:  # the prefill (or a round with no room to draft): the target's token alone
            accepted, drafted, fused = 0, 0, False
        self._sink(RoundInfo(tokens, accepted, int(drafted), bool(fused), seconds))
