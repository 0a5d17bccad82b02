"""Paired A/B of guard triggers on the tuned T=0 policy: as shipped (window 8, back-off 4..64), window 16, a back-off
that never grows (4), and no guard; every turn of 8 prompts a set, the arms' order rotated per turn."""
import json, sys, time
import torch
import hf_retrace  # noqa
from hf_retrace.loading import load_drafter, load_target
from hf_retrace.generation import policy as pol
from hf_retrace.generation.policy import RoundPolicy, RoundGuard
from hf_retrace.tuning.verify import plain_view
from hf_retrace.bench.datasets import load_prompts
from hf_retrace.chat import prompt_token_ids
entry = json.load(open(sys.argv[1])); limit = int(sys.argv[2]); tokens = int(sys.argv[3])
target, tok = load_target(None); drafter = load_drafter(None)
tuned = RoundPolicy.from_dict(entry["policies"]["greedy"])
SETTINGS = {"guard 8, 4..64": dict(), "window 16": dict(window=16), "back-off 4": dict(max_backoff=4), "no guard": None}
current = [None]
orig_guard = RoundPolicy.guard
def guard(self, rows=1):
    if current[0] == "plain" or SETTINGS.get(current[0], {}) is None or self.verify_costs is None or rows != 1:
        return None if current[0] != "plain" else orig_guard(self, rows)
    return RoundGuard(self, **SETTINGS[current[0]])
RoundPolicy.guard = guard
view, plain = drafter.with_policy(tuned), plain_view(drafter, tuned)
arms = [("plain", plain)] + [(name, view) for name in SETTINGS]
def run(label, v, ids, n):
    current[0] = label; torch.manual_seed(0); t = time.perf_counter()
    out = target.generate(ids, max_new_tokens=n, do_sample=False, assistant_model=v)
    return time.perf_counter() - t, out
ids0 = torch.tensor([prompt_token_ids(tok, ["Hello"])[0]])
for a, v in arms: run(a, v, ids0, 8)
tot = {}; k = 0
for ds in ("gsm8k", "math500", "humaneval", "mtbench"):
    sec = {a: 0.0 for a, _ in arms}; ntok = {a: 0 for a, _ in arms}; gp = {a: 0 for a, _ in arms}
    for p in load_prompts(ds, limit=limit):
        history = []
        for turn in p.turns:
            ids = torch.tensor([prompt_token_ids(tok, [turn], [history])[0]])
            pre = min(run("plain", plain, ids, 1)[0] for _ in range(2))
            order = arms[k % len(arms):] + arms[:k % len(arms)]; k += 1
            answer = ""
            for a, v in order:
                s, out = run(a, v, ids, tokens)
                sec[a] += s - pre; ntok[a] += out.shape[1] - ids.shape[1] - 1
                if a != "plain" and v.last_stats is not None: gp[a] += v.last_stats.guard_plain_steps
                if a == "plain": answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            history = [*history, turn, answer]
    sp = {a: ntok[a] / sec[a] for a in sec}
    print(ds, "; ".join(f"{a} {sp[a]/sp['plain']:.3f}x (guard plain {gp[a]})" for a in sp), flush=True)
    for a in sp: tot.setdefault(a, []).append(sp[a] / sp["plain"])
print("mean", {a: round(sum(v)/len(v), 3) for a, v in tot.items()}, flush=True)
