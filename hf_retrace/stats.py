"""Per-call generation statistics; the acceptance length tau, tokens per second and the speed-up over plain decoding
are defined here, once."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    """What one ``generate`` call with a drafter did, round by round.

    A *drafting round* is one drafter proposal followed by one target verification. ``acceptance_lengths[r]`` is
    the number of tokens round ``r`` committed: the drafts the target accepted plus the one token the target supplies
    itself (its correction at the first rejection, or the bonus after a fully accepted block).
    """

    rounds: int = 0
    new_tokens: int = 0  # every token this call committed, drafted rounds or not
    acceptance_lengths: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    accepted_at_position: list[int] = field(default_factory=list)
    drafted_at_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # ReTrace's motivating observation: rejected suffixes kept, and how often a kept token is later committed
    rounds_with_kept_suffix: int = 0
    kept_tokens: int = 0
    kept_tokens_committed: int = 0
    # per drafter round, the drafter's top probability at each drafted slot (recorded when the adaptive block is on)
    slot_confidences: list[list[float]] = field(default_factory=list)
    fused_suffix: list[bool] = field(default_factory=list)  # per round: whether ReTrace fused a rejected suffix
    round_sources: list[str] = field(default_factory=list)  # per round: "drafter" or "lookup" (hybrid mode)
    policy: str = ""  # the round policy this call ran (RoundPolicy.describe())
    guard_plain_steps: int = 0  # positions decoded plainly because recent rounds fell below plain (RoundGuard)
    guard_clocked_rounds: int = 0  # rounds the guard priced by their wall time against the call's plain steps

    @property
    def rounds_with_fused_suffix(self) -> int:
        """Rounds whose block ReTrace drafted with a kept rejected suffix fused in."""
        return sum(self.fused_suffix)

    @property
    def round_log(self) -> list[tuple[int, int, bool]]:
        """Per round ``(accepted drafts, drafted, fused)``, for the demo's colouring."""
        return [(a - 1, d, f) for a, d, f in zip(self.acceptance_lengths, self.draft_lengths, self.fused_suffix)]

    @property
    def round_tokens(self) -> int:
        """Tokens this call committed in its drafting rounds plus the guard's plain positions: every token after the
        prefill's, where the call drafted (what a round policy's tokens per step-cost counts)."""
        return sum(self.acceptance_lengths) + self.guard_plain_steps

    @property
    def lookup_rounds(self) -> int:
        """Rounds whose block came from context lookup instead of the drafter (0 unless the hybrid is on)."""
        return self.round_sources.count("lookup")

    @property
    def mean_acceptance_length(self) -> float:
        """tau: the mean over drafting rounds of (accepted drafts + 1), i.e. tokens committed per target forward.

        Plain decoding has tau = 1; a drafter whose every block is fully accepted has tau = block_size.
        """
        if not self.acceptance_lengths:
            return 0.0
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)

    @classmethod
    def pooled(cls, all_stats: Iterable["GenerationStats"]) -> "GenerationStats":
        """One GenerationStats holding every round of ``all_stats`` (per-position counters summed slot by slot): its
        ``mean_acceptance_length`` is tau pooled over all rounds (vLLM's convention)."""
        all_stats = list(all_stats)
        pooled = cls()
        for f in dataclasses.fields(cls):
            values = [getattr(s, f.name) for s in all_stats]
            if f.name.endswith("_at_position"):
                width = max((len(v) for v in values), default=0)
                setattr(pooled, f.name, [sum(v[i] for v in values if i < len(v)) for i in range(width)])
            elif isinstance(getattr(pooled, f.name), str):
                setattr(pooled, f.name, " | ".join(dict.fromkeys(v for v in values if v)))
            elif isinstance(getattr(pooled, f.name), list):
                setattr(pooled, f.name, [x for v in values for x in v])
            else:
                setattr(pooled, f.name, sum(values))
        return pooled

    @staticmethod
    def mean_tau_per_request(all_stats: Iterable["GenerationStats"]) -> float | None:
        """tau averaged over requests that drafted at least once (z-lab's convention); None when none did."""
        taus = [s.mean_acceptance_length for s in all_stats if s is not None and s.rounds]
        return sum(taus) / len(taus) if taus else None

    @property
    def per_position_acceptance(self) -> list[float]:
        """Rate at which draft slot ``i`` (1-based) was accepted, among rounds that drafted that slot."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at_position, self.drafted_at_position)]

    @property
    def kept_suffix_rate(self) -> float:
        """Fraction of drafting rounds that left a rejected suffix to keep (slots beyond the first rejection)."""
        return self.rounds_with_kept_suffix / self.rounds if self.rounds else 0.0

    @property
    def kept_token_commit_rate(self) -> float:
        """How often a kept rejected token equals the token the target finally committed at its position."""
        return self.kept_tokens_committed / self.kept_tokens if self.kept_tokens else 0.0

    def record_round(self, drafted: int, accepted: int, fused: bool, source: str = "drafter") -> None:
        self.rounds += 1
        self.acceptance_lengths.append(accepted + 1)
        self.draft_lengths.append(drafted)
        self.fused_suffix.append(bool(fused))
        self.round_sources.append(source)
        grow = drafted - len(self.drafted_at_position)
        if grow > 0:
            self.drafted_at_position += [0] * grow
            self.accepted_at_position += [0] * grow
        for slot in range(drafted):
            self.drafted_at_position[slot] += 1
            self.accepted_at_position[slot] += int(slot < accepted)

    def cut_at(self, new_tokens: int) -> None:
        """Count only the call's first ``new_tokens`` tokens: those past them were committed by the last round and cut
        at a stop string or criterion met inside it, so they leave ``new_tokens`` and that round's acceptance length
        (tau counts tokens returned). The per-position counters keep them: the target did accept those drafts."""
        cut = self.new_tokens - new_tokens
        if cut <= 0:
            return
        self.new_tokens = new_tokens
        if self.acceptance_lengths:  # a cut needs a round that committed 2+ tokens: a drafting round, the last one
            self.acceptance_lengths[-1] = max(1, self.acceptance_lengths[-1] - cut)

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "new_tokens": self.new_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_lengths": list(self.acceptance_lengths),
            "per_position_acceptance": self.per_position_acceptance,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "kept_suffix_rate": self.kept_suffix_rate,
            "kept_token_commit_rate": self.kept_token_commit_rate,
            "rounds_with_fused_suffix": self.rounds_with_fused_suffix,
            "lookup_rounds": self.lookup_rounds,
            "policy": self.policy,
            "guard_plain_steps": self.guard_plain_steps,
            "guard_clocked_rounds": self.guard_clocked_rounds,
        }


def tokens_per_second_of(tokens: int, seconds: float) -> float:
    """New tokens per wall-clock second (0 when no time was measured)."""
    return tokens / seconds if seconds > 0 else 0.0


def speedup_over_plain(tokens_per_second: float, plain_tokens_per_second: float) -> float | None:
    """The speed-up: tokens per second over plain decoding's on the same prompts (None where either rate is 0)."""
    if tokens_per_second <= 0 or plain_tokens_per_second <= 0:
        return None
    return tokens_per_second / plain_tokens_per_second


class StatsSlot:
    """Holds the latest stats of one drafter per thread, so concurrent calls never mix."""

    def __init__(self) -> None:
        self._local = threading.local()

    def set(self, stats: GenerationStats) -> None:
        self._local.stats = stats

    def get(self) -> GenerationStats | None:
        return getattr(self._local, "stats", None)


_slots: "weakref.WeakKeyDictionary[object, StatsSlot]" = weakref.WeakKeyDictionary()
_slots_lock = threading.Lock()


def last_stats_slot(drafter: object) -> StatsSlot:
    """The per-thread slot holding ``drafter``'s latest stats (kept beside the drafter, not on it)."""
    with _slots_lock:
        slot = _slots.get(drafter)
        if slot is None:
            slot = _slots[drafter] = StatsSlot()
        return slot
