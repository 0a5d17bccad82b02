"""Replay the tuned T=0 policy on the recorded rounds with the guard and without it (the same costs)."""
import json, sys
from hf_retrace.loading import load_drafter
from hf_retrace.tuning.auto import records_of
from hf_retrace.tuning.replay import replay
from hf_retrace.generation.policy import RoundPolicy
entry = json.load(open(sys.argv[1]))
drafter = load_drafter(None); records = records_of(drafter)
p = RoundPolicy.from_dict(entry["policies"]["greedy"]).replace(speculate=True)
for name, answers in (("T=0 records", records.greedy), ("T=1 records", records.sampled)):
    on = replay(answers, p, max_drafts=records.block_size - 1)
    orig = RoundPolicy.guard
    RoundPolicy.guard = lambda self, rows=1: None
    off = replay(answers, p, max_drafts=records.block_size - 1)
    RoundPolicy.guard = orig
    print(name, p.describe()[:50], f"guard on {on['tokens_per_cost']:.3f} (plain share {on['plain_steps']/on['tokens']:.1%}), off {off['tokens_per_cost']:.3f}")
