"""The round policy tuned to the machine: the replay walks the generator's own rounds, the search follows the cost
curve (flat: long blocks and copies; row-proportional: short blocks; nothing pays: plain), the cache survives bad
files and concurrent writers, every override wins where documented, and plain decoding is plain."""

from __future__ import annotations

import functools
import gzip
import json
import multiprocessing
import random
import statistics

import pytest
import torch
from helpers import tiny_drafter, tiny_target

import hf_retrace
from hf_retrace.generation.policy import LOOKUP_COST, RoundGuard, RoundPolicy, confident_prefix
from hf_retrace.training.calibrate import record_answers, record_round_records
from hf_retrace.tuning import auto
from hf_retrace.tuning.costs import MachineCosts, measure_costs, measure_verify_costs
from hf_retrace.tuning.records import AnswerRecord, RoundRecords
from hf_retrace.tuning.replay import replay, replay_rounds
from hf_retrace.tuning.search import choose_policies

FLAT = MachineCosts(tuple(1.0 + 0.01 * k for k in range(33)), 0.05, 0.05, 0.01)  # a GPU, a CPU with bf16 units
ROWS = MachineCosts(tuple(1.0 + 0.4 * k for k in range(33)), 0.15, 0.3, 0.04)  # AVX2 bf16: cost grows with rows


def _synthetic_answers(seed: int, right: float, loops: bool, n: int = 6, length: int = 120) -> list[AnswerRecord]:
    """Answers whose drafts are right slot by slot with probability ``right`` (more confident when right than when
    wrong); with ``loops``, every answer repeats a 12-token phrase (what context lookup copies)."""
    rng = random.Random(seed)
    answers = []
    for _ in range(n):
        phrase = [rng.randrange(1000, 2000) for _ in range(12)]
        tokens = [rng.randrange(0, 1000) for _ in range(8)]
        while len(tokens) < length:
            tokens += phrase if loops else [rng.randrange(0, 1000) for _ in range(12)]
        tokens = tokens[:length]
        drafts, confidences = [], []
        for p in range(8, length - 1):
            row, conf, ok = [], [], True
            for j in range(7):
                truth = tokens[p + 1 + j] if p + 1 + j < length else 0
                ok = ok and rng.random() < right
                row.append(truth if ok else 3000 + j)
                # confidence tells right from wrong only on average: every cut loses some right slots
                conf.append(rng.uniform(0.02, 1.0) if ok else rng.uniform(0.0, 0.6))
            drafts.append(row)
            confidences.append(conf)
        answers.append(AnswerRecord(tokens, 8, drafts, confidences))
    return answers


def _records(right: float, loops: bool) -> RoundRecords:
    answers = _synthetic_answers(0, right, loops)
    return RoundRecords(block_size=8, greedy=answers, sampled=_synthetic_answers(1, right, loops))


def test_a_flat_cost_curve_picks_full_blocks_and_long_lookup_copies():
    choice = choose_policies(_records(0.8, loops=True), FLAT, RoundPolicy(lookup=True))
    policy = choice["greedy"]
    assert policy.speculate and policy.source == "tuned"
    assert policy.confidence_cut is None or policy.confidence_cut <= 0.1  # (almost) every slot drafted
    assert policy.lookup and policy.lookup_cap >= 16
    assert policy.verify_costs == FLAT.verify_costs and policy.expected_speedup > 2


def test_a_row_proportional_cost_curve_picks_short_blocks():
    choice = choose_policies(_records(0.85, loops=False), ROWS, RoundPolicy())
    flat = choose_policies(_records(0.85, loops=False), FLAT, RoundPolicy())
    short, long = choice["greedy"], flat["greedy"]
    assert short.speculate and short.confidence_cut is not None and short.confidence_cut > 0.1
    # the cut's replayed block is shorter than the flat curve's
    assert replay(_records(0.85, False).greedy, short, 7)["tau"] < replay(_records(0.85, False).greedy, long, 7)["tau"]


def test_where_nothing_pays_the_tuner_decodes_plainly():
    choice = choose_policies(_records(0.05, loops=False), ROWS, RoundPolicy(lookup=True))
    for name in ("greedy", "sampled"):
        assert not choice[name].speculate
        assert "tokens per step-cost" in choice[name].reason


def test_the_replay_counts_rounds_and_costs_as_the_policy_prices_them():
    answers = _synthetic_answers(2, 0.7, loops=False, n=2)
    policy = RoundPolicy(confidence_cut=0.5, verify_costs=(1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5), draft_cost=0.2)
    result = replay(answers, policy, 7, keep_rounds=True)
    cost = sum(policy.round_cost(k, source == "lookup") for source, k, _ in result["round_log"])
    cost += result["plain_steps"]
    assert result["tokens_per_cost"] == pytest.approx(result["tokens"] / cost)
    assert result["tokens"] == sum(len(a.tokens) - 1 - a.start for a in answers)  # every token after the prefill's
    rounds = [([0.9, 0.8, 0.3, 0.9], 2), ([0.5, 0.2, 0.1, 0.1], 0)]
    cut = replay_rounds(rounds, policy)  # 2 slots (3 tokens) + 1 slot (1 token)
    assert cut["tau"] == 2.0 and cut["mean_drafted"] == 1.5
    assert cut["tokens_per_cost"] == pytest.approx(4 / (0.2 + 2.0 + 0.2 + 1.5))


@pytest.mark.parametrize("cut, start, cap, guarded", [(None, 2, 10, False), (0.3, 1, 4, True), (0.6, 3, 6, True)])
def test_replay_and_generate_agree_round_by_round(cut, start, cap, guarded, monkeypatch):
    # the replay has no clock, so it prices every round by the model: here the call's guard does too
    monkeypatch.setattr(RoundGuard, "note_plain", lambda self, seconds: None)
    target = tiny_target(dtype=torch.float32, logit_scale=4.0, seed=4)
    drafter = tiny_drafter(target, block_size=6, dtype=torch.float32, seed=5)
    costs = (1.0, 1.6, 2.2, 2.8, 3.4, 4.0) if guarded else None  # expensive verifies: the guard backs off at times
    policy = RoundPolicy(confidence_cut=cut, lookup=True, lookup_min_ngram=1, lookup_start=start, lookup_cap=cap,
                         verify_costs=costs, draft_cost=0.3 if guarded else None)
    prompt = torch.tensor([[7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 30, 31, 7]])
    target.generation_config.eos_token_id = None  # the answer runs to max_new_tokens: no end-of-text cut
    view = drafter.with_policy(policy)
    out = target.generate(prompt, assistant_model=view, max_new_tokens=48, do_sample=False)
    stats = view.last_stats
    # lossless through the guard's back-offs too (rounds with no drafter forward, held context rows): plain's tokens
    assert torch.equal(out, target.generate(prompt, max_new_tokens=48, do_sample=False))
    generated = list(zip(stats.round_sources, stats.draft_lengths, [a - 1 for a in stats.acceptance_lengths]))
    assert {source for source, _, _ in generated} == {"drafter", "lookup"}, "both sources must be exercised"
    loss_mask = torch.zeros_like(out[0])
    loss_mask[prompt.shape[1] :] = 1
    records = record_answers(target, drafter, [{"input_ids": out[0], "loss_mask": loss_mask}])
    walked = replay(records, policy, drafter.config.block_size - 1, keep_rounds=True)
    assert walked["round_log"] == generated
    assert walked["tokens"] == out.shape[1] - prompt.shape[1] - 1  # every token after the prefill's
    if guarded:
        assert walked["plain_steps"] > 1 and stats.guard_plain_steps == walked["plain_steps"] - 1  # (the last: no room)


def test_the_guard_backs_off_below_plain_and_drafts_again_after_its_period():
    policy = RoundPolicy(verify_costs=(1.0, 1.2, 1.4), draft_cost=0.5)
    guard = RoundGuard(policy, window=4, first_backoff=4)
    for p in range(4):  # 4 rounds of 2 drafts, none accepted: 1 token per 1.9 steps
        assert guard.drafts_at(p)
        guard.record(p, 2, 0, False)
    assert [guard.drafts_at(p) for p in range(4, 10)] == [False] * 4 + [True, True]
    for p in range(8, 12):  # bad again: the period doubles
        guard.record(p, 2, 0, False)
    assert not guard.drafts_at(12 + 7) and guard.drafts_at(12 + 8) and guard.backoff == 16
    for p in range(20, 24):  # 2 drafts, both accepted: 3 tokens per 1.9 steps, above plain: the period resets
        guard.record(p, 2, 2, False)
    assert guard.backoff == 4 and guard.drafts_at(24)


def test_the_guard_beyond_its_noise_waits_out_a_bursty_window_but_not_steady_losses():
    policy = RoundPolicy(verify_costs=(1.0, 1.2, 1.4, 1.6, 1.8, 2.0), draft_cost=0.4)  # 5 drafts: 2.4 steps
    def bursty(guard):  # 5 drafts, all accepted or none, in turn: 6 or 1 tokens per 2.4 steps (7 per 4.8: pays)
        for p in range(16):
            guard.record(p, 5, 5 if p % 2 == 0 else 0, False)
        for p in (16, 17, 18):  # then misses: a window of 8 with 2 bursts in it, 18 tokens per 19.2 steps, below
            guard.record(p, 5, 0, False)  # plain by less than the call's spread of a round allows for
        return guard
    window_rule, beyond_noise = bursty(RoundGuard(policy, noise_z=0.0)), bursty(RoundGuard(policy, noise_z=1.0))
    assert not window_rule.drafts_at(19) and beyond_noise.drafts_at(19)
    excess = [6 - 2.4 if p % 2 == 0 else 1 - 2.4 for p in range(16)] + [1 - 2.4] * 3
    assert beyond_noise.excess_sd == pytest.approx(statistics.stdev(excess))
    steady = RoundGuard(policy, window=4, noise_z=1.0)
    for p in range(4):  # every draft wrong: 1 token per 2.4 steps, no spread, so no allowance: backs off at once
        steady.record(p, 5, 0, False)
    assert steady.excess_sd == pytest.approx(0.0) and not steady.drafts_at(4)
    one = RoundGuard(policy, noise_z=1.0)
    one.record(0, 5, 5, False)
    assert one.excess_sd == 0.0  # one round has no spread


def test_only_a_window_that_pays_resets_the_guards_back_off_period():
    policy = RoundPolicy(verify_costs=(1.0, 1.2, 1.4, 1.6, 1.8, 2.0), draft_cost=0.4)  # 5 drafts: 2.4 steps
    guard = RoundGuard(policy, window=4, noise_z=1.0)
    for p in range(4):  # every draft wrong, no spread: backs off, the next period doubles
        guard.record(p, 5, 0, False)
    assert not guard.drafts_at(4) and guard.backoff == 8
    for p, accepted in zip(range(8, 12), (5, 0, 0, 0)):  # 9 tokens per 9.6 steps: below plain, within the noise
        guard.record(p, 5, accepted, False)
    assert guard.drafts_at(12) and guard.backoff == 8  # neither a back-off nor a reset
    guard.record(12, 5, 5, False)  # the window 1, 1, 1, 6: 9 tokens per 9.6 steps again
    assert guard.backoff == 8
    guard.record(13, 5, 5, False)  # 1, 1, 6, 6: 14 tokens per 9.6 steps, pays
    assert guard.backoff == guard.first_backoff


def test_the_guard_prices_rounds_by_the_calls_clock_once_it_has_timed_plain_steps():
    policy = RoundPolicy(verify_costs=(1.0, 1.2, 1.4), draft_cost=0.5)  # 2 drafts: 1.9 steps by the model
    guard = RoundGuard(policy, window=4, first_backoff=4, clock_after=3)
    for seconds in (0.030, 0.029):
        guard.note_plain(seconds)
    for p in range(4):  # 1 token a round, 20 ms: two plain steps timed are not enough, the model decides: back off
        guard.record(p, 2, 0, False, seconds=0.020)
    assert not guard.drafts_at(4) and guard.clocked_rounds == 0
    guard.note_plain(0.031)  # the third: the median plain step is 30 ms
    assert guard.step_seconds == pytest.approx(0.030)
    for p in range(8, 12):  # the same rounds, now priced by the clock: 1 token per 2/3 of a step pays
        guard.record(p, 2, 0, False, seconds=0.020)
    assert guard.drafts_at(12) and guard.backoff == 4 and guard.clocked_rounds == 4
    for p in range(12, 16):  # 3 tokens a round, which the model prices at 1.9 steps, but 120 ms each: 4 steps
        guard.record(p, 2, 2, False, seconds=0.120)
    assert not guard.drafts_at(16)
    for p in range(20, 24):  # a round without its time is priced by the model (3 tokens per 1.9 steps: pays)
        guard.record(p, 2, 2, False)
    assert guard.backoff == 4 and guard.clocked_rounds == 8


def test_the_guard_keeps_the_calls_latest_plain_steps():
    guard = RoundGuard(RoundPolicy(verify_costs=(1.0, 1.2)), clock_after=3, plain_kept=4)
    for seconds in (1.0, 1.0, 1.0, 1.0, 0.02, 0.03, 0.04, 0.0):  # a slow start forgotten; a zero is no timing
        guard.note_plain(seconds)
    assert guard.plain_seconds == [1.0, 0.02, 0.03, 0.04] and guard.step_seconds == pytest.approx(0.035)
    one = RoundGuard(RoundPolicy(verify_costs=(1.0, 1.2)), clock_after=1, plain_kept=1)
    for seconds in (0.5, 0.03):
        one.note_plain(seconds)
    assert one.plain_seconds == [0.03] and one.step_seconds == pytest.approx(0.03)


def test_a_guarded_call_gives_its_guard_every_steps_wall_time(monkeypatch):
    plain_times, round_times = [], []
    note_plain, record = RoundGuard.note_plain, RoundGuard.record
    monkeypatch.setattr(RoundGuard, "note_plain", lambda self, seconds: plain_times.append(seconds) or note_plain(
        self, seconds))
    monkeypatch.setattr(RoundGuard, "record", lambda self, *args: round_times.append(args[-1]) or record(self, *args))
    target = tiny_target(dtype=torch.float32, logit_scale=4.0, seed=4)
    drafter = tiny_drafter(target, block_size=6, dtype=torch.float32, seed=5)
    # verifies the model prices far above their cost: the guard backs off at the first window, timing plain steps
    policy = RoundPolicy(confidence_cut=None, lookup=False, verify_costs=(1.0, 40.0, 40.0, 40.0, 40.0, 40.0),
                         draft_cost=0.3)
    prompt = torch.tensor([[7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 30, 31, 7]])
    target.generation_config.eos_token_id = None
    view = drafter.with_policy(policy)
    out = target.generate(prompt, assistant_model=view, max_new_tokens=64, do_sample=False)
    stats = view.last_stats
    assert torch.equal(out, target.generate(prompt, max_new_tokens=64, do_sample=False))
    # every plain step after the prefill is timed (the guard's, and the last, with no room to draft); every round too
    assert len(plain_times) == stats.guard_plain_steps + 1 and all(t > 0 for t in plain_times)
    assert len(round_times) == stats.rounds and all(t is not None and t > 0 for t in round_times)
    assert stats.guard_plain_steps >= 4 and stats.guard_clocked_rounds > 0  # priced by the clock after the back-off


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_RETRACE_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_RETRACE_POLICY", "auto")
    auto._MEMO.clear()
    auto._RETRY.clear()
    yield tmp_path
    auto._MEMO.clear()
    auto._RETRY.clear()


def _fake_tune(calls: list):
    def tune(target, drafter, records=None, rows=1):
        calls.append(1)
        policy = RoundPolicy(confidence_cut=0.4, lookup=True, lookup_cap=7, source="tuned")
        return {"policies": {"greedy": policy.to_dict(), "sampled": policy.replace(lookup=False).to_dict()},
                "costs": FLAT.to_dict(), "tables": {}, "seconds": 0.0}
    return tune


def test_the_tuned_policy_is_cached_and_read_back_by_a_later_process(cache_dir, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(auto, "tune", _fake_tune(calls))
    target = tiny_target(dtype=torch.float32)
    drafter = tiny_drafter(target, dtype=torch.float32)
    greedy = auto.auto_policy(drafter, target, target.generation_config)
    assert calls == [1] and greedy.lookup_cap == 7 and "tuning the round policy" in capsys.readouterr().err
    (path,) = (cache_dir / "policies").glob("*.json")
    auto._MEMO.clear()  # a new process: only the file remains
    sampled_config = target.generation_config.__class__(do_sample=True)
    assert auto.auto_policy(drafter, target, sampled_config).lookup is False
    assert auto.auto_policy(drafter, target, target.generation_config) == greedy and calls == [1]
    # another thread count is another machine: tuned again, in another file
    auto._MEMO.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        auto.auto_policy(drafter, target, target.generation_config)
    finally:
        torch.set_num_threads(threads)
    assert calls == [1, 1] and len(list((cache_dir / "policies").glob("*.json"))) == 2
    assert json.loads(path.read_text())["key"]["threads"] == threads


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong key", "unknown field"])
def test_a_bad_cache_file_is_measured_again_never_fatal(cache_dir, monkeypatch, capsys, damage):
    calls: list = []
    monkeypatch.setattr(auto, "tune", _fake_tune(calls))
    target = tiny_target(dtype=torch.float32)
    drafter = tiny_drafter(target, dtype=torch.float32)
    auto.auto_policy(drafter, target, target.generation_config)
    (path,) = (cache_dir / "policies").glob("*.json")
    data = json.loads(path.read_text())
    if damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif damage == "truncated":
        path.write_text(path.read_text()[:40])
    elif damage == "wrong key":
        data["key"]["torch"] = "0.0"
        path.write_text(json.dumps(data))
    else:
        data["policies"]["greedy"]["warp_speed"] = 9
        path.write_text(json.dumps(data))
    auto._MEMO.clear()
    assert auto.auto_policy(drafter, target, target.generation_config).lookup_cap == 7
    assert calls == [1, 1]
    assert json.loads(path.read_text())["policies"]["greedy"]["lookup_cap"] == 7  # rewritten whole


def _write_many(path: str, tag: int) -> None:
    from pathlib import Path

    for i in range(200):
        auto.write_atomically(Path(path), {"writer": tag, "i": i, "pad": "x" * 20000})


def test_two_concurrent_writers_leave_one_valid_file(tmp_path):
    path = tmp_path / "policies" / "same.json"
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_many, args=(str(path), tag)) for tag in (1, 2)]
    for w in writers:
        w.start()
    seen = set()
    while any(w.is_alive() for w in writers):
        if path.exists():
            seen.add(json.loads(path.read_text())["writer"])  # never a partial file
    for w in writers:
        w.join()
        assert w.exitcode == 0
    final = json.loads(path.read_text())
    assert final["writer"] in (1, 2) and final["i"] == 199 and not list(path.parent.glob(".*.tmp"))


def test_every_override_wins_where_documented(cache_dir, monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setattr(auto, "tune", _fake_tune(calls))
    target = tiny_target(dtype=torch.float32)
    drafter = tiny_drafter(target, dtype=torch.float32)
    drafter.config.draft_confidence_threshold = 0.55
    config = target.generation_config
    resolve = functools.partial(hf_retrace.generation.policy.resolve_policy, resolver=auto.auto_policy)
    assert resolve(drafter, target, config).lookup_cap == 7  # auto: tuned
    monkeypatch.setenv("HF_RETRACE_POLICY", "shipped")
    assert resolve(drafter, target, config).confidence_cut == 0.55
    monkeypatch.setenv("HF_RETRACE_POLICY", "off")
    assert not resolve(drafter, target, config).speculate
    policy_file = tmp_path / "p.json"
    policy_file.write_text(json.dumps(RoundPolicy(confidence_cut=0.25).to_dict()))
    monkeypatch.setenv("HF_RETRACE_POLICY", str(policy_file))
    assert resolve(drafter, target, config).confidence_cut == 0.25
    assert resolve(drafter.with_policy(lookup_cap=3), target, config).lookup_cap == 3  # changes on top of the env's
    explicit = RoundPolicy(confidence_cut=0.9)
    assert resolve(drafter.with_policy(explicit), target, config) is explicit  # a view's own policy beats everything
    monkeypatch.setenv("HF_RETRACE_POLICY", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="expected auto, shipped, off"):
        resolve(drafter, target, config)
    assert drafter.config.draft_confidence_threshold == 0.55 and calls == [1]  # nothing shared was changed


@pytest.mark.parametrize("do_sample", [False, True])
def test_the_plain_policy_is_plain_generate_and_runs_no_drafter_forward(monkeypatch, do_sample):
    target = tiny_target(dtype=torch.float32, logit_scale=4.0, seed=4)
    drafter = tiny_drafter(target, block_size=6, dtype=torch.float32, seed=5)
    forwards = []
    original = type(drafter).forward
    monkeypatch.setattr(type(drafter), "forward", lambda self, *a, **k: forwards.append(1) or original(self, *a, **k))
    prompt = torch.tensor([[7, 8, 9, 10, 11, 12]])
    kwargs = dict(max_new_tokens=24, do_sample=do_sample, return_dict_in_generate=True, output_scores=True)
    torch.manual_seed(0)
    plain = target.generate(prompt, **kwargs)
    view = drafter.with_policy(RoundPolicy(speculate=False, reason="tested"))
    torch.manual_seed(0)
    ours = target.generate(prompt, assistant_model=view, **kwargs)
    assert torch.equal(plain.sequences, ours.sequences) and not forwards
    assert all(torch.equal(a, b) for a, b in zip(plain.scores, ours.scores))
    assert view.last_stats.rounds == 0 and view.last_stats.policy.startswith("plain decoding") and "tested" in view.last_stats.policy
    forwards.clear()
    target.generate(prompt, assistant_model=drafter.with_policy(RoundPolicy()), max_new_tokens=8)
    assert forwards  # the counter sees a drafting call


def test_measured_costs_are_relative_and_never_fall_with_more_drafts():
    target = tiny_target(dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4, dtype=torch.float32)
    verify = measure_verify_costs(target, 5, context_length=8, repeats=1)
    assert len(verify) == 6 and verify[0] == 1 and all(b >= a for a, b in zip(verify, verify[1:]))
    costs = measure_costs(target, drafter, max_drafts=6, context_length=8, repeats=1)
    assert len(costs.verify_costs) == 7 and costs.draft_cost_chunk > 0 and costs.draft_cost_full > 0


def test_in_the_accelerator_order_a_lookup_round_pays_the_drafters_whole_block():
    """On an accelerator the drafter's block is launched before the lookup decision (one transfer per round): the cost
    model prices every round with the whole block, and a lookup round with it too; on the CPU, as before."""
    cpu = MachineCosts(ROWS.verify_costs, 0.15, 0.3, 0.04)
    accelerator = MachineCosts(ROWS.verify_costs, 0.15, 0.3, 0.04, drafter_first=True)
    base = RoundPolicy(confidence_cut=0.5, lookup=True)
    on_cpu, on_device = cpu.arm(base), accelerator.arm(base)
    assert (on_cpu.draft_cost, on_cpu.lookup_cost) == (0.15, LOOKUP_COST)
    assert (on_device.draft_cost, on_device.lookup_cost) == (0.3, LOOKUP_COST + 0.3)
    assert on_device.round_cost(3, from_lookup=True) == pytest.approx(LOOKUP_COST + 0.3 + ROWS.verify_costs[3])
    sampled = accelerator.arm(base, proposal_mode="sample")  # a processor per slot: the CPU order on every device
    assert (sampled.draft_cost, sampled.lookup_cost) == (0.15, LOOKUP_COST)
    assert MachineCosts.from_dict(accelerator.to_dict()).drafter_first  # the cache keeps it
    assert not MachineCosts.from_dict({k: v for k, v in accelerator.to_dict().items() if k != "drafter_first"}
                                      ).drafter_first  # a cache written before: the CPU order
    # the choice follows: with lookup rounds priced higher, the accelerator replay gains less than the CPU's from them
    records = _records(0.8, loops=True)
    gain = {name: replay(records.greedy, costs.arm(base), 7)["tokens_per_cost"]
            for name, costs in (("cpu", cpu), ("accelerator", accelerator))}
    assert gain["accelerator"] < gain["cpu"]


def test_measured_costs_say_which_round_order_the_drafters_device_runs(monkeypatch):
    from hf_retrace.tuning import costs as costs_module

    target = tiny_target(dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4, dtype=torch.float32)
    assert not measure_costs(target, drafter, max_drafts=4, context_length=8, repeats=1).drafter_first  # the CPU
    monkeypatch.setattr(costs_module, "on_accelerator", lambda device: True)
    assert measure_costs(target, drafter, max_drafts=4, context_length=8, repeats=1).drafter_first


def test_recorded_rounds_round_trip_and_replay_the_generators_cut(tmp_path):
    target = tiny_target(dtype=torch.float32, logit_scale=4.0)
    drafter = tiny_drafter(target, block_size=6, dtype=torch.float32)
    records = record_round_records(target, drafter, [[5, 9, 14, 2, 7, 7, 30], [11, 12, 13, 40, 2]], max_new_tokens=16,
                                   progress=False)
    assert len(records.greedy) == 2 and len(records.sampled) == 2 and records.sample_rounds
    assert all(1 <= len(conf) <= 5 and 0 <= acc <= len(conf) for conf, acc in records.sample_rounds)
    assert max(len(conf) for conf, _ in records.sample_rounds) == 5  # full blocks (shorter only at the end)
    path = records.save(tmp_path)
    loaded = RoundRecords.load(tmp_path)
    assert loaded.greedy[0].tokens == records.greedy[0].tokens and loaded.sample_rounds[0][1] == records.sample_rounds[0][1]
    assert path.stat().st_size < 50_000
    path.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="hf-retrace calibrate"):
        RoundRecords.load(tmp_path)
    # greedy output never depends on the cut: a cut replayed on full-block confidences is the generator's cut
    full = drafter.with_policy(RoundPolicy(confidence_cut=0.0))
    prompt = torch.tensor([[5, 9, 14, 2, 7, 7, 30]])
    target.generate(prompt, assistant_model=full, max_new_tokens=16, do_sample=False)
    first = full.last_stats.slot_confidences[0]
    threshold = min(first[2] + 1e-6, 0.999)
    cut = drafter.with_policy(RoundPolicy(confidence_cut=threshold))
    target.generate(prompt, assistant_model=cut, max_new_tokens=16, do_sample=False)
    assert len(cut.last_stats.slot_confidences[0]) == confident_prefix(first, threshold) <= 2


def test_the_replay_by_kind_splits_the_recorded_prompts_as_they_alternate(tmp_path, capsys):
    """examples/replay_by_kind.py: the kinds alternate in the records, so kind k is every 6th answer from k; a kind
    whose drafts are always right predicts more than one whose drafts never are."""
    import importlib.util
    from pathlib import Path

    from hf_retrace.tuning.replay import replay

    examples = Path(__file__).resolve().parents[1] / "examples"
    spec = importlib.util.spec_from_file_location("replay_by_kind", examples / "replay_by_kind.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    right, wrong = _synthetic_answers(2, 1.0, False, n=2), _synthetic_answers(3, 0.0, False, n=10)
    answers = [right[0], *wrong[:5], right[1], *wrong[5:]]  # kind 0 always right, kinds 1-5 never
    RoundRecords(block_size=8, greedy=answers).save(tmp_path)
    policy = FLAT.arm(RoundPolicy(confidence_cut=None, lookup=False))  # full blocks, this test's flat costs
    (tmp_path / "policy.json").write_text(json.dumps({"policies": {"greedy": policy.to_dict()}}))
    assert module.main(["--policy", str(tmp_path / "policy.json"), "--drafter", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and "---" not in line]
    figures = {row[0].strip("| "): float(row[2]) for row in rows[1:]}
    assert figures["GSM8K train"] == pytest.approx(replay(right, policy, 7)["tokens_per_cost"], abs=0.005)
    assert figures["GSM8K train"] > 2 > figures["MATH train"] == figures["second turns"]
    assert [int(row[1]) for row in rows[1:]] == [12, 2, 2, 2, 2, 2, 2]


def test_the_replay_error_sets_each_bench_row_beside_its_own_rounds_priced_by_the_tuner(tmp_path, capsys):
    """examples/replay_error.py: each row's policy is its method's own view over the tuned choice (the default is the
    tuner's own replay, its guard included; dflash the same without lookup), a static cell runs without the guard but
    is priced with the same costs, measured verify seconds read in the tuner's one-token steps,
    rows it cannot model are left out, and recorded benchmark answers are never written beside a model."""
    import importlib.util
    from pathlib import Path

    from hf_retrace.defaults import default_drafter_path

    examples = Path(__file__).resolve().parents[1] / "examples"
    spec = importlib.util.spec_from_file_location("replay_error", examples / "replay_error.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    answers = _synthetic_answers(4, 0.0, False, n=4)  # every draft wrong: where drafting loses, the guard backs off
    answers_file = tmp_path / "answers.json.gz"
    with gzip.open(answers_file, "wt") as f:
        json.dump({"gsm8k": [a.to_dict() for a in answers]}, f)
    policy = ROWS.arm(RoundPolicy(confidence_cut=0.5, lookup=True, lookup_start=4, lookup_cap=32))
    entry = tmp_path / "entry.json"
    entry.write_text(json.dumps({"policies": {"greedy": policy.to_dict()}, "costs": {"step_seconds": 0.02}}))
    drafted = {"rounds": 100, "tau_per_round": 1.2, "mean_draft_length": 3.0, "guard_plain_steps": 7,
               "verify_seconds": 4.0, "decode_seconds_per_token": 0.025}
    bench = {"results": {"gsm8k": {"plain-no-onednn": {"T=0": {"decode_seconds_per_token": 0.02}},
                                   "default": {"T=0": drafted}, "static-0.5-8": {"T=0": drafted},
                                   "dflash": {"T=0": drafted}, "retrace": {"T=0": drafted},
                                   "prompt-lookup": {"T=0": drafted}}}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    argv = ["--bench", str(tmp_path / "bench.json"), "--policy", str(entry), "--answers", str(answers_file),
            "--drafter", str(default_drafter_path())]
    assert module.main(argv) == 0
    rows = {row[1]: row for row in (line.split(" | ") for line in capsys.readouterr().out.splitlines()
                                    if line.startswith("| gsm8k"))}
    assert sorted(rows) == ["default", "dflash", "static-0.5-8"]  # ReTrace and transformers' lookup: not replayable
    guarded = replay(answers, policy, 7)
    assert guarded["plain_steps"] > 0
    assert float(rows["default"][6]) == pytest.approx(guarded["tokens_per_cost"], abs=0.005)
    assert rows["default"][4] == f"{guarded['plain_steps']} / 7"
    static = policy.replace(lookup_start=2, lookup_cap=8, verify_costs=None)  # the cell's knobs, as it runs: no guard
    assert rows["static-0.5-8"][4] == f"{replay(answers, static, 7)['plain_steps']} / 7"
    assert int(rows["static-0.5-8"][4].split()[0]) < guarded["plain_steps"]
    assert float(rows["static-0.5-8"][6]) < float(rows["default"][6])  # unguarded, every wrong draft is paid for
    alone = policy.replace(lookup=False)  # dflash: the tuned cut and guard, no lookup (the method's own view)
    assert float(rows["dflash"][6]) == pytest.approx(replay(answers, alone, 7)["tokens_per_cost"], abs=0.005)
    assert rows["default"][5].split(" / ")[1].startswith("2.00 (")  # 4 s over 100 rounds, in steps of 20 ms
    assert float(rows["default"][7].strip("| ")) == pytest.approx(0.8)  # 20 ms plain over 25 ms a token
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="outside any model or drafter folder"):
        module.main(["--bench", str(tmp_path / "bench.json"), "--policy", str(entry), "--answers",
                     str(tmp_path / "new.json.gz")])


def test_the_width_cap_replay_caps_every_round_and_refuses_a_batch_1_entry(tmp_path, capsys):
    """examples/replay_width_cap.py: each row is the lockstep replay of the entry's knobs with every round's drafts
    (the drafter's and a lookup copy) capped, at the entry's rows and row share; a batch-1 entry is refused."""
    import dataclasses
    import importlib.util
    from pathlib import Path

    from hf_retrace.tuning.replay import replay

    examples = Path(__file__).resolve().parents[1] / "examples"
    spec = importlib.util.spec_from_file_location("replay_width_cap", examples / "replay_width_cap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _records(0.9, loops=True).save(tmp_path)
    costs = dataclasses.replace(ROWS, rows=4, row_share=0.5)
    policy = costs.arm(RoundPolicy(confidence_cut=None, lookup=True, lookup_start=3, lookup_cap=16))
    entry = {"costs": costs.to_dict(), "policies": {"greedy": policy.replace(speculate=False).to_dict()}}
    (tmp_path / "entry.json").write_text(json.dumps(entry))
    assert module.main(["--policy", str(tmp_path / "entry.json"), "--drafter", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and "---" not in line][1:]
    figures = {int(row[0].strip("| ")): (float(row[1]), float(row[2].strip(" |"))) for row in rows}
    assert sorted(figures) == sorted(module.CAPS)
    answers = _records(0.9, loops=True).greedy
    capped = policy.replace(lookup_cap=2, lookup_start=2)
    expected = replay(answers, capped, 2, rows=4, row_share=0.5)
    assert figures[2][0] == pytest.approx(expected["tokens_per_cost"], abs=5e-4)
    assert figures[2][1] == pytest.approx(expected["tau"], abs=5e-3)
    assert figures[2][1] < figures[7][1] and figures[2][1] <= 3  # at most 2 drafts and the bonus a round
    (tmp_path / "one.json").write_text(json.dumps({**entry, "costs": ROWS.to_dict()}))
    with pytest.raises(SystemExit, match="tuned at batch size 1"):
        module.main(["--policy", str(tmp_path / "one.json"), "--drafter", str(tmp_path)])


def test_the_two_backend_replay_prices_each_forward_at_the_cheaper_curve(tmp_path, capsys):
    """examples/replay_two_backends.py: both curves in steps of the faster one-token step, per forward the cheaper;
    replayed on the shipped drafter's recorded rounds, the cheaper curve never predicts less than either alone, and a
    curve whose one-token step is the slower reads plain decoding below 1."""
    import importlib.util
    from pathlib import Path

    examples = Path(__file__).resolve().parents[1] / "examples"
    spec = importlib.util.spec_from_file_location("replay_two_backends", examples / "replay_two_backends.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    on = {**FLAT.to_dict(), "step_seconds": 0.040}  # a flat curve at a slow step (oneDNN on a CPU with bf16 units)
    off = {**ROWS.to_dict(), "step_seconds": 0.025}  # a steep one at a fast step (torch's own kernels)
    mixed = module.cheaper_per_forward(on, off)
    assert mixed["step_seconds"] == 0.025
    assert mixed["verify_costs"][0] == pytest.approx(1.0)  # the one-token step: off's, the faster
    assert mixed["verify_costs"][32] == pytest.approx((1.0 + 0.01 * 32) * 0.040 / 0.025)  # many tokens: on's
    assert mixed["verify_costs"][1] == pytest.approx(min(1.01 * 1.6, 1.4))
    assert mixed["draft_cost_chunk"] == pytest.approx(min(0.05 * 1.6, 0.15))
    for name, costs in (("on", on), ("off", off)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"costs": costs}))
    assert module.main(["--on", str(tmp_path / "on.json"), "--off", str(tmp_path / "off.json")]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "---" not in line][1:]
    plain = {row[0].strip("| "): float(row[1]) for row in rows}
    greedy = {row[0].strip("| "): float(row[5]) for row in rows}
    assert plain == {"oneDNN on (torch's default)": pytest.approx(0.625, abs=0.006), "oneDNN off or capped": 1.0,
                     "per forward the cheaper": 1.0}
    cheaper = greedy.pop("per forward the cheaper")
    assert cheaper >= max(greedy.values()) - 0.005
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="two `hf-retrace tune --json` files"):
        module.main(["--on", str(tmp_path / "bad.json"), "--off", str(tmp_path / "off.json")])
