"""The noise floor of a paired speed comparison on this machine, from an A/A run (``../2026-12-07-grid/ab_guard.py
ENTRY LIMIT TOKENS aa OFFSET RECORDS.jsonl``: one policy as three arms, so every turn's three calls commit the same
tokens in the same rounds and only the clock parts them), and what it does to "the default within 5 % of the best of
13 cells".

    python noise_floor.py AA-RECORDS.jsonl [CELLS]

Per set: the A/A ratios (pooled tokens a second, as a grid pools a set) and a call's clock noise sigma (the standard
deviation of a call's log decode time about its turn's mean, over the three arms). Then a simulation on the same
turns: a default and CELLS (12) static cells, every one exactly as fast as the others, each call timed with that
noise; how often the default reads within 5 % of the best cell, per set and on all four at once."""
import math, random, statistics, sys
from paired_records import load_records
records = load_records(sys.argv[1:2]); cells = int(sys.argv[2]) if len(sys.argv) > 2 else 12
rng = random.Random(0)
turns = {}
for r in records:
    turns.setdefault(r["dataset"], {}).setdefault((r["prompt"], r["turn"]), {})[r["arm"]] = (r["decode_seconds"],
                                                                                           r["tokens"])
arms = ["A", "B", "C"]
within_all, sims = 0, 4000
per_set_hits = {ds: 0 for ds in turns}
sigmas = {}
for ds, by_turn in turns.items():
    rate = lambda a: sum(t[a][1] for t in by_turn.values()) / sum(t[a][0] for t in by_turn.values())
    logs = [[math.log(t[a][0]) for a in arms] for t in by_turn.values()]
    sigma = math.sqrt(statistics.mean(statistics.variance(row) for row in logs))
    sigmas[ds] = sigma
    pairs = ", ".join(f"{x}/{y} {rate(x) / rate(y):.3f}" for x, y in (("A", "B"), ("A", "C"), ("B", "C")))
    print(f"{ds}: {len(by_turn)} turns; A/A ratios {pairs}; a call's clock noise sigma {sigma:.3f}")
for _ in range(sims):
    ok_all = True
    for ds, by_turn in turns.items():
        base = [(statistics.mean(t[a][0] for a in arms), t["A"][1]) for t in by_turn.values()]
        def arm_rate():
            return sum(n for _, n in base) / sum(s * math.exp(rng.gauss(0.0, sigmas[ds])) for s, _ in base)
        default, best = arm_rate(), max(arm_rate() for _ in range(cells))
        ok = default >= 0.95 * best
        per_set_hits[ds] += ok
        ok_all &= ok
    within_all += ok_all
print(f"simulated ({sims} runs): a default as fast as every one of {cells} cells reads within 5 % of the best cell "
      + ", ".join(f"{ds} {hits / sims:.0%}" for ds, hits in per_set_hits.items())
      + f" of the time; on all {len(turns)} sets at once {within_all / sims:.0%}")
