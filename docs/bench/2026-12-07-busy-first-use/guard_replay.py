"""Replay: the guard unpriced (margin 0) vs priced (backs off where the window's figure x price < 1), both scored at
the price (drafting rounds' step-costs / price, plain positions at 1). python guard_priced.py ENTRY.json"""
import json, sys
from hf_retrace.loading import load_drafter
from hf_retrace.tuning.auto import records_of
from hf_retrace.tuning.costs import MachineCosts
from hf_retrace.tuning.replay import replay
from hf_retrace.generation import policy as pol
from hf_retrace.generation.policy import RoundPolicy, shipped_policy

entry = json.load(open(sys.argv[1]))
costs = MachineCosts.from_dict(entry["costs"])
price = costs.price or float(sys.argv[2])
drafter = load_drafter(None)
records = records_of(drafter)
base = shipped_policy(drafter.config)
cands = {"T0 choice": (RoundPolicy.from_dict(entry["policies"]["greedy"]).replace(speculate=True), records.greedy),
         "T0 shipped": (costs.arm(base), records.greedy),
         "T1 shipped": (costs.arm(base), records.sampled),
         "T1 best row": (RoundPolicy.from_dict(entry["policies"]["sampled"]).replace(speculate=True), records.sampled)}
orig = pol.RoundGuard.__init__
for name, (p, answers) in cands.items():
    out = []
    for margin in (0.0, 1 - 1 / price):
        def init(self, policy, window=8, margin_=margin, **k):
            orig(self, policy, window=window, margin=margin_, **k)
        pol.RoundGuard.__init__ = init
        r = replay(answers, p, max_drafts=records.block_size - 1, keep_rounds=True)
        cost = sum(p.round_cost(d, s == "lookup") for s, d, a in r["round_log"]) / price + r["plain_steps"]
        out.append((margin, r["tokens_per_cost"], r["tokens"] / cost, r["plain_steps"] / r["tokens"]))
    pol.RoundGuard.__init__ = orig
    print(name, p.describe()[:60], " | ".join(f"margin {m:+.2f}: replay {f:.3f}, at the price {g:.3f}, plain share {s:.1%}" for m, f, g, s in out))
