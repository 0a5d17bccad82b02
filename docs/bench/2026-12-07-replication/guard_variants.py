"""Replay the tuned policy's rounds under guard variants, without timing noise: on the drafter's recorded rounds (T=0,
and T=1 drafted with the same knobs) and on the texts a benchmark produced (``examples/replay_error.py --answers``).
Every walk is priced at the true costs (the entry's verifies x S); the guard decides on those costs, each round's
jittered by a log-normal clock noise of sd NOISE (a wall-clock price is a noisy one), seeded.

    python guard_variants.py ENTRY.json ANSWERS.json.gz S NOISE

Variants: no guard; the window rule (back off when the last 8 rounds commit fewer tokens than their step-cost, z=0,
as shipped before this folder); the same window beyond its own noise (z = 0.5, 1 (shipped since), 1.5: back off when the window's
tokens fall short of its step-cost by more than z standard deviations of a round's excess, tokens minus step-cost,
over the call so far, times sqrt(window))."""
import gzip, json, math, random, sys
import hf_retrace.generation.policy as policy_module
from hf_retrace.loading import load_drafter
from hf_retrace.tuning.auto import records_of
from hf_retrace.tuning.replay import replay, AnswerRecord
from hf_retrace.generation.policy import RoundPolicy, RoundGuard
entry = json.load(open(sys.argv[1])); S = float(sys.argv[3]); NOISE = float(sys.argv[4])
drafter = load_drafter(None); records = records_of(drafter); md = records.block_size - 1
p = RoundPolicy.from_dict(entry["policies"]["greedy"]).replace(speculate=True)
true = p.replace(verify_costs=[1.0] + [c * S for c in p.verify_costs[1:]])
bench = json.load(gzip.open(sys.argv[2], "rt"))
sets = {"T=0 records": records.greedy, "T=1 records": records.sampled,
        **{k: [AnswerRecord(**r) for r in v] for k, v in bench.items()}}
rng = random.Random(0)


class Jittered(RoundGuard):
    """The guard with each round's step-cost jittered (the clock's noise); its rule is RoundGuard's own."""
    def record(self, position, drafted, accepted, from_lookup, seconds=None):
        cost = self.policy.round_cost(drafted, from_lookup) * math.exp(rng.gauss(0.0, NOISE))
        super().record(position, drafted, accepted, from_lookup, seconds=cost)


def walk(answers, guard):
    orig = RoundPolicy.guard
    RoundPolicy.guard = (lambda self, rows=1: None) if guard is None else (lambda self, rows=1: guard(self))
    try:
        w = replay(answers, true, md, keep_rounds=True)
    finally:
        RoundPolicy.guard = orig
    cost = sum(true.round_cost(k, s == "lookup") for s, k, _ in w["round_log"]) + w["plain_steps"]
    return w["tokens"] / cost, w["plain_steps"] / w["tokens"]


def variant(**settings):
    def make(policy):
        g = Jittered(policy, clock_after=1, **settings)
        g.plain_seconds = [1.0]  # the clock's unit: a plain step is 1 (the jittered costs come in as seconds)
        g.note_plain = lambda seconds: None
        return g
    return make


VARIANTS = {"none": None, "z=0": variant(noise_z=0.0), "z=0.5": variant(noise_z=0.5), "z=1": variant(noise_z=1.0),
            "z=1.5": variant(noise_z=1.5)}
print(f"verifies x {S}, clock noise sd {NOISE}; tokens per step-cost (share of positions decoded plainly)")
for name, answers in sets.items():
    out = []
    for label, g in VARIANTS.items():
        rng.seed(0)
        f, share = walk(answers, g)
        out.append(f"{label} {f:.3f} ({share:.0%})")
    print(f"{name:12s} " + "  ".join(out), flush=True)
