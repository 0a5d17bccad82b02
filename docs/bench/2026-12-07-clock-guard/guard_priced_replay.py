"""Replay the tuned T=0 policy with its guard deciding on the model's costs, on costs scaled to what the bench
measured (verify x S), and without a guard; every walk priced at the measured costs (verify x S).

    python guard_priced_replay.py ENTRY.json ANSWERS.json.gz S   # ANSWERS: examples/replay_error.py's --answers"""
import gzip, json, sys
from hf_retrace.loading import load_drafter
from hf_retrace.tuning.auto import records_of
from hf_retrace.tuning.replay import replay, AnswerRecord
from hf_retrace.generation.policy import RoundPolicy, verify_cost
entry = json.load(open(sys.argv[1])); S = float(sys.argv[3])
drafter = load_drafter(None); records = records_of(drafter); md = records.block_size - 1
p = RoundPolicy.from_dict(entry["policies"]["greedy"]).replace(speculate=True)
true = p.replace(verify_costs=[1.0] + [c * S for c in p.verify_costs[1:]])
bench = json.load(gzip.open(sys.argv[2], "rt"))
sets = {"T=0 records": records.greedy, **{k: [AnswerRecord(**r) for r in v] for k, v in bench.items()}}
def priced(answers, guard_by):
    orig = RoundPolicy.guard
    if guard_by is None:
        RoundPolicy.guard = lambda self, rows=1: None
    walk = replay(answers, guard_by or p, md, keep_rounds=True)
    RoundPolicy.guard = orig
    cost = sum(true.round_cost(k, s == "lookup") for s, k, _ in walk["round_log"]) + walk["plain_steps"]
    return walk["tokens"] / cost, walk["plain_steps"] / walk["tokens"]
for name, answers in sets.items():
    out = [f"{name:12s}"]
    for label, g in (("model guard", p), ("true guard", true), ("no guard", None)):
        f, share = priced(answers, g)
        out.append(f"{label} {f:.3f} ({share:.0%} plain)")
    print("  ".join(out), flush=True)
