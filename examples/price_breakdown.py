"""Where the price of a real round goes (issue 41, goal 3): the tuner's model of each round against the generator's
own clocks and the wall clock, per policy, on the drafter's recorded prompts.

    python examples/price_breakdown.py [--prompts 6] [--new-tokens 96] [--repeats 2]

Runs the machine's tuned T=0 policy and three variants (full blocks without lookup, its cut without lookup, its cut
with lookup 1..4) beside plain decoding with the same kernels (``tuning.verify.plain_view``), each call timed with
its prefill (a one-token call) taken off, the arms' order reversed every other repeat. Prints per policy: tau, the
replay's tokens per step-cost for the very rounds that ran (``tuning.verify.modelled_cost``), the same over the
generator's clocked drafter and verify seconds, the realized speed-up over plain, the drafter's and the verify's
clocked time over their modelled cost, and the milliseconds a round spends outside both clocks; and plain's wall time
a token in the tuned one-token steps. Their product is the price ``hf-retrace tune`` measures in short
(``tuning.verify.measure_price``). Run it alone on the machine: its figures are timings.
"""

import argparse
import time

import torch

import hf_retrace  # noqa: F401  (installs the dispatch)
from hf_retrace.generation.policy import verify_cost
from hf_retrace.loading import load_drafter, load_target
from hf_retrace.tuning.auto import records_of, tuned_policies
from hf_retrace.tuning.verify import modelled_cost, plain_view


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    target, _ = load_target(None)
    drafter = load_drafter(None)
    tuned = tuned_policies(target, drafter)["greedy"]
    policy, step = tuned.replace(speculate=True), tuned.origin.step_seconds  # the unit its costs are in
    answers = records_of(drafter).greedy
    inputs = [torch.tensor([a.tokens[: a.start]]) for a in answers[:: max(1, len(answers) // args.prompts)]]
    inputs = inputs[: args.prompts]
    views = {"plain": plain_view(drafter, policy), "tuned": drafter.with_policy(policy),
             "full blocks, no lookup": drafter.with_policy(policy.replace(confidence_cut=None, lookup=False)),
             "its cut, no lookup": drafter.with_policy(policy.replace(lookup=False)),
             "its cut, lookup 1..4": drafter.with_policy(policy.replace(lookup_start=1, lookup_cap=4))}

    def decode(view, ids, new_tokens):
        started = time.perf_counter()
        out = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, assistant_model=view)
        return time.perf_counter() - started, out.shape[1] - ids.shape[1]

    for view in views.values():  # warm-up
        decode(view, inputs[0], 8)
    prefill = [min(decode(views["plain"], ids, 1)[0] for _ in range(3)) for ids in inputs]
    sums = {label: dict.fromkeys(("wall", "tokens", "draft", "verify", "model_draft", "model_verify", "rounds",
                                  "plain_positions", "model"), 0.0) for label in views}
    for repeat in range(args.repeats):
        for index, ids in enumerate(inputs):
            for label in list(views)[:: 1 if repeat % 2 == 0 else -1]:
                view = views[label]
                took, new = decode(view, ids, args.new_tokens)
                row = sums[label]
                row["wall"] += took - prefill[index]
                row["tokens"] += new - 1
                stats = view.last_stats
                if label == "plain" or stats is None:
                    continue
                ran = view.round_policy
                row["draft"] += stats.draft_seconds
                row["verify"] += stats.verify_seconds
                row["rounds"] += stats.rounds
                row["plain_positions"] += stats.guard_plain_steps
                model, verifies = modelled_cost(stats, ran), sum(verify_cost(ran.verify_costs, d)
                                                                 for d in stats.draft_lengths)
                row["model"] += model
                row["model_verify"] += verifies
                row["model_draft"] += model - verifies - stats.guard_plain_steps
    plain_per_token = sums["plain"]["wall"] / sums["plain"]["tokens"]
    print(f"tuned one-token step {step * 1000:.1f} ms; plain generate {plain_per_token * 1000:.1f} ms a token "
          f"({plain_per_token / step:.3f} steps); policy: {policy.describe()}")
    print("| policy | tau | replayed tokens per step-cost (these rounds) | over the clocked seconds | realized over "
          "plain | drafter clocked / modelled | verify clocked / modelled | ms a round outside the clocks | price |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, row in sums.items():
        if label == "plain" or not row["rounds"]:
            continue
        tau = (row["tokens"] - row["plain_positions"]) / row["rounds"]
        replayed = row["tokens"] / row["model"]
        clocked = row["tokens"] / ((row["draft"] + row["verify"]) / step + row["plain_positions"])
        realized = row["tokens"] / row["wall"] * plain_per_token
        clocks = row["draft"] + row["verify"] + row["plain_positions"] * plain_per_token
        outside = (row["wall"] - clocks) / row["rounds"]
        print(f"| {label} | {tau:.2f} | {replayed:.3f} | {clocked:.3f} | {realized:.3f}x | "
              f"{row['draft'] / step / max(row['model_draft'], 1e-9):.3f} | "
              f"{row['verify'] / step / max(row['model_verify'], 1e-9):.3f} | {outside * 1000:.2f} | "
              f"{realized / replayed:.3f} |")


if __name__ == "__main__":
    main()
