"""The records of a benchmark report: one :class:`BenchRow` per dataset x method x temperature, with its requests
and its T=0 divergences. ``to_dict`` writes the report's JSON row; ``from_dict`` reads one back, from this version's
reports and from older ones. Pure data: no model, no tensors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from ..divergence import Divergence  # the one classifier's record, shared with `hf-retrace generate`

__all__ = ["BenchRow", "Divergence", "RequestDivergence", "RequestSummary", "report_rows"]


@dataclass
class RequestDivergence:
    """The divergence of one request (prompt, turn, seed); its JSON is flat: the ids, then the divergence's fields."""

    prompt_id: str
    turn: int
    seed: int
    divergence: Divergence

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_id": self.prompt_id, "turn": self.turn, "seed": self.seed,
                **dataclasses.asdict(self.divergence)}

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any]) -> RequestDivergence:
        divergence = Divergence(**{f.name: entry[f.name] for f in dataclasses.fields(Divergence)})
        return cls(entry["prompt_id"], entry["turn"], entry["seed"], divergence)


@dataclass
class RequestSummary:
    """One request of a row: its size, its timings and its tau (None when it drafted nothing)."""

    prompt_id: str
    turn: int
    seed: int
    input_tokens: int
    new_tokens: int
    generate_seconds: float
    prefill_seconds: float
    tau: float | None


@dataclass(kw_only=True)
class BenchRow:
    """The metrics of one dataset x method x temperature (definitions: the docstring of :mod:`.runner`).

    The field order is the JSON row's key order. ``None`` means "does not apply" (plain has no rounds; nothing is
    compared at T > 0; only hf_retrace's generator keeps suffixes).

    Example::

        rows = [BenchRow.from_dict(r) for r in json.load(open("report.json"))["rows"]]
        best = max(rows, key=lambda row: row.speedup or 0.0)
    """

    dataset: str
    method: str
    temperature: float
    prompts: int
    requests: int
    new_tokens: int
    decode_tokens: int
    generate_seconds: float
    prefill_seconds: float
    decode_seconds: float
    decode_seconds_per_token: float | None
    tokens_per_second: float | None
    speedup: float | None  # plain decode s/token / this method's
    tau: float | None  # = tau_per_request
    tau_per_request: float | None
    tau_per_round: float | None
    rounds: int | None
    per_position_acceptance: list[float]
    acceptance_length_histogram: dict[str, int]  # acceptance length (as a JSON key) -> rounds
    draft_cost_c: float | None
    verify_cost_epsilon: float | None
    ideal_speedup: float | None
    speedup_over_ideal: float | None
    draft_seconds: float | None
    verify_seconds: float | None
    kept_suffix_rate: float | None
    kept_token_commit_rate: float | None
    mean_draft_length: float | None = None  # reports written before the adaptive block lack it
    lookup_round_share: float | None = None  # reports written before the hybrid lack it
    mismatches: int | None
    mismatch_bugs: int | None
    mismatch_near_ties: int | None
    compared_requests: int
    uncompared_requests: int
    divergences: list[RequestDivergence]
    per_request: list[RequestSummary]
    policy: str | None = None  # the round policy the method ran (RoundPolicy.describe()); older reports lack it
    guard_plain_steps: int | None = None  # positions the guard decoded plainly (recent rounds below plain)

    def to_dict(self) -> dict[str, Any]:
        """The report's JSON row: plain lists, dicts, numbers and strings."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        row["per_position_acceptance"] = list(self.per_position_acceptance)
        row["acceptance_length_histogram"] = dict(self.acceptance_length_histogram)
        row["divergences"] = [d.to_dict() for d in self.divergences]
        row["per_request"] = [dataclasses.asdict(r) for r in self.per_request]
        return row

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> BenchRow:
        """A JSON row back as a record; a key older reports lack reads as its default (None)."""
        fields = dataclasses.fields(cls)
        missing = [f.name for f in fields if f.name not in row and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"not a row of an `hf-retrace bench` report: it lacks {', '.join(missing)}; pass the "
                             "JSON that `hf-retrace bench --json` wrote")
        values = {f.name: row[f.name] for f in fields if f.name in row}
        values["divergences"] = [RequestDivergence.from_dict(d) for d in row["divergences"]]
        values["per_request"] = [RequestSummary(**r) for r in row["per_request"]]
        return cls(**values)


def report_rows(report: Mapping[str, Any]) -> list[BenchRow]:
    """The rows of a report dict (as ``run_benchmark`` returns it or as read from its JSON), as records."""
    return [BenchRow.from_dict(row) for row in report["rows"]]
