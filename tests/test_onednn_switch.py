"""The matmul kernels per forward (issue 41): on a CPU whose oneDNN bf16 one-token forward is the slower one, the tuner
times every verify width with oneDNN off too and prices the cheaper rule; a call runs the target's narrow forwards and
the drafter's round as it was priced, puts the process's setting back after every forward, and stays lossless."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_drafter, tiny_target

import hf_retrace  # noqa: F401  (installs the dispatch)
from hf_retrace.generation.policy import RoundPolicy
from hf_retrace.machine import forward_width, onednn_from_width, onednn_matmuls
from hf_retrace.tuning import costs as costs_module
from hf_retrace.tuning.costs import measure_costs, with_onednn_off
from hf_retrace.tuning.timings import MIN_PASSES, fit_verify_costs
from hf_retrace.tuning.verify import plain_view

# the EPYC's table (docs/bench/2026-12-06-epyc-onednn/): ms of a forward of k + 1 new tokens, oneDNN on / off
ON_MS = {0: 40.7, 1: 40.0, 2: 40.8, 3: 41.6, 4: 42.9, 8: 46.6, 16: 54.0}
OFF_MS = {0: 23.9, 1: 28.5, 2: 36.1, 3: 43.4, 4: 51.6, 8: 83.3, 16: 147.6}


def _ratios(table: dict[int, float], passes: int = MIN_PASSES) -> dict[int, list[float]]:
    return {k: [ms / ON_MS[0]] * passes for k, ms in table.items()}


def test_the_epyc_table_switches_forwards_under_four_tokens_and_prices_them_in_the_faster_step():
    on = {k: v for k, v in _ratios(ON_MS).items() if k}
    width, unit, ratios = with_onednn_off(on, _ratios(OFF_MS))
    assert width == 4  # 1-3 new tokens without oneDNN, 4 and more with it
    assert unit == pytest.approx(23.9 / 40.7)
    fit = fit_verify_costs(ratios, 16)
    assert fit.costs[0] == 1.0
    assert fit.costs[2] == pytest.approx(36.1 / 23.9)  # off: 3 tokens
    assert fit.costs[3] == pytest.approx(41.6 / 23.9)  # on: 4 tokens
    assert fit.costs[8] == pytest.approx(46.6 / 23.9) and fit.settled


def test_no_switch_where_the_one_token_step_is_not_faster_off_or_was_not_timed_enough():
    on = {k: v for k, v in _ratios(ON_MS).items() if k}
    close = _ratios({k: ms * 0.95 for k, ms in ON_MS.items()})  # 5 % faster: under ONEDNN_GAIN, not worth a change
    assert with_onednn_off(on, close) == (0, 1.0, on)
    short = {**_ratios(OFF_MS), 16: [OFF_MS[16] / ON_MS[0]]}  # cut short at its deadline: one pass at k = 16
    assert with_onednn_off(on, short) == (0, 1.0, on)


def test_an_isolated_cheaper_width_switches_every_narrower_one_so_costs_follow_the_rule():
    on = {k: v for k, v in _ratios(ON_MS).items() if k}
    off = _ratios({**OFF_MS, 8: 45.0})  # off cheaper again at 9 tokens (a blip): 1..9 tokens run off
    width, unit, ratios = with_onednn_off(on, off)
    assert width == 10
    assert ratios[4] == [pytest.approx(51.6 / 23.9)] * MIN_PASSES  # the rule runs 5 tokens off: priced off
    assert ratios[16] == [pytest.approx(54.0 / 23.9)] * MIN_PASSES


class Recorder(torch.nn.Module):
    """A model whose forward notes (its width, oneDNN on or off)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, bool]] = []

    def forward(self, input_ids=None, inputs_embeds=None, fail=False):
        self.seen.append((forward_width((), {"input_ids": input_ids, "inputs_embeds": inputs_embeds}),
                          torch.backends.mkldnn.enabled))
        if fail:
            raise RuntimeError("a forward that raises")
        return input_ids


def test_the_hook_runs_narrow_forwards_off_and_puts_the_setting_back_after_each():
    model = Recorder()
    before = torch.backends.mkldnn.enabled
    with onednn_from_width(model, 4):
        for width in (1, 3, 4, 9):
            model(input_ids=torch.zeros(1, width, dtype=torch.long))
            assert torch.backends.mkldnn.enabled == before
        model(inputs_embeds=torch.zeros(2, 1, 8))  # 2 rows of one token: 2 new tokens
        model(torch.zeros(1, 5, dtype=torch.long))  # positional
        with pytest.raises(RuntimeError):
            model(input_ids=torch.zeros(1, 1, dtype=torch.long), fail=True)
        assert torch.backends.mkldnn.enabled == before  # put back when the forward raised too
    model(input_ids=torch.zeros(1, 1, dtype=torch.long))  # the hooks are gone
    assert model.seen == [(1, False), (3, False), (4, before), (9, before), (2, False), (5, before), (1, False),
                          (1, before)]
    with onednn_from_width(model, 0), onednn_matmuls(True):  # 0: nothing switched
        model(input_ids=torch.zeros(1, 1, dtype=torch.long))
    assert model.seen[-1] == (1, before)


def test_a_policys_kernel_fields_are_checked_and_said():
    for bad in ({"onednn_from": -1}, {"onednn_from": 2.0}, {"drafter_onednn": "no"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RoundPolicy(**bad)
    policy = RoundPolicy(onednn_from=4, drafter_onednn=False)
    assert "under 4 new tokens without oneDNN" in policy.describe()
    assert "drafter without oneDNN" in policy.describe()
    plain = policy.replace(speculate=False)
    assert "under 4 new tokens" in plain.describe() and "drafter" not in plain.describe()
    assert RoundPolicy.from_dict(policy.to_dict()) == policy


@pytest.mark.parametrize("speculate", [True, False])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_call_under_a_kernel_rule_stays_lossless_and_puts_the_setting_back(speculate, rows):
    target = tiny_target(dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4, dtype=torch.float32)
    ids = torch.tensor([[5, 9, 13, 2, 7, 11], [3, 8, 1, 4, 6, 10]])[:rows]
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    before = torch.backends.mkldnn.enabled
    view = drafter.with_policy(RoundPolicy(speculate=speculate, confidence_cut=None, onednn_from=3,
                                           drafter_onednn=False))
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                          assistant_model=view)
    assert torch.equal(out, plain)  # float32: the same kernels either way, the same tokens
    assert torch.backends.mkldnn.enabled == before


def test_inside_a_call_narrow_target_forwards_and_the_drafters_round_run_off():
    target = tiny_target(dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4, dtype=torch.float32)
    inside: list[tuple[str, int, bool]] = []
    handles = [target.model.register_forward_hook(
        lambda m, a, k, o: inside.append(("target", forward_width(a, k), torch.backends.mkldnn.enabled)),
        with_kwargs=True),
        drafter.register_forward_hook(lambda m, a, k, o: inside.append(("drafter", 0, torch.backends.mkldnn.enabled)),
                                      with_kwargs=True)]
    view = drafter.with_policy(RoundPolicy(confidence_cut=None, onednn_from=3, drafter_onednn=False))
    try:
        with onednn_matmuls(True):
            target.generate(torch.tensor([[5, 9, 13, 2, 7, 11]]), max_new_tokens=16, do_sample=False,
                            assistant_model=view)
    finally:
        for handle in handles:
            handle.remove()
    on = torch.backends.mkldnn.enabled
    targets = [(width, enabled) for who, width, enabled in inside if who == "target"]
    assert targets and all(enabled == (on and width >= 3) for width, enabled in targets)
    assert any(width < 3 for width, _ in targets) and any(width >= 3 for width, _ in targets)
    drafted = [enabled for who, _, enabled in inside if who == "drafter"]
    assert drafted and not any(drafted)


def test_measured_costs_price_the_cheaper_rule_in_the_faster_step(monkeypatch):
    """A fake target whose forwards cost by the switch: with oneDNN flat (1 + 0.02 k steps), without it 0.45 of a
    step per token: cheaper for 1 and 2 tokens, dearer from 3."""
    target = tiny_target(dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4, dtype=torch.float32)
    step = 0.04

    def fake_probe(*args, **kwargs):
        def probe(k: int) -> float:
            return step * (1 + 0.02 * k if torch.backends.mkldnn.enabled else 0.45 * (k + 1))
        return probe

    monkeypatch.setattr(costs_module, "_verify_probe", fake_probe)
    monkeypatch.setattr(costs_module, "onednn_switchable", lambda target: True)
    with onednn_matmuls(True):
        if not torch.backends.mkldnn.enabled:
            pytest.skip("this torch has oneDNN off")
        costs = measure_costs(target, drafter, max_drafts=8, context_length=8, repeats=3, seconds=1e6)
    assert costs.settled and costs.onednn_from == 3
    assert costs.step_seconds == pytest.approx(0.45 * step)
    assert costs.verify_costs[1] == pytest.approx(2.0)  # 2 tokens off: 0.9 of the process's step, 2 of the faster
    assert costs.verify_costs[2] == pytest.approx(1.04 / 0.45)  # 3 tokens with oneDNN
    policy = costs.arm(RoundPolicy())
    assert policy.onednn_from == 3 and policy.drafter_onednn == costs.drafter_onednn
    monkeypatch.setattr(costs_module, "onednn_switchable", lambda target: False)
    assert measure_costs(target, drafter, max_drafts=8, context_length=8, repeats=3, seconds=1e6).onednn_from == 0


@pytest.mark.parametrize("fault", ["cut short", "noisy"])
def test_kernels_that_could_not_be_decided_leave_the_measurement_unsettled(monkeypatch, fault):
    """Off timings cut short at their deadline, or whose one-token repeats disagree, used to settle on oneDNN at every
    width: one busy moment, and every later call decoded on the slower kernels (issue 41). Now nothing settles."""
    target = tiny_target(dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4, dtype=torch.float32)

    def fake_probe(*args, **kwargs):
        return lambda k: 0.04 * (1 + 0.02 * k if torch.backends.mkldnn.enabled else 0.45 * (k + 1))

    real = costs_module.sample_onednn_off

    def faulty(*args, **kwargs):
        off = real(*args, **kwargs)
        if fault == "cut short":
            off[8] = off[8][:1]
        else:
            off[0] = [value * factor for value, factor in zip(off[0], (0.5, 1.0, 1.6))]
        return off

    monkeypatch.setattr(costs_module, "_verify_probe", fake_probe)
    monkeypatch.setattr(costs_module, "onednn_switchable", lambda target: True)
    monkeypatch.setattr(costs_module, "sample_onednn_off", faulty)
    with onednn_matmuls(True):
        if not torch.backends.mkldnn.enabled:
            pytest.skip("this torch has oneDNN off")
        costs = measure_costs(target, drafter, max_drafts=8, context_length=8, repeats=3, seconds=1e6)
    assert not costs.settled and costs.onednn_from == 0
    assert costs.timed_out == (fault == "cut short")
    assert ("spread" in costs.unsettled_cause()) == (fault == "noisy")


def test_only_bf16_weights_on_a_cpu_with_onednn_bf16_kernels_are_timed_both_ways():
    assert not costs_module.onednn_switchable(tiny_target(dtype=torch.float32))  # fp32: the BLAS either way
    bf16 = tiny_target(dtype=torch.bfloat16)
    expected = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert costs_module.onednn_switchable(bf16) == bool(expected and torch.backends.mkldnn.enabled)


def test_the_ab_plain_arm_decodes_plainly_with_the_policys_kernels():
    target = tiny_target(dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4, dtype=torch.float32)
    view = plain_view(drafter, RoundPolicy(confidence_cut=0.3, onednn_from=4))
    assert not view.round_policy.speculate and view.round_policy.onednn_from == 4


@pytest.mark.parametrize("order", ["first in, first out", "last in, first out"])
def test_threads_that_switch_at_once_leave_the_process_setting_as_it_was(order):
    """torch's switch is process-wide: two threads' blocks that overlap must not leave it off (a plain save and
    restore per block did, when the first to enter left first)."""
    import threading

    with onednn_matmuls(True):
        original = torch.backends.mkldnn.enabled
        entered, leave = [threading.Event() for _ in range(2)], [threading.Event() for _ in range(2)]

        def worker(index: int) -> None:
            if index == 1:
                entered[0].wait()
            with onednn_matmuls(False):
                entered[index].set()
                leave[index].wait()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        entered[1].wait()
        assert not torch.backends.mkldnn.enabled
        first = 0 if order == "first in, first out" else 1
        leave[first].set()
        threads[first].join()
        leave[1 - first].set()
        threads[1 - first].join()
        assert torch.backends.mkldnn.enabled == original


def test_a_calls_hook_switches_only_its_own_threads_forwards():
    import threading

    model = Recorder()
    with onednn_matmuls(True):
        on = torch.backends.mkldnn.enabled
        with onednn_from_width(model, 4):
            thread = threading.Thread(target=lambda: model(input_ids=torch.zeros(1, 1, dtype=torch.long)))
            thread.start()
            thread.join()
            model(input_ids=torch.zeros(1, 1, dtype=torch.long))
    assert model.seen == [(1, on), (1, False)]  # the other thread's one-token forward was not this call's


def test_fixed_bench_policies_run_on_the_kernels_the_call_was_priced_with():
    """The static grid and the shipped constants are compared with the default on the same forwards: their rounds,
    the tuned policy's kernel rule (else a cell would measure torch's default kernels against the default's)."""
    from hf_retrace.bench.methods import ALL_METHODS
    from hf_retrace.generation.policy import resolve_policy

    target = tiny_target(dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4, dtype=torch.float32)
    tuned = RoundPolicy(speculate=False, confidence_cut=0.2, lookup=True, lookup_cap=32, verify_costs=(1.0, 1.2),
                        draft_cost=0.2, onednn_from=4, drafter_onednn=False, source="tuned")
    for name in ("static-0.3-8", "shipped"):
        view = ALL_METHODS[name].drafter_view(drafter)
        policy = resolve_policy(view, target, target.generation_config, resolver=lambda *a, **k: tuned)
        assert policy.speculate and policy.verify_costs is None  # its own rounds, drafting, no guard
        assert (policy.onednn_from, policy.drafter_onednn) == (4, False)
    static = resolve_policy(ALL_METHODS["static-0.3-8"].drafter_view(drafter), target, target.generation_config,
                            resolver=lambda *a, **k: tuned)
    assert (static.confidence_cut, static.lookup_start, static.lookup_cap) == (0.3, 2, 8)


def test_asking_for_onednn_inside_a_block_that_turned_it_off_changes_nothing():
    """``onednn_matmuls(True)`` is a no-op (a round asks for it thousands of times an answer): an enclosing block's
    oneDNN-off stays in force inside it, and the process setting comes back after both."""
    on = torch.backends.mkldnn.enabled
    with onednn_matmuls(False):
        with onednn_matmuls(True):
            assert torch.backends.mkldnn.enabled is False
        assert torch.backends.mkldnn.enabled is False
    assert torch.backends.mkldnn.enabled == on
