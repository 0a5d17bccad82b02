"""Paired A/B of the round guard at T=0 on the dev sets: every turn of LIMIT prompts a set, plain (the fast kernels)
and each arm in one process, the arms' order rotated per turn; decode speed over plain's (a 1-token call taken off).

    python ab_guard.py ENTRY.json LIMIT TOKENS knobs      # A/B 1: the tuned policy and cut 0.5, lookup 2..16, each
                                                          #   with and without the guard (ab-guard.txt)
    python ab_guard.py ENTRY.json LIMIT TOKENS triggers   # A/B 2: the guard as shipped (window 8, back-off 4..64),
                                                          #   window 16, back-off never above 4, none (ab-trigger.txt)
    python ab_guard.py ENTRY.json LIMIT TOKENS clock      # A/B 3: the guard pricing rounds by the call's clock after
                                                          #   its first back-off, by the model only, none
                                                          #   (../2026-12-07-clock-guard/)
    python ab_guard.py ENTRY.json LIMIT TOKENS fooled     # A/B 4: the same, the guard's costs with every verify
                                                          #   1.5x dearer (a tuning a busy moment fooled)
    python ab_guard.py ENTRY.json LIMIT TOKENS winners [OFFSET [RECORDS.jsonl]]
                                                          # the tuned policy (with and without its guard) against the
                                                          #   static cells that won a set in the T=0 grid, on the
                                                          #   prompts after the first OFFSET of each set; RECORDS: every
                                                          #   turn's decode seconds and tokens per arm
                                                          #   (../2026-12-07-replication/)
    python ab_guard.py ENTRY.json LIMIT TOKENS noise [OFFSET [RECORDS.jsonl]]
                                                          # the guard's window rule as before (z=0) and beyond its own
                                                          #   noise (z=1), none; the tuned lookup budget and 2..16
                                                          #   (../2026-12-07-replication/)
    python ab_guard.py ENTRY.json LIMIT TOKENS aa [OFFSET [RECORDS.jsonl]]
                                                          # one policy (cut 0.5, lookup 2..16, no guard) as three
                                                          #   arms: the same calls, so what parts them is the clock

HF_RETRACE_DEV_DATA=DIR: the sets from DIR/NAME.jsonl (the full dev sets; the package ships their first 24 prompts).

ENTRY: a tuning's cache entry (its T=0 policy and costs)."""
import json, os, sys, time
import torch
import hf_retrace  # noqa: F401
from hf_retrace.loading import load_drafter, load_target
from hf_retrace.generation.policy import RoundPolicy, RoundGuard
from hf_retrace.tuning.verify import plain_view
from hf_retrace.bench.datasets import load_prompts
from hf_retrace.chat import prompt_token_ids

entry, limit, tokens, mode = json.load(open(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
offset = int(sys.argv[5]) if len(sys.argv) > 5 else 0
records_path = sys.argv[6] if len(sys.argv) > 6 else None
target, tok = load_target(None); drafter = load_drafter(None)
tuned = RoundPolicy.from_dict(entry["policies"]["greedy"])
static = tuned.replace(confidence_cut=0.5, lookup_start=2, lookup_cap=16)
def cell(cut, cap): return tuned.replace(confidence_cut=cut, lookup_start=2, lookup_cap=cap)  # a grid's static-CUT-CAP
dear = tuned.replace(verify_costs=[1.0] + [1.5 * c for c in tuned.verify_costs[1:]])  # verifies timed 1.5x dearer
ARMS = {  # label: (policy, the guard's settings; None: no guard)
    "knobs": {"tuned": (tuned, {}), "tuned-noguard": (tuned, None), "0.5-2..16-guard": (static, {}),
              "0.5-2..16-noguard": (static, None)},
    "triggers": {"guard 8, 4..64": (tuned, {}), "window 16": (tuned, {"window": 16}),
                 "back-off 4": (tuned, {"max_backoff": 4}), "no guard": (tuned, None)},
    "clock": {"guard, clock": (tuned, {}), "guard, model": (tuned, {"clock_after": 10**9}), "no guard": (tuned, None)},
    "fooled": {"guard, clock, verifies 1.5x": (dear, {}), "guard, model, verifies 1.5x": (dear, {"clock_after": 10**9}),
               "guard, clock": (tuned, {}), "no guard": (tuned, None)},
    "noise": {"tuned, z=0": (tuned, {"noise_z": 0.0}), "tuned, z=1": (tuned, {"noise_z": 1.0}),
              "tuned-noguard": (tuned, None), "0.5-2..16, z=1": (static, {"noise_z": 1.0}),
              "0.5-2..16-noguard": (static, None)},
    "aa": {"A": (static, None), "B": (static, None), "C": (static, None)},  # one policy thrice: the noise floor
    "winners": {"tuned": (tuned, {}), "tuned-noguard": (tuned, None), "static-0.5-16": (cell(0.5, 16), None),
                "static-0.65-16": (cell(0.65, 16), None), "static-0.65-8": (cell(0.65, 8), None),
                "static-0.3-16": (cell(0.3, 16), None)},
}[mode]
current = [None]  # the arm whose call runs: its guard settings apply
shipped_guard = RoundPolicy.guard
def guard(self, rows=1):
    settings = ARMS.get(current[0], (None, {}))[1]
    return None if settings is None else RoundGuard(self, **settings) if shipped_guard(self, rows) else None
RoundPolicy.guard = guard
plain = plain_view(drafter, tuned)
arms = [("plain", plain)] + [(label, drafter.with_policy(policy)) for label, (policy, _) in ARMS.items()]
def run(label, view, ids, n):
    current[0] = label; torch.manual_seed(0); t = time.perf_counter()
    out = target.generate(ids, max_new_tokens=n, do_sample=False, assistant_model=view)
    return time.perf_counter() - t, out
ids0 = torch.tensor([prompt_token_ids(tok, ["Hello"])[0]])
for a, v in arms: run(a, v, ids0, 8)
tot = {}; k = 0; records = []
for ds in ("gsm8k", "math500", "humaneval", "mtbench"):
    sec = {a: 0.0 for a, _ in arms}; ntok = {a: 0 for a, _ in arms}; gp = {a: 0 for a, _ in arms}; gc = {a: 0 for a, _ in arms}
    source = os.environ.get("HF_RETRACE_DEV_DATA")
    for p in load_prompts(f"{source}/{ds}.jsonl" if source else ds, limit=offset + limit)[offset:]:
        history = []
        for turn in p.turns:
            ids = torch.tensor([prompt_token_ids(tok, [turn], [history])[0]])
            pre = min(run("plain", plain, ids, 1)[0] for _ in range(2))
            order = arms[k % len(arms):] + arms[:k % len(arms)]; k += 1
            answer = ""
            for a, v in order:
                s, out = run(a, v, ids, tokens)
                sec[a] += s - pre; ntok[a] += out.shape[1] - ids.shape[1] - 1
                backed = v.last_stats.guard_plain_steps if a != "plain" and v.last_stats is not None else 0
                records.append({"dataset": ds, "prompt": p.id, "turn": len(history) // 2, "arm": a,
                                "decode_seconds": s - pre, "tokens": out.shape[1] - ids.shape[1] - 1,
                                "guard_plain": backed})
                if a != "plain" and v.last_stats is not None:
                    gp[a] += backed
                    gc[a] += getattr(v.last_stats, "guard_clocked_rounds", 0)
                if a == "plain": answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            history = [*history, turn, answer]
    sp = {a: ntok[a] / sec[a] for a in sec}
    print(ds, "; ".join(f"{a} {sp[a]/sp['plain']:.3f}x (guard plain {gp[a]}" + (f", clocked rounds {gc[a]})" if mode in ("clock", "fooled") else ")") for a in sp), flush=True)
    for a in sp: tot.setdefault(a, []).append(sp[a] / sp["plain"])
print("mean", {a: round(sum(v)/len(v), 3) for a, v in tot.items()}, flush=True)
if records_path:  # JSON Lines: one call a line
    with open(records_path, "w") as out:
        out.writelines(json.dumps(record) + "\n" for record in records)
