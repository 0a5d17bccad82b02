"""One set of a bench report, request by request: each method's decode seconds, tau and the position of its first
departure from plain generate's tokens (a bf16 near-tie; None: the same text as plain).

    python requests.py GRID.json[.gz] SET [METHOD ...]"""
import gzip, json, sys
path, ds, methods = sys.argv[1], sys.argv[2], sys.argv[3:] or ["default", "static-0.5-16", "static-0.65-16"]
report = json.load((gzip.open if path.endswith(".gz") else open)(path, "rt"))
rows = {(r["dataset"], r["method"]): r for r in report["rows"]}
for method in methods:
    row = rows[(ds, method)]
    first = {}
    for d in row.get("divergences") or []:
        key = (d["prompt_id"], d["turn"])
        first[key] = min(first.get(key, d["position"]), d["position"])
    cells = [f"{q['prompt_id']}: {q['generate_seconds'] - q['prefill_seconds']:.2f} s, tau {q['tau']:.2f}, "
             f"departs {first.get((q['prompt_id'], q['turn']))}" for q in row["per_request"]]
    print(f"{method}\n  " + "\n  ".join(cells))
