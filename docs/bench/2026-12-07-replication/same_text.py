"""One prompt in float32, where every policy decodes plain generate's own tokens: plain, the tuned policy (with its
guard) and static cells, REPEATS calls each in rotated order, the median decode time kept (a 1-token call taken off).
Whether a bf16 gap on that prompt is the policy or the text its near-tie led to.

    python same_text.py ENTRY.json SET PROMPT_ID [REPEATS]"""
import json, statistics, sys, time
import torch
import hf_retrace  # noqa: F401
from hf_retrace.loading import load_drafter, load_target
from hf_retrace.generation.policy import RoundPolicy
from hf_retrace.bench.datasets import load_prompts
from hf_retrace.chat import prompt_token_ids

entry, ds, pid = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
target, tok = load_target(None, dtype="fp32"); drafter = load_drafter(None, dtype="fp32")
tuned = RoundPolicy.from_dict(entry["policies"]["greedy"])
arms = {"plain": None, "tuned": drafter.with_policy(tuned)}
for cut, cap in ((0.65, 16), (0.5, 16)):  # a static cell: no guard (no costs), lookup from 2
    arms[f"static-{cut}-{cap}"] = drafter.with_policy(tuned.replace(confidence_cut=cut, lookup_start=2, lookup_cap=cap,
                                                                     verify_costs=None, draft_cost=None))
prompt = next(p for p in load_prompts(ds) if p.id == pid)
ids = torch.tensor([prompt_token_ids(tok, [prompt.turns[0]])[0]])
def call(view, n):
    t = time.perf_counter()
    out = target.generate(ids, max_new_tokens=n, do_sample=False, **({"assistant_model": view} if view else {}))
    return time.perf_counter() - t, out
for view in arms.values():
    call(view, 8)
times, outs = {a: [] for a in arms}, {}
names = list(arms)
for r in range(repeats):
    for a in names[r % len(names):] + names[:r % len(names)]:
        pre = call(arms[a], 1)[0]
        s, outs[a] = call(arms[a], 128)
        times[a].append(s - pre)
n = outs["plain"].shape[1] - ids.shape[1] - 1
for a in names:
    same = torch.equal(outs[a], outs["plain"])
    tau = "" if arms[a] is None else f", tau {statistics.mean(arms[a].last_stats.acceptance_lengths):.2f}"
    print(f"{a}: {statistics.median(times[a]):.2f} s for {n} tokens (median of {repeats}){tau}, plain's tokens: {same}")
