"""What a round costs on this machine, in one-token target steps: the target's verify forward over ``k`` drafts and
the drafter's round. Timed on random inputs with separate random generators, so a call's sampling is untouched.

A busy moment must not set the policy for good: each verify is timed between two one-token forwards and the curve
fitted robustly (:mod:`.timings`: the pairing, the passes, the medians, the isotonic fit), and checked against the
one-token step of the same window. When the repeats disagree (:data:`SPREAD_LIMIT`) or a verify costs more than its
tokens as separate steps, the timing is done again; when that stays so, the costs say ``settled=False``. A CPU busy with another process is then timed with half
the intra-op threads (:func:`measure_costs_fewer_threads`): a one-token step with both of 2 threads, one core taken
by a busy loop, took 116-228 ms and never settled, while one thread beside the same loop settled every time and chose
what the idle machine chooses (``docs/round-policy.md``); the tuner uses that choice for the process, uncached.

Where torch's oneDNN switch changes the target's bf16 kernels (:func:`onednn_switchable`), every width is timed with
oneDNN off too, in the same pairing, and the costs are those of the cheaper rule (:func:`with_onednn_off`): narrow
forwards without oneDNN, wide ones with it, priced in the faster one-token step, which is then plain decoding's own
(a call runs that rule: :func:`hf_retrace.machine.onednn_from_width`).

Example::

    costs = measure_costs(target, drafter, max_drafts=16)
    costs.verify_costs[7], costs.draft_cost(None)   # verify 7 drafts; a full-block drafter round

A batch is priced the same way with ``rows=B``: every forward then runs ``B`` rows, so the unit is a ``B``-row
one-token step (plain batched decoding's), and the drafter round is the batch loop's (every row's whole block in one
forward, before the rows' rounds decide: the accelerator order of :func:`~hf_retrace.generation.proposal.one_transfer`).
Every batched forward is timed as the loops run it (:func:`batch_probe_mask`): over a left-padded cache holding
masked slots, with a 2-D attention mask and per-row positions. A clean causal probe priced a batch wrongly: on a
2-core EPYC in bf16 a padded one-token step at 8 rows took 55 ms where the unpadded probe took 83 ms, while a verify
of 8 tokens a row took about as long either way, so every verify read 1.5x too cheap in steps
(``docs/design/batching.md``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from transformers import DynamicCache

from ..generation.proposal import on_accelerator, one_transfer
from ..generation.placement import synchronize
from ..generation.policy import LOOKUP_COST, RoundPolicy
from ..generation.target_features import cache_kwargs
from ..machine import onednn_matmuls
from .timings import MIN_PASSES, SPREAD_LIMIT, fit_verify_costs, robust_spread, sample_verify_ratios

__all__ = ["MachineCosts", "batch_probe_mask", "measure_costs", "measure_costs_fewer_threads", "measure_draft_cost",
           "measure_row_share", "measure_verify_costs", "onednn_switchable", "sample_onednn_off", "timed",
           "timed_enough", "with_onednn_off"]

PROBE_POINTS = (1, 2, 3, 4, 8, 16)  # timed against a one-token forward; the k between are interpolated
ATTEMPTS = 2  # timings that stay unsettled after this many attempts leave the shipped policy in place, uncached
ONEDNN_GAIN = 0.1  # narrow forwards run without torch's oneDNN only where its one-token step is this much slower
MEASURE_SECONDS = 15.0  # a measurement still running after this is a busy machine (a core taken by another process
# made a 2-thread one-token step 26x slower, measured: 1.0 s against 37 ms): it stops, unsettled, and decides nothing


def timed(fn: Any, device: Any) -> float:
    """Seconds ``fn()`` takes on ``device``, synchronised before and after."""
    synchronize(device)
    started = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - started


@dataclass(frozen=True)
class MachineCosts:
    """``verify_costs[k]``: the target's forward over ``k + 1`` new tokens / its one-token forward (k = 0..max);
    ``draft_cost_chunk`` / ``draft_cost_full``: a drafter round scoring 2 slots / the whole block, same unit;
    ``step_seconds``: the one-token forward itself; ``drafter_first``: the drafter runs on an accelerator, where rounds
    launch its whole block before the lookup decision (:func:`~hf_retrace.generation.proposal.one_transfer`);
    ``spread``: the largest disagreement between a timed ``k``'s repeats (:class:`VerifyFit`); ``settled``: False when
    the timings stayed too noisy or implausible to decide on (the tuner keeps the shipped policy and caches nothing);
    ``rows``: the batch size every forward was timed at (the unit is then a ``rows``-row one-token step);
    ``timed_out``: the measurement ran past :data:`MEASURE_SECONDS` before its passes were done (a busy machine);
    ``row_share``: in a batch, the share of a forward's time that scales with its rows (a forward over ``n`` of the
    ``rows`` rows costs ``(1 - row_share) + row_share * n / rows`` of one over all: :func:`measure_row_share`);
    ``threads``: the intra-op threads the forwards were timed with where fewer than the process's (a busy CPU's
    stand-in, :func:`measure_costs_fewer_threads`), 0 where the process's own;
    ``onednn_from`` / ``drafter_onednn``: the kernels every cost above was priced with, as a policy runs them
    (:class:`~hf_retrace.generation.policy.RoundPolicy`): target forwards under ``onednn_from`` new tokens without
    torch's oneDNN (0: all as the process runs them; the unit is then the faster one-token step), the drafter's round
    without it where ``drafter_onednn`` is False (:func:`sample_onednn_off`, :func:`with_onednn_off`);
    ``price``: real calls' speed-up over plain ``generate`` / the replay's figure for the same rounds (the loop's own
    work; :func:`~hf_retrace.tuning.verify.measure_price`), None where not measured or unsettled; ``clock_price``:
    the same calls' speed-up over their figure as the generator clocks its rounds (the unit of a real call's realized
    figure, :func:`~hf_retrace.tuning.verify.clocked_cost`), measured with it.
    """

    verify_costs: tuple[float, ...]
    draft_cost_chunk: float
    draft_cost_full: float
    step_seconds: float
    drafter_first: bool = False
    spread: float = 0.0
    settled: bool = True
    rows: int = 1
    timed_out: bool = False
    row_share: float = 0.0
    threads: int = 0
    onednn_from: int = 0
    drafter_onednn: bool = True
    price: float | None = None
    clock_price: float | None = None

    def unsettled_cause(self) -> str:
        """Why the timings decide nothing, in words ("" when settled)."""
        if self.settled:
            return ""
        if self.timed_out:
            return (f"the measurement did not finish within its {MEASURE_SECONDS:.0f} s: a busy machine, a one-token "
                    f"step took {self.step_seconds * 1000:.0f} ms")
        if self.spread > SPREAD_LIMIT:
            return f"the spread between repeats was {self.spread:.2f}"
        return "a verify cost more than its tokens as separate steps"

    def draft_cost(self, confidence_cut: float | None) -> float:
        """A drafter round's cost under a cut (``None``: full blocks score every slot; else mostly the first chunk; in
        the accelerator order every round scores the whole block)."""
        return self.draft_cost_full if confidence_cut is None or self.drafter_first else self.draft_cost_chunk

    def arm(self, policy: RoundPolicy, **changes: Any) -> RoundPolicy:
        """``policy`` (with ``changes``) priced on this machine: the verify curve, the drafter round its cut pays, and a
        lookup round's cost (in the accelerator order it pays the drafter's whole block too). The order is the
        generator's own rule (:func:`~hf_retrace.generation.proposal.one_transfer`), or the policy's ``one_transfer``
        where set; a call's per-slot processors are not known here (a tuned policy is shared by calls)."""
        policy = policy.replace(**changes)
        accelerator = self.drafter_first if policy.one_transfer is None else policy.one_transfer
        in_one = one_transfer(accelerator, sampled_proposals=policy.proposal_mode == "sample")
        costs = replace(self, drafter_first=in_one)
        lookup = LOOKUP_COST + (costs.draft_cost_full if costs.drafter_first else 0.0)
        return policy.replace(verify_costs=costs.verify_costs, draft_cost=costs.draft_cost(policy.confidence_cut),
                              lookup_cost=lookup, onednn_from=self.onednn_from, drafter_onednn=self.drafter_onednn,
                              price=self.price)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["verify_costs"] = [round(c, 4) for c in self.verify_costs]
        data["spread"] = round(self.spread, 4)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MachineCosts":
        return cls(tuple(data["verify_costs"]), float(data["draft_cost_chunk"]), float(data["draft_cost_full"]),
                   float(data["step_seconds"]), bool(data.get("drafter_first", False)),
                   float(data.get("spread", 0.0)), bool(data.get("settled", True)), int(data.get("rows", 1)),
                   bool(data.get("timed_out", False)), float(data.get("row_share", 0.0)),
                   int(data.get("threads", 0)), int(data.get("onednn_from", 0)),
                   bool(data.get("drafter_onednn", True)),
                   None if data.get("price") is None else float(data["price"]),
                   None if data.get("clock_price") is None else float(data["clock_price"]))


@torch.inference_mode()
def measure_verify_costs(target: Any, max_drafts: int, context_length: int = 256, repeats: int = 5,
                         points: Sequence[int] = PROBE_POINTS, rows: int = 1) -> list[float]:
    """``costs[k]`` for k = 0..``max_drafts``: seconds of a target forward over ``k + 1`` new tokens on a cached
    context / that of one token. ``k`` on ``points`` is timed, the ``k`` between interpolated, the ``k`` past the
    longest point extended along its last step (:func:`fit_verify_costs`)."""
    probe = _verify_probe(target, max_drafts, context_length, rows)
    ratios, _ = sample_verify_ratios(probe, _probe_points(max_drafts, points), repeats)
    return fit_verify_costs(ratios, max_drafts).costs


def _probe_points(max_drafts: int, points: Sequence[int] = PROBE_POINTS) -> list[int]:
    return sorted({k for k in points if 0 < k <= max_drafts} | {min(max_drafts, max(points))} - {0})


def _context_cache(target: Any, ids: torch.Tensor, context_length: int) -> DynamicCache:
    """A cache holding ``context_length`` positions. Attention's cost does not depend on what the keys hold, so one
    real token is run and the rest filled with random keys and values, sparing a prefill that would take longer than
    the timing itself on a CPU; a cache that cannot be filled so is prefilled for real."""
    cache = DynamicCache()
    target(input_ids=ids[:, :1], **cache_kwargs(target, cache), use_cache=True, logits_to_keep=1)
    try:
        generator = torch.Generator().manual_seed(1)
        for index, layer in enumerate(cache.layers):
            shape = (*layer.keys.shape[:2], context_length - 1, layer.keys.shape[-1])
            noise = [0.1 * torch.randn(shape, generator=generator).to(layer.keys.device, layer.keys.dtype)
                     for _ in range(2)]
            cache.update(*noise, index)
        if cache.get_seq_length() == context_length:
            return cache
    except (AttributeError, TypeError, ValueError, RuntimeError):
        pass
    cache = DynamicCache()
    target(input_ids=ids[:, :context_length], **cache_kwargs(target, cache), use_cache=True, logits_to_keep=1)
    return cache


def batch_probe_mask(rows: int, context_length: int, new: int, device: Any = None) -> torch.Tensor:
    """``[rows, slots + new]``: the 2-D attention mask of a batch's cache as the batch loops hold it, for timing a
    forward as they run it. ``slots`` is ``context_length`` committed slots plus a quarter as many masked ones (a
    row's rejected drafts, which stay until a compaction: between none and as many as it committed, see
    :mod:`~hf_retrace.generation.batched_cache`), scattered past the padding; every other row is left-padded by an
    eighth of the context (prompts of different lengths); the ``new`` slots being timed are all real.

    >>> batch_probe_mask(2, 16, 3).sum(-1).tolist()   # 16 context slots + 3 new; row 1's prompt 2 shorter (padded)
    [19, 17]
    """
    holes, pad = context_length // 4, context_length // 8
    mask = torch.ones(rows, context_length + holes + new, dtype=torch.long)
    generator = torch.Generator().manual_seed(2)
    for row in range(rows):
        start = pad if row % 2 else 0
        mask[row, :start] = 0
        span = context_length + holes - start - 1  # the first real slot stays one
        mask[row, start + 1 + torch.randperm(span, generator=generator)[:holes]] = 0
    return mask.to(device)


@torch.inference_mode()
def _verify_probe(target: Any, max_drafts: int, context_length: int, rows: int = 1,
                  batched: bool | None = None) -> Callable[[int], float]:
    """``probe(k)``: seconds of the target's forward over ``k + 1`` new tokens of each of ``rows`` rows on a cached
    ``context_length`` context (the new positions cropped again after each), warmed up once. A batch (``rows`` > 1)
    runs as the batch loop runs it: a cache with padding and masked slots (:func:`batch_probe_mask`), an attention
    mask and per-row positions; ``probe(0)`` is then plain batched decoding's step over a padded batch (``batched``:
    the same at one row, for comparing a batch with fewer rows)."""
    device = target.get_input_embeddings().weight.device
    vocab = target.config.get_text_config().vocab_size
    batched = rows > 1 if batched is None else batched
    mask = batch_probe_mask(rows, context_length, max_drafts + 1, device) if batched else None
    slots = context_length if mask is None else mask.shape[1] - max_drafts - 1
    ids = torch.randint(0, vocab, (rows, slots + max_drafts + 1), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    cache = _context_cache(target, ids, slots)
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp_min(0)

    @torch.inference_mode()
    def probe(k: int) -> float:
        new = ids[:, slots : slots + k + 1]
        batch = {} if mask is None else dict(attention_mask=mask[:, : slots + k + 1],
                                             position_ids=positions[:, slots : slots + k + 1])
        took = timed(lambda: target(input_ids=new, **cache_kwargs(target, cache), use_cache=True, **batch), device)
        cache.crop(-(k + 1))  # negative: drop the k + 1 new positions (transformers 4.57 and 5.x)
        return took

    probe(0)  # warm-up; a shape's first forward costs little more than its next ones, so all of them count
    return probe


@torch.inference_mode()
def measure_draft_cost(target: Any, drafter: Any, step_seconds: float, context_length: int = 256,
                       repeats: int = 3, step_probe: Callable[[], float] | None = None,
                       rows: int = 1, onednn: bool = True) -> tuple[float, float]:
    """(a drafter round scoring 2 slots, one scoring the whole block), in one-token steps: one forward over
    ``[anchor, MASK x (B-1)]`` reading one new context row on a cached context (for each of ``rows`` rows, in one
    forward), then the draft head. With
    ``step_probe`` (a one-token target forward), each round is timed against the step just after it and the median
    ratio kept (a slowdown that lasts cancels); without, the fastest round over ``step_seconds``. ``onednn=False``:
    the drafter's round runs with torch's oneDNN off (the step probe as the process runs it)."""
    device = drafter.device
    block_size = drafter.config.block_size
    features = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    # a batch's drafter cache holds padding and masked slots as the target's does (generation/batched_drafter.py)
    mask = batch_probe_mask(rows, context_length, 1 + block_size, device) if rows > 1 else None
    cached = context_length if mask is None else mask.shape[1] - 1 - block_size
    generator = torch.Generator().manual_seed(0)
    context = torch.randn(rows, cached + 1, features, generator=generator).to(device, drafter.dtype)
    embed = target.get_input_embeddings()
    head = drafter.draft_head(target.get_output_embeddings())  # scored in its own dtype, as in a round
    cache = DynamicCache()
    block = drafter.block_embeddings(torch.zeros(rows, dtype=torch.long, device=device), embed)
    drafter(target_hidden=context[:, :cached], noise_embedding=block,
            position_ids=torch.arange(cached + block_size, device=device)[None].expand(rows, -1),
            past_key_values=cache,
            use_cache=True)
    cache.crop(-block_size)
    if mask is None:
        positions = torch.arange(cached, cached + 1 + block_size, device=device)[None].expand(rows, -1)
        batch = {}
    else:
        positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, cached:]
        batch = dict(attention_mask=mask.bool()[:, None, None, :].expand(-1, 1, block_size, -1))

    def round_(slots: int) -> None:
        with onednn_matmuls(onednn):
            drafted(slots)

    def drafted(slots: int) -> None:
        hidden = drafter(target_hidden=context[:, cached:], noise_embedding=block, position_ids=positions,
                         past_key_values=cache, use_cache=True, **batch)
        cache.crop(-(block_size + 1))
        drafter.compute_logits(hidden[:, 1 : slots + 1], head).softmax(-1).amax(-1)

    chunk = min(2, block_size - 1)
    ratios: dict[int, list[float]] = {chunk: [], block_size - 1: []}
    for repeat in range(max(repeats, MIN_PASSES if step_probe else 1) + 1):
        for slots in ratios:
            took = timed(lambda: round_(slots), device)
            if repeat:  # the first is a warm-up
                ratios[slots].append(took / (step_probe() if step_probe else step_seconds))
    pick = statistics.median if step_probe else min
    return pick(ratios[chunk]), pick(ratios[block_size - 1])


ROW_SHARE_WIDTHS = (1, 3)  # the verify widths the row share is timed at (what batched rounds mostly send)


@torch.inference_mode()
def measure_row_share(target: Any, context_length: int, rows: int, probe: Callable[[int], float] | None = None,
                      passes: int = MIN_PASSES) -> float:
    """The share of a batched forward's time that scales with its rows, from verifies over ``rows`` rows and over
    half as many, timed in turns: ``(1 - t_half / t_all) / (1 - half / rows)`` (median, within 0..1). A batch whose
    rows finish at different rounds runs narrower forwards towards its end (a finished row leaves the batch loop);
    on a 2-core EPYC a verify of 4 tokens a row at 4 rows took 0.70 of its time at 8, a one-token step 0.84 (shares
    measured by this: 0.39, 0.44, 0.58 at 2, 4, 8 rows)."""
    half = max(1, rows // 2)
    probe = probe or _verify_probe(target, max(ROW_SHARE_WIDTHS), context_length, rows)
    fewer = _verify_probe(target, max(ROW_SHARE_WIDTHS), context_length, half, batched=True)
    shares = []
    for index in range(passes):
        for k in ROW_SHARE_WIDTHS if index % 2 == 0 else reversed(ROW_SHARE_WIDTHS):
            if index % 2 == 0:  # the order alternates, so neither side always runs second
                full, narrow = probe(k), fewer(k)
            else:
                narrow, full = fewer(k), probe(k)
            shares.append((1 - narrow / full) / (1 - half / rows))
    return min(1.0, max(0.0, statistics.median(shares)))


def onednn_switchable(target: Any) -> bool:
    """Whether torch's oneDNN switch changes which kernels this target's matmuls run: weights in bf16 (or fp16) on a
    CPU where oneDNN is built, on, and has kernels for that dtype. float32 matmuls go to the BLAS either way (the
    same results with the switch on or off, measured), and a CPU without AVX-512 has no oneDNN bf16 path."""
    device = target.get_input_embeddings().weight.device
    if device.type != "cpu" or not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    checks = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    check = checks.get(target.dtype)
    try:
        return check is not None and bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a torch without the check
        return False


def sample_onednn_off(probe: Callable[[int], float], ks: Sequence[int], repeats: int = 5,
                      deadline: float | None = None) -> dict[int, list[float]]:
    """Per ``k`` in ``0`` and ``ks``: the seconds of ``probe(k)`` run with torch's oneDNN off over the one-token
    forward as the process runs it, timed around it (:func:`sample_verify_ratios`' pairing, so a load that lasts
    cancels): the same unit as the verify ratios, so the two kernels' curves compare point by point."""
    def mixed(j: int) -> float:  # j = 0: the process's one-token step; j = k + 1: a forward of k + 1 tokens, off
        if j == 0:
            return probe(0)
        with onednn_matmuls(False):
            return probe(j - 1)

    ratios, _ = sample_verify_ratios(mixed, [1] + [k + 1 for k in ks], repeats, deadline=deadline)
    return {j - 1: values for j, values in ratios.items()}


def timed_enough(on: dict[int, list[float]], off: dict[int, list[float]]) -> bool:
    """Whether every ``k`` of ``on`` and the one-token step were timed :data:`MIN_PASSES` times off (not cut short)."""
    return all(len(off.get(k, ())) >= MIN_PASSES for k in [0, *on])


def with_onednn_off(on: dict[int, list[float]], off: dict[int, list[float]]
                    ) -> tuple[int, float, dict[int, list[float]]]:
    """``(onednn_from, unit, ratios)``: where forwards without oneDNN pay, the narrowest width that keeps it and the
    verify ratios of that rule in units of the faster one-token step (``unit``: that step over the process's).

    ``on``: :func:`sample_verify_ratios`' ratios, ``off``: :func:`sample_onednn_off`'s, the same ``k``. Forwards of up
    to the widest ``k + 1`` whose median is cheaper off run off (one rule, so a cost between two timed ``k`` is that
    of the kernels the rule runs); ``(0, 1.0, on)`` where the one-token step is not :data:`ONEDNN_GAIN` cheaper off,
    or any ``k`` was not timed :data:`MIN_PASSES` times off (a measurement cut short switches nothing)."""
    if not timed_enough(on, off):
        return 0, 1.0, on
    unit = statistics.median(off[0])
    if unit > 1 - ONEDNN_GAIN:
        return 0, 1.0, on
    medians = {0: 1.0, **{k: statistics.median(values) for k, values in on.items() if values}}
    cheaper = [k for k in medians if statistics.median(off[k]) < medians[k]]
    width = max(cheaper) + 2  # forwards of up to max(cheaper) + 1 new tokens run off
    ratios = {k: [r / unit for r in (off[k] if k + 1 < width else values)] for k, values in on.items()}
    return width, unit, ratios


@torch.inference_mode()
def measure_costs(target: Any, drafter: Any, max_drafts: int = 16, context_length: int = 256,
                  repeats: int = 5, attempts: int = ATTEMPTS, seconds: float = MEASURE_SECONDS,
                  rows: int = 1) -> MachineCosts:
    """This machine's :class:`MachineCosts` for ``target`` and ``drafter`` (about 4-5 s for a 135M target on 2 CPU
    cores; 8-10 s where both kernels are timed), at batch size ``rows``. Timings that stay unsettled (:attr:`VerifyFit.settled`) over ``attempts``, or that
    do not finish their passes within ``seconds``, give ``settled=False``.

    Where torch's oneDNN switch changes the target's kernels (:func:`onednn_switchable`), every verify width and the
    drafter's round are timed with it off too, paired with the same one-token steps (within another ``seconds / 2``;
    cut short, nothing is switched), and the costs are those of the cheaper rule (:func:`with_onednn_off`): on a
    2-core EPYC with ``avx512_bf16`` a bf16 one-token step took 40.7 ms with oneDNN and 23.9 without, a 9-token verify
    46.6 against 83.3 (docs/bench/2026-12-06-epyc-onednn/)."""
    max_drafts = max(max_drafts, drafter.config.block_size - 1)
    deadline = time.perf_counter() + seconds
    probe = _verify_probe(target, max_drafts, context_length, rows)
    for _ in range(max(attempts, 1)):  # a busy moment passes: time again before giving up on this window
        ratios, steps = sample_verify_ratios(probe, _probe_points(max_drafts), repeats, deadline=deadline)
        fit = fit_verify_costs(ratios, max_drafts)
        finished = all(len(values) >= MIN_PASSES for values in ratios.values())
        if (fit.settled and finished) or time.perf_counter() > deadline:
            break
    step = statistics.median(steps)
    late = time.perf_counter() > deadline  # unsettled already: the drafter's cost once, without its paired steps
    chunk, full = measure_draft_cost(target, drafter, step, context_length, 1 if late else repeats,
                                     step_probe=None if late else lambda: probe(0), rows=rows)
    width, unit, drafter_onednn = 0, 1.0, True
    if not late and fit.settled and finished and onednn_switchable(target):
        off = sample_onednn_off(probe, _probe_points(max_drafts), repeats,
                                deadline=time.perf_counter() + seconds / 2)
        finished = timed_enough(ratios, off)  # cut short: nothing switched, nor settled (a busy moment, issue 41)
        width, unit, mixed = with_onednn_off(ratios, off)
        if width:
            mixed_fit = fit_verify_costs(mixed, max_drafts)
            mixed_fit = replace(mixed_fit, spread=max(mixed_fit.spread, robust_spread(off[0])))
            if mixed_fit.settled:
                fit = mixed_fit
            else:  # too noisy to trust: nothing switched, nor settled (settled, it cached the slower kernels for good)
                width, unit = 0, 1.0
                fit = replace(fit, spread=max(fit.spread, mixed_fit.spread), implausible=mixed_fit.implausible)
    if width:
        off_chunk, off_full = measure_draft_cost(target, drafter, step, context_length, repeats,
                                                 step_probe=lambda: probe(0), rows=rows, onednn=False)
        drafter_onednn = chunk + full <= off_chunk + off_full
        chunk, full = ((chunk, full) if drafter_onednn else (off_chunk, off_full))
        chunk, full, step = chunk / unit, full / unit, step * unit
    # a batch drafts every row's whole block before the rows decide: the accelerator order (generation/batched.py)
    drafter_first = on_accelerator(drafter.device) or rows > 1
    share = measure_row_share(target, context_length, rows, probe) if rows > 1 and not late else 0.0
    onednn_from = rows * (width - 1) + 1 if width else 0  # the rule counts a forward's tokens over all its rows
    return MachineCosts(tuple(fit.costs), chunk, full, step, drafter_first, fit.spread, fit.settled and finished,
                        rows, timed_out=not finished, row_share=share, onednn_from=onednn_from,
                        drafter_onednn=drafter_onednn)


def measure_costs_fewer_threads(target: Any, drafter: Any, **kwargs: Any) -> MachineCosts | None:
    """:func:`measure_costs` (``kwargs``) with half the process's intra-op threads, at least one, restored after: the
    costs a CPU busy with another process still lets be timed steadily, standing in for those of all its threads
    (``threads`` says how many ran). None where there is nothing to halve: one thread, or a model on an accelerator.

    Why: on a 2-core EPYC with one core taken by a busy loop, a one-token step with both threads took 116-228 ms
    (42-63 idle) and its repeats spread 0.65-0.85, while with one thread beside the same loop it took 56-62 ms,
    spread 0.03-0.11, and the replay chose cut 0.2 with lookup 4..32 (3 of 3), as the idle machine's tunings with
    both threads did (cut 0.2 or 0.3 with lookup 4..32, 3 of 3). The stand-in prices long verifies a little high
    (one thread is compute-bound sooner: 32 drafts 1.7-2.1 steps against 1.6-1.8), so it errs towards shorter
    rounds, never towards plain decoding."""
    threads = torch.get_num_threads()
    devices = (target.get_input_embeddings().weight.device, drafter.device)
    if threads < 2 or any(on_accelerator(device) for device in devices):
        return None
    fewer = threads // 2
    torch.set_num_threads(fewer)
    try:
        costs = measure_costs(target, drafter, **kwargs)
    finally:
        torch.set_num_threads(threads)
    return replace(costs, threads=fewer)
