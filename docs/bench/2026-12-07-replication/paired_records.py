"""Per set, each arm's decode speed over a baseline arm's (>1: the arm faster), prompt by prompt (paired), with a
bootstrap 95 % interval over the set's prompts (a prompt's turns resampled together); several RECORDS files (each from
``../2026-12-07-grid/ab_guard.py ... OFFSET RECORDS.jsonl``) pool their prompts (one prompt in two files: both runs'
calls summed).

    python paired_records.py [--against ARM] RECORDS.jsonl [RECORDS.jsonl ...]

The arms of the A/B modes that run the same calls share a name: "tuned" is the tuned policy with the guard's window
rule as shipped before this folder ("tuned, z=0"); "static-0.5-16" is cut 0.5, lookup 2..16, no guard
("0.5-2..16-noguard")."""
import json, random, sys

ALIASES = {"tuned, z=0": "tuned", "0.5-2..16-noguard": "static-0.5-16"}


def load_records(paths):
    """Every call of the RECORDS files (JSON Lines), arms renamed by ALIASES."""
    return [{**r, "arm": ALIASES.get(r["arm"], r["arm"])} for path in paths for r in map(json.loads, open(path))]


def main(args):
    against = "tuned"
    if args[:1] == ["--against"]:
        against, args = args[1], args[2:]
    rows = load_records(args)
    rng = random.Random(0)
    for ds in ["gsm8k", "math500", "humaneval", "mtbench"]:
        per = {}  # prompt -> arm -> [seconds, tokens]
        for r in rows:
            if r["dataset"] == ds:
                cell = per.setdefault(r["prompt"], {}).setdefault(r["arm"], [0.0, 0])
                cell[0] += r["decode_seconds"]; cell[1] += r["tokens"]
        arms = sorted({a for p in per.values() for a in p if a not in ("plain", against)})

        def ratio(arm, chosen):  # the arm's pooled tokens a second over the baseline's, as the A/B pools a set
            rate = lambda a: sum(per[p][a][1] for p in chosen) / sum(per[p][a][0] for p in chosen)
            return rate(arm) / rate(against)
        out = []
        for arm in arms + ["plain"]:
            prompts = sorted(p for p in per if arm in per[p] and against in per[p])  # the prompts both ran
            if not prompts:
                continue
            boots = sorted(ratio(arm, [rng.choice(prompts) for _ in prompts]) for _ in range(2000))
            out.append(f"{arm} {ratio(arm, prompts):.3f} [{boots[50]:.3f}, {boots[1949]:.3f}] ({len(prompts)} prompts)")
        if out:
            print(f"{ds} over {against}: " + "; ".join(out))


if __name__ == "__main__":
    main(sys.argv[1:])
