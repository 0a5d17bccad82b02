"""``hf-retrace tune --verify``: a short real A/B of plain decoding, the tuned choice and the runner-up on the
drafter's recorded prompts, each policy's predicted tokens per step-cost beside the speed-up it realizes.

Decode time excludes the prefill (a plain one-token ``generate`` per prompt, timed once, is subtracted), so the
realized figure compares with the replay's, which prices decoding rounds only. The plain arm decodes plainly as the
tuned policy would (:func:`plain_view`): with the kernels it was priced with, so drafting is weighed against the
fastest plain decoding measured, not against torch's default kernels.

A batch's choice is checked the same way before the tuner keeps it (:func:`check_batch_choice`, each A/B a
:func:`batch_check`): the replay's batch figure missed
by 22-30 %, in the verify forwards (docs/design/batching.md; on a Xeon with AMX, bf16, it predicted 1.87 / 1.56 /
1.28 tokens per step-cost at 2 / 4 / 8 rows, and the benchmark realized 1.07-1.72x / 0.99-1.41x / 0.77-1.00x).

Example::

    result = tune(target, drafter)
    rows = verify_tuning(target, drafter, result, records_of(drafter))
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch

from ..generation.batched import left_padded, pad_token_id_of
from ..generation.placement import synchronize
from ..generation.policy import RoundPolicy, shipped_policy
from .costs import MachineCosts
from .records import AnswerRecord, RoundRecords
from .search import PLAIN_MARGIN, lookup_changes, pays, runner_up

__all__ = ["BATCH_CHECK_PROMPTS", "BATCH_CHECK_TOKENS", "BatchAB", "PriceCheck", "batch_check", "check_batch_choice",
           "clocked_cost", "measure_price", "modelled_cost", "plain_view", "verify_arms", "verify_tuning"]

BATCH_CHECK_TOKENS = 48  # new tokens per row in each arm of a batch's A/B
BATCH_CHECK_PROMPTS = 16  # recorded prompts per A/B, in batches of the call's rows (at least two batches)


def plain_view(drafter: Any, policy: RoundPolicy) -> Any:
    """The drafter view that decodes plainly under ``policy``'s kernels (its target forwards narrower than
    ``onednn_from`` without torch's oneDNN): plain decoding as the tuner priced it, one token per one-token step."""
    return drafter.with_policy(policy.replace(speculate=False, source="tuned", reason=""))


def verify_arms(result: dict[str, Any], name: str, base: RoundPolicy) -> list[tuple[str, RoundPolicy | None]]:
    """``[(label, policy)]`` for one temperature: plain (None), the choice, and the best other replayed row; where
    the choice is plain, the best replayed row and the next one."""
    chosen = RoundPolicy.from_dict(result["policies"][name])
    costs = MachineCosts.from_dict(result["costs"])
    table = result.get("tables", {}).get(name) or []

    def armed(row: dict[str, Any], label: str) -> tuple[str, RoundPolicy]:
        policy = costs.arm(base, confidence_cut=row["confidence_cut"], **lookup_changes(row["lookup"]))
        return label, policy.replace(source=f"tuned {label}", expected_speedup=round(row["tokens_per_cost"], 3))

    arms: list[tuple[str, RoundPolicy | None]] = [("plain", None)]
    if chosen.speculate:
        arms.append(("choice", chosen))
        lookup = (chosen.lookup_start, chosen.lookup_cap) if chosen.lookup else None
        second = runner_up(table, {"confidence_cut": chosen.confidence_cut, "lookup": lookup})
        if second is not None:
            arms.append(armed(second, "runner-up"))
    elif table:
        best = max(table, key=lambda row: row["tokens_per_cost"])
        arms.append(armed(best, "best drafting"))
        second = runner_up(table, best)
        if second is not None:
            arms.append(armed(second, "runner-up"))
    return arms


def _decode(target: Any, assistant: Any, ids: torch.Tensor, max_new_tokens: int, sampling: dict[str, Any]
            ) -> tuple[float, int]:
    """(seconds, new tokens) of one ``generate`` call, seeded so sampled arms draw alike."""
    torch.manual_seed(0)
    kwargs = {"assistant_model": assistant} if assistant is not None else {}
    synchronize(ids.device)
    started = time.perf_counter()
    out = target.generate(ids, max_new_tokens=max_new_tokens, **sampling, **kwargs)
    synchronize(ids.device)
    return time.perf_counter() - started, out.shape[1] - ids.shape[1]


@torch.inference_mode()
def verify_tuning(target: Any, drafter: Any, result: dict[str, Any], records: RoundRecords, prompts: int = 4,
                  max_new_tokens: int = 64) -> list[dict[str, Any]]:
    """One row per temperature and arm (:func:`verify_arms`): ``predicted`` (the replay's tokens per step-cost times
    the measured price of real rounds where the tuning measured one; plain = 1), ``realized`` (decode tokens per
    second over plain's on the same prompts) and ``tau``."""
    base = shipped_policy(drafter.config)
    device = target.get_input_embeddings().weight.device
    rows = []
    sampled = {"do_sample": True, "temperature": records.temperature}
    for name, answers, sampling in (("greedy", records.greedy, {"do_sample": False}),
                                    ("sampled", records.sampled, sampled)):
        inputs = [torch.tensor([a.tokens[: a.start]], device=device) for a in answers[:prompts]]
        if not inputs:
            continue
        arms = verify_arms(result, name, base)
        chosen = RoundPolicy.from_dict(result["policies"][name])
        views = {label: drafter.with_policy(policy) if policy is not None else plain_view(drafter, chosen)
                 for label, policy in arms}
        for view in views.values():  # warm-up: first calls pay one-time costs
            _decode(target, view, inputs[0], 4, sampling)
        prefill = [_decode(target, None, ids, 1, sampling)[0] for ids in inputs]
        speeds, taus = {}, {}
        for label, view in views.items():
            seconds = tokens = 0.0
            accepted: list[int] = []
            for ids, prefill_seconds in zip(inputs, prefill):
                took, new = _decode(target, view, ids, max_new_tokens, sampling)
                seconds += max(took - prefill_seconds, 1e-9)
                tokens += new - 1  # the prefill's token is not a decoded one
                if label != "plain" and view.last_stats is not None:
                    accepted += view.last_stats.acceptance_lengths
            speeds[label] = tokens / seconds
            taus[label] = sum(accepted) / len(accepted) if accepted else 1.0
        for label, policy in arms:
            rows.append({"temperature": "T=0" if name == "greedy" else "T>0", "arm": label,
                         "policy": (views[label].round_policy if policy is None else policy).describe(),
                         "predicted": 1.0 if policy is None or not policy.speculate else policy.predicted_speedup,
                         "realized": speeds[label] / speeds["plain"], "tau": taus[label]})
    return rows


PRICE_TOKENS = 20  # new tokens per arm and prompt in the price's real calls
PRICE_PROMPTS = 4  # recorded prompts, spread over the records' kinds
PRICE_PASSES = 2  # passes over them (the second in the reverse order): two measurements that must agree
PRICE_EXTRA_PASSES = 1  # where they do not, passes more (a passing load): the two that agree best decide
PRICE_SPREAD = 0.15  # the passes disagree when they are further apart than this share of the whole's price
PRICE_PLAUSIBLE = (0.5, 1.5)  # a price outside this range is a timing fault, not the loop's work: no price
PRICE_SECONDS = 12.0  # the price is not measured where its calls would take longer (a slow target: the replay's
# figure stands alone, as before the price was measured)


class PriceCheck(NamedTuple):
    """:func:`measure_price`'s answer: ``price`` (None where not measured or unsettled), ``passes`` (the price each
    pass read), ``why`` there is no price ("" where there is), and ``clocked``: the same calls' speed-up over their
    figure as the generator clocks their rounds (:func:`clocked_cost`; None with no price, or where implausible)."""

    price: float | None
    passes: tuple[float, ...] = ()
    why: str = ""
    clocked: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"price": None if self.price is None else round(self.price, 3),
                "passes": [round(f, 3) for f in self.passes], "why": self.why,
                "clocked": None if self.clocked is None else round(self.clocked, 3)}


def modelled_cost(stats: Any, policy: RoundPolicy) -> float:
    """The step-costs of one call's rounds as the replay prices them: each round at ``policy``'s
    :meth:`~hf_retrace.generation.policy.RoundPolicy.round_cost` for what it drafted and from where, each of the
    guard's plain positions at one step."""
    return sum(policy.round_cost(drafted, source == "lookup")
               for drafted, source in zip(stats.draft_lengths, stats.round_sources)) + stats.guard_plain_steps


def clocked_cost(stats: Any, step_seconds: float) -> float:
    """The step-costs of one call's rounds as the generator clocks them: the drafter's and the verify's wall time in
    one-token steps of ``step_seconds``, each of the guard's plain positions at one step (the unit of the realized
    figure a real call reports, :func:`hf_retrace.tuning.realized.realized_figure`)."""
    return (stats.draft_seconds + stats.verify_seconds) / step_seconds + stats.guard_plain_steps


@torch.inference_mode()
def measure_price(target: Any, drafter: Any, policy: RoundPolicy, answers: list[AnswerRecord], step_seconds: float,
                  max_new_tokens: int = PRICE_TOKENS, prompts: int = PRICE_PROMPTS) -> PriceCheck:
    """What ``policy``'s real rounds cost on this machine against the replay's model of them. On ``prompts`` recorded
    prompts (T=0, spread over the records' kinds), plain ``generate`` (with the kernels ``policy`` prices plain
    decoding with, :func:`plain_view`) and the drafted call, their order swapped from call to call, a timed one-token
    call per prompt (its prefill) taken off both. The replay prices the very rounds each drafted call ran
    (:func:`modelled_cost`, in steps); at plain's measured seconds per token that predicts the drafted call's decode
    seconds. ``price`` = predicted seconds / real seconds, pooled: the realized speed-up over plain / the replay's
    tokens per step-cost for the same rounds, where tau cancels (the same text) and what is left is the price of a
    round, the assisted loop's own work and plain ``generate``'s real step against the forwards the tuner timed alone
    (on a 2-core EPYC in bf16: 0.76-0.91, docs/round-policy.md). Two passes over the same prompts (the second in the
    reverse order: a load that lasts cancels in each call pair, a passing one shows as a disagreement) must agree
    within :data:`PRICE_SPREAD`; where they do not, a third pass is run and the two that agree best decide. The same
    calls give ``clocked``, their speed-up over the figure the generator's clocks give their rounds
    (:func:`clocked_cost`): the unit a real call's realized figure is counted in, which the calls that check a plain
    choice are priced with (:func:`hf_retrace.tuning.realized.note_realized`).
    ``step_seconds`` (the timed one-token step) sizes the calls: none are made where two passes would take over
    :data:`PRICE_SECONDS`."""
    estimate = step_seconds * max_new_tokens * prompts * PRICE_PASSES * 1.6  # plain's steps and the drafted call's
    if estimate > PRICE_SECONDS:
        return PriceCheck(None, why=f"its real calls would take about {estimate:.0f} s on this machine (a one-token "
                                    f"step of {step_seconds * 1000:.0f} ms); not measured")
    embeddings = target.get_input_embeddings().weight
    fitting = [a for a in answers if len(a.tokens) - a.start > max_new_tokens and max(a.tokens) < len(embeddings)]
    picks = list({id(a): a for a in (fitting[i * len(fitting) // prompts] for i in range(prompts))}.values()) \
        if fitting else []
    if not picks:
        return PriceCheck(None, why=f"no recorded answer longer than {max_new_tokens} tokens in this target's "
                                    "vocabulary; not measured")
    device = embeddings.device
    view, plain = drafter.with_policy(policy), plain_view(drafter, policy)
    greedy = {"do_sample": False}
    inputs = [torch.tensor([answer.tokens[: answer.start]], device=device) for answer in picks]
    _decode(target, view, inputs[0], 4, greedy)  # warm-up: first calls pay one-time costs
    _decode(target, plain, inputs[0], 4, greedy)
    prefills = [_decode(target, None, ids, 1, greedy)[0] for ids in inputs]
    passes: list[tuple[float, float, float]] = []  # per pass: predicted seconds, real seconds, clocked seconds
    for number in range(PRICE_PASSES + PRICE_EXTRA_PASSES):
        if number >= PRICE_PASSES and _agreeing(passes) is not None:
            break
        predicted = real = clocked = 0.0
        order = list(range(len(inputs)))[:: 1 if number % 2 == 0 else -1]
        for turn, index in enumerate(order):
            ids, prefill = inputs[index], prefills[index]
            seconds = {}
            for label, arm in (("plain", plain), ("drafted", view))[:: 1 if turn % 2 == 0 else -1]:
                seconds[label] = _decode(target, arm, ids, max_new_tokens, greedy)
            (plain_seconds, plain_new), (drafted_seconds, drafted_new) = seconds["plain"], seconds["drafted"]
            stats = view.last_stats
            if stats is None or min(plain_new, drafted_new) < 8 or min(plain_seconds, drafted_seconds) <= prefill:
                continue  # an answer that ended at once: nothing to time
            plain_step = (plain_seconds - prefill) / (plain_new - 1)  # plain generate's real seconds a token
            predicted += modelled_cost(stats, view.round_policy) * plain_step
            clocked += clocked_cost(stats, step_seconds) * plain_step
            real += drafted_seconds - prefill
        passes.append((predicted, real, clocked))
    if not all(real > 0 for _, real, _ in passes):
        return PriceCheck(None, why="the recorded prompts' answers ended too soon to time; not measured")
    read = tuple(predicted / real for predicted, real, _ in passes)
    pair = _agreeing(passes)
    if pair is None:
        said = ", ".join(f"{figure:.2f}" for figure in read)
        return PriceCheck(None, read, f"no two of its {len(passes)} passes agree ({said})")
    price, clocked = (sum(p[i] for p in pair) / sum(p[1] for p in pair) for i in (0, 2))
    if not PRICE_PLAUSIBLE[0] <= price <= PRICE_PLAUSIBLE[1]:
        return PriceCheck(None, read, f"an implausible price {price:.2f} (a timing fault)")
    return PriceCheck(price, read, clocked=clocked if PRICE_PLAUSIBLE[0] <= clocked <= PRICE_PLAUSIBLE[1] else None)


def _agreeing(passes: list[tuple[float, float, float]]) -> tuple[tuple[float, float, float], ...] | None:
    """The two passes ``(predicted, real, clocked seconds)`` whose prices are closest, where they agree within
    :data:`PRICE_SPREAD` of their pooled price; None where no two do."""
    pairs = [(a, b) for i, a in enumerate(passes) for b in passes[i + 1:] if a[1] > 0 and b[1] > 0]
    if not pairs:
        return None
    a, b = min(pairs, key=lambda pair: abs(pair[0][0] / pair[0][1] - pair[1][0] / pair[1][1]))
    pooled = (a[0] + b[0]) / (a[1] + b[1])
    return (a, b) if abs(a[0] / a[1] - b[0] / b[1]) <= PRICE_SPREAD * pooled else None


class BatchAB(NamedTuple):
    """A batch A/B's realized speed-ups over plain batched decoding: over all its batches, and over each half."""

    pooled: float
    halves: tuple[float, float]

    def wins(self) -> bool:
        """Drafting pays on the whole mix of prompts (:func:`~.search.pays`: a real speed-up, no price)."""
        return pays(self.pooled)

    def loses(self) -> bool:
        """Both halves under: plain decoding proved by two measurements."""
        return not any(pays(r) for r in self.halves)

    def said(self) -> str:
        return f"{self.pooled:.2f}x (halves {self.halves[0]:.2f}x, {self.halves[1]:.2f}x)"

    def to_dict(self) -> dict[str, Any]:
        return {"pooled": round(self.pooled, 3), "halves": [round(r, 3) for r in self.halves]}


@torch.inference_mode()
def batch_check(target: Any, drafter: Any, policy: RoundPolicy, answers: list[AnswerRecord], rows: int,
                sampling: dict[str, Any] | None = None, max_new_tokens: int = BATCH_CHECK_TOKENS,
                prompts: int = BATCH_CHECK_PROMPTS) -> BatchAB:
    """A real A/B at batch size ``rows`` on about ``prompts`` recorded prompts: the recorded ``answers``' prompts in
    consecutive batches of ``rows`` (at least two batches; repeated when there are too few), each left-padded and
    decoded by plain batched ``generate`` and by ``policy``'s, the arms' order alternating per batch (a load that comes
    and goes hits both). Returns the realized speed-up over all the batches and over each half of them: plain's
    decode seconds over the drafted calls' (the same tokens: the drafted call is lossless), a timed one-token plain
    call per batch (its prefill) taken off both. A batched call lasts as long as its slowest row, so which prompts
    share a batch moves the figure (0.9x to 1.35x for three batches of 4 on one machine): many prompts, not one batch
    twice."""
    device = target.get_input_embeddings().weight.device
    pad = pad_token_id_of(target.generation_config)
    batches = max(2, -(-prompts // rows))
    chosen = [(a := answers[i % len(answers)]).tokens[: a.start] for i in range(batches * rows)]
    view, plain = drafter.with_policy(policy), plain_view(drafter, policy)
    sampling = sampling or {"do_sample": False}

    def seconds(batch: dict[str, torch.Tensor], assistant: Any, new_tokens: int) -> float:
        torch.manual_seed(0)
        kwargs = {"assistant_model": assistant} if assistant is not None else {}
        synchronize(device)
        started = time.perf_counter()
        target.generate(**batch, max_new_tokens=new_tokens, pad_token_id=pad, **sampling, **kwargs)
        synchronize(device)
        return time.perf_counter() - started

    totals = [[0.0, 0.0], [0.0, 0.0]]  # per half: plain, drafted
    for index in range(batches):
        batch = left_padded(chosen[index * rows:(index + 1) * rows], pad, device)
        if index == 0:  # warm-up: a shape's first forwards cost more
            seconds(batch, view, 4)
            seconds(batch, plain, 4)
        prefill = seconds(batch, None, 1)
        plain_first = index % 2 == 0
        arms = (plain, view) if plain_first else (view, plain)
        timed = [seconds(batch, arm, max_new_tokens) - prefill for arm in arms]
        half = totals[0 if index < batches / 2 else 1]
        for column, elapsed in enumerate(timed if plain_first else timed[::-1]):  # plain, drafted
            half[column] += elapsed
    plain, drafted = (sum(column) for column in zip(*totals))
    return BatchAB(max(plain, 1e-9) / max(drafted, 1e-9),
                   tuple(max(p, 1e-9) / max(d, 1e-9) for p, d in totals))


def check_batch_choice(target: Any, drafter: Any, records: RoundRecords, choice: dict[str, Any], result: dict[str, Any],
                 rows: int) -> str:
    """Each choice for a batch of ``rows``, checked by a real A/B against plain batched decoding on the recorded
    prompts (:func:`batch_check`). A drafting choice, or where the replay chose plain the best replayed
    drafting policy (a plain choice keeps its knobs): kept where it pays over all the A/B's batches (1 +
    ``PLAIN_MARGIN``); else the drafter's shipped constants (a narrower round: the replay's choice is often the widest,
    which a batch pays for in every row) get their own A/B and are kept where they pay; plain batched decoding stands
    where every half of both A/Bs is under the margin (two measurements agree). Otherwise (a half over, the whole
    under) the better of the two drafts for this process, uncached (returns why). Changes ``choice`` and records the
    A/Bs in ``result["batch_check"]``. Why a replayed plain is checked too: the replay prices a batch from timed
    forwards and recorded rounds, and a model of that kind was off by 25-45 % at 4 and 8 rows before the forwards were
    timed as the batch loop runs them (``docs/design/batching.md``)."""
    note = ""
    checked = result.setdefault("batch_check", {})
    for name, answers in (("greedy", records.greedy), ("sampled", records.sampled)):
        if not answers:
            continue
        policy = choice[name]
        replayed_plain = not policy.speculate
        if replayed_plain:  # its knobs are the best replayed drafting policy's (search._plain)
            policy = policy.replace(speculate=True, source="tuned", reason="the best replayed drafting policy")
        sampling = {"do_sample": False} if name == "greedy" else {"do_sample": True, "temperature": records.temperature}
        tried = [(policy, batch_check(target, drafter, policy, answers, rows, sampling))]
        checked[name] = tried[0][1].to_dict()
        shipped = policy.replace(**_shipped_knobs(drafter, policy), source="shipped", expected_speedup=None)
        if not tried[0][1].wins() and shipped != policy:
            tried.append((shipped, batch_check(target, drafter, shipped, answers, rows, sampling)))
            checked[f"{name}_shipped"] = tried[1][1].to_dict()
        said = "; the drafter's shipped constants ".join(ab.said() for _, ab in tried)
        best, ab = max(tried, key=lambda pair: pair[1].pooled)
        if ab.wins():
            choice[name] = best.replace(reason=f"a real A/B at batch {rows} on the recorded prompts realized {said}")
        elif all(ab.loses() for _, ab in tried):
            predicted = "plain" if replayed_plain else policy.expected_speedup
            choice[name] = policy.replace(speculate=False, expected_speedup=None, reason=(
                f"at batch {rows} a real A/B on the recorded prompts realized {said} against plain batched decoding "
                f"(the replay predicted {predicted}), under 1 + {PLAIN_MARGIN:g}"))
            result["plain_measurements"] = 2 * len(tried)
        else:
            choice[name] = best
            note = (f"a real A/B at batch {rows} did not agree with itself ({said}); drafting is kept for this "
                    "process, and the next one measures again")
    return note


def _shipped_knobs(drafter: Any, policy: RoundPolicy) -> dict[str, Any]:
    """The round knobs of the drafter's shipped constants (cut, lookup), to put on ``policy`` (its armed costs and
    proposal mode kept)."""
    base = shipped_policy(drafter.config)
    return {"confidence_cut": base.confidence_cut, "lookup": base.lookup, "lookup_start": base.lookup_start,
            "lookup_cap": base.lookup_cap}
