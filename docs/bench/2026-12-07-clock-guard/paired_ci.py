"""Per set: the default's decode time against each static cell's, request by request (paired), with a bootstrap
95 % interval over the set's requests: speed of the default over the cell's (>1: the default faster); the four
cells with the lowest (those furthest ahead of the default).

    python paired_ci.py GRID.json[.gz] [TEMPERATURE]"""
import gzip, json, random, sys
d = json.load((gzip.open if sys.argv[1].endswith(".gz") else open)(sys.argv[1], "rt"))
T = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
rows = {(r["dataset"], r["method"]): r for r in d["rows"] if r["temperature"] == T}
sets = sorted({k[0] for k in rows}, key=["gsm8k", "math500", "humaneval", "mtbench"].index)
rng = random.Random(0)
def dec(req): return req["generate_seconds"] - req["prefill_seconds"], req["new_tokens"] - 1  # decode s, tokens
for ds in sets:
    base = rows[(ds, "default")]["per_request"]
    out = []
    for (s, m), r in rows.items():
        if s != ds or m == "default": continue
        pairs = [(dec(a), dec(b)) for a, b in zip(base, r["per_request"])]
        def ratio(idx):  # the cell's pooled s/token over the default's, as the bench pools a row
            pooled = lambda j: sum(pairs[i][j][0] for i in idx) / sum(pairs[i][j][1] for i in idx)
            return pooled(1) / pooled(0)
        n = len(pairs); point = ratio(range(n))
        boots = sorted(ratio([rng.randrange(n) for _ in range(n)]) for _ in range(2000))
        out.append((point, m, boots[50], boots[1949]))
    print(ds, " ".join(f"{m} {p:.2f} [{lo:.2f},{hi:.2f}]" for p, m, lo, hi in sorted(out)[:4]))
