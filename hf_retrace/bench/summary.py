"""Aggregation: the requests of one dataset x method x temperature summed into one :class:`BenchRow`.

tau is never recomputed here: it is ``GenerationStats.mean_acceptance_length``, averaged over requests
(``GenerationStats.mean_tau_per_request``) and pooled over rounds (``GenerationStats.pooled``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..stats import GenerationStats, speedup_over_plain, tokens_per_second_of
from .loop import TurnResult
from .methods import Method, drafts_nothing
from .records import BenchRow, RequestDivergence, RequestSummary

__all__ = ["lossless_summary", "summarize"]


def summarize(dataset: str, turns: list[TurnResult], method: Method, plain_seconds_per_token: float | None,
              temperature: float) -> BenchRow:
    """The metrics of one dataset x method x temperature (see the docstring of :mod:`.runner` for each definition)."""
    decode_tokens = sum(max(len(t.run.token_ids) - 1, 0) for t in turns)
    decode_seconds = sum(max(t.run.seconds - t.prefill_seconds, 0.0) for t in turns)
    seconds_per_token = decode_seconds / decode_tokens if decode_tokens else None
    rate = tokens_per_second_of(decode_tokens, decode_seconds)
    speedup = speedup_over_plain(rate, 1.0 / plain_seconds_per_token if plain_seconds_per_token else 0.0)
    all_stats = [t.stats for t in turns if t.stats is not None]
    pooled = GenerationStats.pooled(all_stats)
    acceptance = _acceptance(all_stats, pooled, method)
    keeps_suffixes = method.kind == "drafter" and pooled.rounds > 0  # only hf_retrace's generator records them
    return BenchRow(
        dataset=dataset,
        method=method.name,
        temperature=temperature,
        prompts=len({t.prompt_id for t in turns}),
        requests=len(turns),
        new_tokens=sum(len(t.run.token_ids) for t in turns),
        decode_tokens=decode_tokens,
        generate_seconds=sum(t.run.seconds for t in turns),
        prefill_seconds=sum(t.prefill_seconds for t in turns),
        decode_seconds=decode_seconds,
        decode_seconds_per_token=seconds_per_token,
        tokens_per_second=rate if decode_seconds > 0 else None,
        speedup=speedup,
        **acceptance,
        **_costs(pooled, method, plain_seconds_per_token, acceptance["tau_per_round"], speedup),
        kept_suffix_rate=pooled.kept_suffix_rate if keeps_suffixes else None,
        # scored only where the method asks for it (RoundPolicy.kept_suffix_stats: ReTrace and full-block methods)
        kept_token_commit_rate=pooled.kept_token_commit_rate if keeps_suffixes and pooled.kept_tokens else None,
        # the round's shape: mean drafted length (the adaptive block), and which source drafted (the hybrid)
        mean_draft_length=(sum(pooled.draft_lengths) / len(pooled.draft_lengths)) if pooled.draft_lengths else None,
        lookup_round_share=pooled.lookup_rounds / pooled.rounds if keeps_suffixes else None,
        policy=pooled.policy or None if method.kind == "drafter" else None,
        guard_plain_steps=pooled.guard_plain_steps if method.kind == "drafter" else None,
        **_losslessness(turns, temperature),
        per_request=[_request_summary(t) for t in turns],
    )


def _request_summary(turn: TurnResult) -> RequestSummary:
    stats = turn.stats
    tau = stats.mean_acceptance_length if stats is not None and stats.rounds else None
    return RequestSummary(turn.prompt_id, turn.turn, turn.seed, turn.input_length, len(turn.run.token_ids),
                          turn.run.seconds, turn.prefill_seconds, tau)


def _acceptance(all_stats: list[GenerationStats], pooled: GenerationStats, method: Method) -> dict[str, Any]:
    """tau per request and per round, rounds, per-position acceptance and the histogram of acceptance lengths."""
    if method.decodes_plainly:  # GenerationStats: "plain decoding has tau = 1"
        return {"tau": 1.0, "tau_per_request": 1.0, "tau_per_round": 1.0, "rounds": None,
                "per_position_acceptance": [], "acceptance_length_histogram": {}}
    tau_per_request = GenerationStats.mean_tau_per_request(all_stats)
    return {
        "tau": tau_per_request,
        "tau_per_request": tau_per_request,
        "tau_per_round": pooled.mean_acceptance_length if pooled.rounds else None,
        "rounds": pooled.rounds,
        "per_position_acceptance": pooled.per_position_acceptance,
        "acceptance_length_histogram": {str(k): v for k, v in sorted(Counter(pooled.acceptance_lengths).items())},
    }


def _costs(pooled: GenerationStats, method: Method, plain_spt: float | None, tau_per_round: float | None,
           speedup: float | None) -> dict[str, Any]:
    """c, epsilon and the ideal speed-up tau / (1 + c + epsilon), all per drafting round, against plain's token."""
    if method.decodes_plainly or not pooled.rounds or not plain_spt:
        return {"draft_cost_c": None, "verify_cost_epsilon": None, "ideal_speedup": None,
                "speedup_over_ideal": None, "draft_seconds": None, "verify_seconds": None}
    c = pooled.draft_seconds / pooled.rounds / plain_spt
    epsilon = pooled.verify_seconds / pooled.rounds / plain_spt - 1.0
    ideal = tau_per_round / (1.0 + c + epsilon)
    return {"draft_cost_c": c, "verify_cost_epsilon": epsilon, "ideal_speedup": ideal,
            "speedup_over_ideal": speedup / ideal if speedup and ideal > 0 else None,
            "draft_seconds": pooled.draft_seconds, "verify_seconds": pooled.verify_seconds}


def _losslessness(turns: list[TurnResult], temperature: float) -> dict[str, Any]:
    """T=0 comparisons with plain: counts by verdict, and every divergence (nothing compared at T > 0)."""
    if temperature > 0 or all(t.comparison is None for t in turns):
        return {"mismatches": None if temperature > 0 else 0, "mismatch_bugs": None if temperature > 0 else 0,
                "mismatch_near_ties": None if temperature > 0 else 0, "compared_requests": 0,
                "uncompared_requests": 0, "divergences": []}
    compared = [t for t in turns if t.comparison is not None and t.comparison.compared]
    diverged = [t for t in compared if t.comparison.divergence is not None]
    return {
        "mismatches": len(diverged),
        "mismatch_bugs": sum(t.comparison.divergence.verdict == "bug" for t in diverged),
        "mismatch_near_ties": sum(t.comparison.divergence.verdict == "near-tie" for t in diverged),
        "compared_requests": len(compared),
        "uncompared_requests": sum(1 for t in turns if t.comparison is not None and not t.comparison.compared),
        "divergences": [RequestDivergence(t.prompt_id, t.turn, t.seed, t.comparison.divergence) for t in diverged],
    }


def lossless_summary(rows: list[BenchRow]) -> dict[str, int]:
    """The report's losslessness totals over every row.

    ``mismatch_bugs`` counts the T=0 partings beyond a near-tie of the methods that draft; those of plain decoding on
    other kernels (``plain-no-onednn``, drafting nothing) are ``kernel_partings``: how far this machine's kernels alone
    move a bf16 greedy output, never a losslessness bug. A drafting method's parting of that size is numerics only once
    float32 says so (``examples/check_flagged.py`` in the repository)."""
    return {
        "compared_requests": sum(r.compared_requests for r in rows),
        "mismatches": sum(r.mismatches or 0 for r in rows),
        "mismatch_bugs": sum(r.mismatch_bugs or 0 for r in rows if not drafts_nothing(r.method)),
        "kernel_partings": sum(r.mismatch_bugs or 0 for r in rows if drafts_nothing(r.method)),
        "mismatch_near_ties": sum(r.mismatch_near_ties or 0 for r in rows),
    }
