"""What the page shows, as data: each side's rounds and text so far (:class:`SideState`), both sides together with a
one-line status (:class:`Snapshot`)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from ..stats import GenerationStats, speedup_over_plain, tokens_per_second_of
from .rounds import RoundInfo


class IncrementalDetokenizer:
    """Text of each new token, decoded with a few tokens of left context (multi-byte characters are held back)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            piece = new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return piece
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""


@dataclass
class SideState:
    """One side of the comparison as the page shows it; owned by one request, filled from its worker's rounds.

    Example: ``side = SideState("retrace", "ReTrace", tokenizer); side.add_round(RoundInfo((5, 6), 1, 4)); side.tau``
    """

    method: str
    title: str
    tokenizer: Any = field(repr=False, default=None)
    rounds: list[RoundInfo] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    pieces: list[list[str]] = field(default_factory=list)  # per round, the text of each of its tokens
    seconds: float = 0.0
    done: bool = False
    stats: dict | None = None
    _detok: IncrementalDetokenizer | None = field(default=None, repr=False)

    def add_round(self, info: RoundInfo) -> None:
        if self._detok is None:
            self._detok = IncrementalDetokenizer(self.tokenizer)
        self.rounds.append(info)
        self.token_ids.extend(info.tokens)
        self.pieces.append([self._detok.add(t) for t in info.tokens])
        self.seconds = max(self.seconds, info.seconds)

    def finish(self, seconds: float, stats: dict | None) -> None:
        if self._detok is not None and self.pieces:
            self.pieces[-1][-1] += self._detok.flush()
        self.seconds, self.stats, self.done = seconds, stats, True

    # --- what the page shows ---
    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True) if self.tokenizer else ""

    @property
    def drafted_rounds(self) -> list[RoundInfo]:
        return [r for r in self.rounds if r.drafted > 0]

    @property
    def tau(self) -> float:
        """Tokens committed per target forward over the drafting rounds (the drafter's tau); 1 for plain decoding."""
        rounds = self.drafted_rounds
        if not rounds:
            return 1.0 if self.rounds else 0.0
        stats = GenerationStats()  # tau is defined once, there
        for r in rounds:
            stats.record_round(r.drafted, r.accepted, r.fused)
        return stats.mean_acceptance_length

    @property
    def tokens_per_second(self) -> float:
        return tokens_per_second_of(len(self.token_ids), self.seconds)

    def summary(self) -> dict:
        out = {
            "method": self.method,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "new_tokens": len(self.token_ids),
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
        }
        if self.method != "plain":
            out["tau"] = round(self.tau, 4)
            out["rounds"] = [[r.accepted, r.drafted, r.fused] for r in self.drafted_rounds]
            out["fused_rounds"] = sum(r.fused for r in self.rounds)
            out["target_only_tokens"] = sum(len(r.tokens) for r in self.rounds if r.drafted == 0)
            out["stats"] = self.stats
        return out


@dataclass
class Snapshot:
    """What one update of the page shows: both sides so far, and a one-line status."""

    plain: SideState
    drafted: SideState | None
    status: str
    done: bool = False
    temperature: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool | None:
        if self.drafted is None or not (self.plain.done and self.drafted.done):
            return None
        return self.plain.token_ids == self.drafted.token_ids

    @property
    def speedup(self) -> float | None:
        if self.drafted is None or not self.plain.done:
            return None
        return speedup_over_plain(self.drafted.tokens_per_second, self.plain.tokens_per_second)

    def summary(self) -> dict:
        return {
            "temperature": self.temperature,
            "plain": self.plain.summary(),
            "drafted": self.drafted.summary() if self.drafted is not None else None,
            "identical": self.identical,
            "speedup": round(self.speedup, 4) if self.speedup is not None else None,
            "notes": list(self.notes),
        }


def final_status(snap: Snapshot) -> str:
    """The status line of a finished request, with its notes below it."""
    notes = "".join(f"  \n<small>{html.escape(note)}</small>" for note in snap.notes)
    return _final_line(snap) + notes


def _final_line(snap: Snapshot) -> str:
    if snap.drafted is None:
        return f"Done: {len(snap.plain.token_ids)} tokens at {snap.plain.tokens_per_second:.1f} tokens/s."
    same = snap.identical
    if snap.temperature > 0:
        agree = "sampled: the two texts are independent draws"
    else:
        agree = "identical to plain decoding ✓" if same else "differs from plain decoding ✗"
    speed = f"{snap.speedup:.2f}×" if snap.speedup is not None else "n/a"
    return f"Done: {snap.drafted.title} τ = {snap.drafted.tau:.2f}, speed-up {speed}; {agree}."
