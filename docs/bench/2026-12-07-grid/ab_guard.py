"""Paired A/B: the tuned T=0 policy with/without the guard, and cut 0.5 lookup 2..16 with/without; both MT-Bench turns."""
import json, sys, time
import torch
import hf_retrace  # noqa
from hf_retrace.loading import load_drafter, load_target
from hf_retrace.generation.policy import RoundPolicy
from hf_retrace.tuning.verify import plain_view
from hf_retrace.bench.datasets import load_prompts
from hf_retrace.chat import prompt_token_ids

entry = json.load(open(sys.argv[1])); limit = int(sys.argv[2]); tokens = int(sys.argv[3])
target, tok = load_target(None); drafter = load_drafter(None)
tuned = RoundPolicy.from_dict(entry["policies"]["greedy"])
static = tuned.replace(confidence_cut=0.5, lookup_start=2, lookup_cap=16)
arms = [("plain", plain_view(drafter, tuned)),
        ("tuned", drafter.with_policy(tuned)),
        ("tuned-noguard", drafter.with_policy(tuned.replace(verify_costs=None, draft_cost=None))),
        ("0.5-2..16-guard", drafter.with_policy(static)),
        ("0.5-2..16-noguard", drafter.with_policy(static.replace(verify_costs=None, draft_cost=None)))]
def run(view, ids, n):
    torch.manual_seed(0)
    t = time.perf_counter(); out = target.generate(ids, max_new_tokens=n, do_sample=False, assistant_model=view)
    return time.perf_counter() - t, out
ids0 = torch.tensor([prompt_token_ids(tok, ["Hello"])[0]])
for _, v in arms: run(v, ids0, 8)
tot = {}
k = 0
for ds in ("gsm8k", "math500", "humaneval", "mtbench"):
    sec = {a: 0.0 for a, _ in arms}; ntok = {a: 0 for a, _ in arms}; plainsteps = {a: 0 for a, _ in arms}
    for p in load_prompts(ds, limit=limit):
        history = []
        for turn in p.turns:
            ids = torch.tensor([prompt_token_ids(tok, [turn], [history])[0]])
            pre = min(run(arms[0][1], ids, 1)[0] for _ in range(2))
            order = arms[k % len(arms):] + arms[:k % len(arms)]; k += 1
            answer = None
            for a, v in order:
                s, out = run(v, ids, tokens)
                sec[a] += s - pre; ntok[a] += out.shape[1] - ids.shape[1] - 1
                if a != "plain" and v.last_stats is not None: plainsteps[a] += v.last_stats.guard_plain_steps
                if a == "plain": answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            history = [*history, turn, answer]
    sp = {a: ntok[a] / sec[a] for a in sec}
    print(ds, " ".join(f"{a}: {sp[a]/sp['plain']:.3f}x (guard plain {plainsteps[a]})" for a in sp), flush=True)
    for a in sp: tot.setdefault(a, []).append(sp[a] / sp["plain"])
print("mean", {a: round(sum(v)/len(v), 3) for a, v in tot.items()}, flush=True)
