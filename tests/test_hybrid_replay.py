"""The hybrid's offline replay walks an answer exactly as the generator's rounds went: same source, same number of
drafts, same acceptance, round after round, on a real ``generate`` with a tiny random pair."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_drafter, tiny_target
from hf_retrace.training.hybrid_replay import AnswerRecord, record_answers, replay_hybrid


@pytest.mark.parametrize("threshold, start, cap", [(None, 2, 10), (0.3, 1, 4), (0.6, 3, 6)])
def test_replay_walks_the_rounds_generate_made(threshold, start, cap):
    target = tiny_target(dtype=torch.float32, logit_scale=4.0, seed=4)
    drafter = tiny_drafter(target, block_size=6, dtype=torch.float32, seed=5)
    config = drafter.config
    config.draft_confidence_threshold, config.lookup, config.lookup_min_ngram = threshold, True, 1
    config.lookup_start_tokens, config.lookup_num_tokens = start, cap
    prompt = torch.tensor([[7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 30, 31, 7]])
    target.generation_config.eos_token_id = None  # the answer runs to max_new_tokens: no end-of-text cut
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=48, do_sample=False)
    stats = drafter.last_stats
    generated = list(zip(stats.round_sources, stats.draft_lengths, [a - 1 for a in stats.acceptance_lengths]))
    assert {source for source, _, _ in generated} == {"drafter", "lookup"}, "both sources must be exercised"

    loss_mask = torch.zeros_like(out[0])
    loss_mask[prompt.shape[1] :] = 1
    records = record_answers(target, drafter, [{"input_ids": out[0], "loss_mask": loss_mask}])
    replay = replay_hybrid(records, threshold=threshold, max_drafts=config.block_size - 1, draft_cost=0.1,
                           verify_costs=[1.0, 1.1, 1.2], min_ngram=1, max_ngram=config.lookup_max_ngram,
                           start_tokens=start, num_tokens=cap, keep_rounds=True)
    assert replay["round_log"] == generated
    assert replay["tokens"] == out.shape[1] - prompt.shape[1] - 1  # every token after the prefill's


def test_replay_costs_and_lookup_off():
    target = tiny_target(dtype=torch.float32, logit_scale=4.0, seed=4)
    drafter = tiny_drafter(target, block_size=4, dtype=torch.float32, seed=5)
    ids = torch.tensor([1, 2, 3] * 8)
    mask = (torch.arange(24) >= 4).long()
    (record,) = record_answers(target, drafter, [{"input_ids": ids, "loss_mask": mask}])
    assert record.start == 4 and len(record.drafts) == len(ids) - 1 - 4 and len(record.drafts[0]) == 3
    off = replay_hybrid([record], threshold=None, max_drafts=3, draft_cost=0.5, verify_costs=[1.0, 2.0, 3.0, 4.0],
                        lookup=False, keep_rounds=True)
    assert off["lookup_share"] == 0 and all(source == "drafter" for source, _, _ in off["round_log"])
    drafted = sum(k for _, k, _ in off["round_log"])
    plain_steps = off["tokens"] - sum(a + 1 for _, _, a in off["round_log"])
    expected_cost = off["rounds"] * 0.5 + sum(1.0 + k for _, k, _ in off["round_log"]) + plain_steps
    assert off["tokens_per_cost"] == pytest.approx(off["tokens"] / expected_cost) and drafted > 0
    # the loop "1 2 3" is in the prompt: lookup proposes it from the first round and it is always right
    on = replay_hybrid([record], threshold=None, max_drafts=3, draft_cost=0.5, verify_costs=[1.0, 2.0, 3.0, 4.0],
                       min_ngram=1, start_tokens=1, num_tokens=4, keep_rounds=True)
    assert on["round_log"][0] == ("lookup", 1, 1) and on["round_log"][1] == ("lookup", 2, 2)
    assert on["round_log"][2] == ("lookup", 4, 4)  # doubled, then capped at 4
    # 3 lookup rounds (1 + 2 + 4 drafts, all right: 10 tokens) cost 3 x 0.01 + 2.0 + 3.0 + 5.0 (past the costs' end)
    short = AnswerRecord(record.tokens[:15], 4, record.drafts[:10], record.confidences[:10])
    first = replay_hybrid([short], threshold=None, max_drafts=3, draft_cost=0.5, verify_costs=[1.0, 2.0, 3.0, 4.0],
                          min_ngram=1, start_tokens=1, num_tokens=4)
    assert (first["rounds"], first["tokens"]) == (3, 10)
    assert first["tokens_per_cost"] == pytest.approx(10 / 10.03)
