"""What a position the guard decodes plainly inside the assisted loop costs, against plain decoding on the same kernels:
the tuned T=0 policy with a guard that never lets a round draft, and plain, on the first turns of 4 prompts a set."""
import json, sys, time
import torch
import hf_retrace  # noqa
from hf_retrace.loading import load_drafter, load_target
from hf_retrace.generation import policy as pol
from hf_retrace.generation.policy import RoundPolicy
from hf_retrace.tuning.verify import plain_view
from hf_retrace.bench.datasets import load_prompts
from hf_retrace.chat import prompt_token_ids
entry = json.load(open(sys.argv[1]))
target, tok = load_target(None); drafter = load_drafter(None)
tuned = RoundPolicy.from_dict(entry["policies"]["greedy"])
plain, guarded = plain_view(drafter, tuned), drafter.with_policy(tuned)
step = entry["costs"]["step_seconds"]
def run(view, ids, n):
    torch.manual_seed(0); t = time.perf_counter()
    out = target.generate(ids, max_new_tokens=n, do_sample=False, assistant_model=view)
    return time.perf_counter() - t, out.shape[1] - ids.shape[1]
pol.RoundGuard.drafts_at = lambda self, position: False
ids0 = torch.tensor([prompt_token_ids(tok, ["Hello"])[0]])
run(plain, ids0, 8); run(guarded, ids0, 8)
sec = {"plain": 0.0, "guard": 0.0}; n = {"plain": 0, "guard": 0}
for ds in ("gsm8k", "math500", "humaneval", "mtbench"):
    for i, p in enumerate(load_prompts(ds, limit=4)):
        ids = torch.tensor([prompt_token_ids(tok, [p.turns[0]])[0]])
        pre = min(run(plain, ids, 1)[0] for _ in range(2))
        for label, view in ((("plain", plain), ("guard", guarded)) if i % 2 == 0 else (("guard", guarded), ("plain", plain))):
            s, new = run(view, ids, 96)
            sec[label] += s - pre; n[label] += new - 1
print(f"timed one-token step {step*1000:.1f} ms; plain generate {sec['plain']/n['plain']*1000:.1f} ms a token; "
      f"a guard plain position in the assisted loop {sec['guard']/n['guard']*1000:.1f} ms "
      f"({sec['guard']/n['guard'] / (sec['plain']/n['plain']):.2f} of plain's, {sec['guard']/n['guard']/step:.2f} timed steps)")
