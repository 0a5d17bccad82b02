"""Repeat the price's real calls with one cached entry's costs; per prompt and per pass, to see where the noise is.
python price_repeats.py ENTRY.json REPEATS [TOKENS]   (the cache entry of a tuning: its costs and T=0 policy)"""
import json, sys
import torch
import hf_retrace
from hf_retrace.tuning import verify
from hf_retrace.tuning.auto import records_of
from hf_retrace.tuning.costs import MachineCosts
from hf_retrace.generation.policy import RoundPolicy
from hf_retrace.loading import load_drafter, load_target

entry = json.load(open(sys.argv[1])); repeats = int(sys.argv[2]); tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 20
torch.set_num_threads(2)
target, _ = load_target(None)
drafter = load_drafter(None)
policy = RoundPolicy.from_dict(entry["policies"]["greedy"]).replace(speculate=True, source="tuned", reason="")
costs = MachineCosts.from_dict(entry["costs"])
records = records_of(drafter)
log = []
CL = []
orig = verify._decode
def logged(target_, assistant, ids, n, sampling):
    s, new = orig(target_, assistant, ids, n, sampling)
    kind = "prefill" if assistant is None else ("plain" if not assistant.round_policy.speculate else "drafted")
    cost = verify.modelled_cost(assistant.last_stats, assistant.round_policy) if kind == "drafted" and assistant.last_stats else None
    clocked = None
    if kind == "drafted" and assistant.last_stats:
        st_ = assistant.last_stats
        clocked = (st_.draft_seconds + st_.verify_seconds) / costs.step_seconds + st_.guard_plain_steps
        CL.append((clocked, cost, st_.round_tokens))
    log.append((kind, int(ids.shape[1]), n, s, new, cost))
    return s, new
verify._decode = logged
for r in range(repeats):
    log.clear()
    check = verify.measure_price(target, drafter, policy, records.greedy, costs.step_seconds, max_new_tokens=tokens)
    prefill = {L: s for k, L, n, s, new, c in log if k == "prefill" and n == 1}
    rows = [(k, L, s, new, c) for k, L, n, s, new, c in log if n == tokens]
    plain = [(L, s) for k, L, s, new, c in rows if k == "plain"]
    drafted = [(L, s, c) for k, L, s, new, c in rows if k == "drafted"]
    per = []
    for (L, ps), (L2, ds, c) in zip(plain, drafted):
        pf = prefill[L]
        per.append(round(c * (ps - pf) / (tokens - 1) / (ds - pf), 3))
    print(f"repeat {r}: price {check.price} passes {check.passes} why {check.why!r}; prefills "
          f"{[round(v*1000) for v in prefill.values()]} ms; per-call prices {per}", flush=True)

print("clocked/modelled per drafted call:", [round(c/m,3) for c,m,t in CL if m])
print("pooled clocked/modelled:", round(sum(c for c,m,t in CL)/sum(m for c,m,t in CL),3))
