"""The tuner's result as a user reads it: this machine's cost table and the policy chosen per temperature."""

from __future__ import annotations

from typing import Any

from ..generation.policy import RoundPolicy

__all__ = ["print_tuning", "print_verification"]


def print_tuning(result: dict[str, Any], show_table: bool = True) -> None:
    """Print ``tune()``'s result: verify costs, drafter costs, the best replayed candidates, the choices."""
    costs = result["costs"]
    verify = costs["verify_costs"]
    rows = costs.get("rows", 1)
    batch = f" of a batch of {rows} rows (every figure in {rows}-row steps)" if rows > 1 else ""
    print(f"[hf-retrace] one-token target step{batch}: {costs['step_seconds'] * 1000:.1f} ms; drafter round: "
          f"{costs['draft_cost_chunk']:.2f} steps (2 slots scored), {costs['draft_cost_full']:.2f} (full block)")
    if costs.get("onednn_from", 0) > 1 or not costs.get("drafter_onednn", True):
        narrow = costs.get("onednn_from", 0)
        print(f"[hf-retrace] kernels: target forwards of fewer than {narrow} new tokens run without torch's oneDNN "
              f"(measured faster on this CPU), wider ones with it; the drafter's round "
              f"{'with' if costs.get('drafter_onednn', True) else 'without'} it; every cost below is priced so")
    print("verify cost of k drafts, in one-token steps:")
    print("| k | " + " | ".join(str(k) for k in range(len(verify))) + " |")
    print("|---" * (len(verify) + 1) + "|")
    print("| cost | " + " | ".join(f"{c:.2f}" for c in verify) + " |")
    for check in result.get("prices", []):
        if check["price"] is not None:
            passes = ", ".join(f"{f:.2f}" for f in check["passes"])
            print(f"[hf-retrace] price of real rounds: {check['price']:.2f} of the replay's tokens per step-cost (real "
                  f"calls against plain generate on recorded prompts, passes: {passes}); a policy's speed-up over "
                  "plain is its replayed figure times this" + (
                      f"; {check['clocked']:.2f} of the figure the generator's clocks give the same rounds (what "
                      "prices the calls that check a plain choice)" if check.get("clocked") is not None else ""))
        else:
            print(f"[hf-retrace] price of real rounds not used: {check['why']}")
    for name, label in (("greedy", "T=0"), ("sampled", "T>0")):
        table = result.get("tables", {}).get(name)
        if show_table and table:
            print(f"\nbest replayed policies at {label} (tokens per step-cost; plain decoding = 1):")
            print("| confidence cut | lookup start..cap | tau | lookup share | tokens per step-cost |\n|---|---|---|---|---|")
            seen = set()
            for row in sorted(table, key=lambda r: -r["tokens_per_cost"]):
                key = (row["confidence_cut"], tuple(row["lookup"] or ()))
                if key in seen:
                    continue
                seen.add(key)
                lookup = "off" if row["lookup"] is None else f"{row['lookup'][0]}..{row['lookup'][1]}"
                cut = "full block" if row["confidence_cut"] is None else f"{row['confidence_cut']:g}"
                print(f"| {cut} | {lookup} | {row['tau']:.2f} | {row['lookup_share']:.2f} | "
                      f"{row['tokens_per_cost']:.3f} |")
                if len(seen) == 8:
                    break
        print(f"[hf-retrace] {label}: {RoundPolicy.from_dict(result['policies'][name]).describe()}")
    measured = len(result.get("measurements", [])) or 1
    how = f"largest spread between repeats {costs.get('spread', 0.0):.2f}"
    if costs.get("timed_out"):
        how = "cut short at its deadline"
    if costs.get("threads"):
        how = f"the one decided on timed with {costs['threads']} thread{'s' * (costs['threads'] > 1)}, " + how
    print(f"[hf-retrace] tuning took {result['seconds']:.1f} s ({measured} cost measurement{'s' * (measured > 1)}; "
          f"{how})")
    if result.get("note") and result.get("cache_note") != result["note"]:  # (else the cache line says it)
        print(f"[hf-retrace] {result['note']}")


def print_verification(rows: list[dict[str, Any]]) -> None:
    """Print ``verify_tuning``'s rows: each arm's predicted tokens per step-cost against its realized speed-up."""
    print("\npredicted (the replay's figure times the measured price of real rounds, where measured) against realized "
          "(decode speed over plain, prefill excluded):")
    print("| T | arm | policy | predicted | realized | realized / predicted | tau |\n|---|---|---|---|---|---|---|")
    for row in rows:
        predicted = row["predicted"]
        ratio = f"{row['realized'] / predicted:.2f}" if predicted else "-"
        shown = f"{predicted:.2f}" if predicted else "-"
        print(f"| {row['temperature']} | {row['arm']} | {row['policy']} | {shown} | {row['realized']:.2f}x | {ratio} | "
              f"{row['tau']:.2f} |")
