"""Profile one drafted ``generate`` call on a real target: where a round's time goes, op by op, with shapes.

    python examples/profile_round.py [--target default --drafter default --threads 2 --rows 15]

Prints the drafter round cost c (draft seconds per round / plain seconds per token, both measured here), and the
``torch.profiler`` table of the ops run inside the drafter's rounds (self CPU time, calls, input shapes), so that a
weight-sized copy or a per-round cast shows at once. Run it alone on the machine: its timings are the machine's.
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import hf_retrace  # noqa: F401  (installs the generate hook)
from hf_retrace.loading import load_drafter, load_target
from hf_retrace.side_by_side import chat_input_ids

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May?")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="default")
    parser.add_argument("--drafter", default="default")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--drafter-dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--full-block", action="store_true", help="switch the adaptive block off")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, "bf16")
    drafter = load_drafter(args.drafter, args.drafter_dtype)
    if args.full_block:
        drafter = drafter.with_policy(confidence_cut=None)
    ids = chat_input_ids(tokenizer, PROMPT)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    with torch.inference_mode():
        target.generate(ids, max_new_tokens=8, do_sample=False)  # warm-up
        started = time.perf_counter()
        plain = target.generate(ids, **kwargs)
        plain_spt = (time.perf_counter() - started) / (plain.shape[1] - ids.shape[1])
        target.generate(ids, assistant_model=drafter, **kwargs)  # warm-up
        from hf_retrace.generation.candidate_generator import ReTraceCandidateGenerator

        original = ReTraceCandidateGenerator.get_candidates

        def labelled(self, *a, **k):
            with record_function("drafter_round"):
                return original(self, *a, **k)

        ReTraceCandidateGenerator.get_candidates = labelled
        try:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                target.generate(ids, assistant_model=drafter, **kwargs)
        finally:
            ReTraceCandidateGenerator.get_candidates = original
        # a clean timing run (no profiler) for c
        target.generate(ids, assistant_model=drafter, **kwargs)
        stats = drafter.last_stats
    c = stats.draft_seconds / max(stats.rounds, 1) / plain_spt
    print(f"plain: {plain_spt * 1e3:.1f} ms/token; drafter: {stats.rounds} rounds, tau "
          f"{stats.mean_acceptance_length:.2f}, {stats.draft_seconds / max(stats.rounds, 1) * 1e3:.1f} ms/round "
          f"-> c = {c:.3f}; verify {stats.verify_seconds / max(stats.rounds, 1) * 1e3:.1f} ms/round "
          f"-> eps = {stats.verify_seconds / max(stats.rounds, 1) / plain_spt - 1:.3f}")
    # ops inside the drafter's rounds only (children of the drafter_round label)
    events = prof.events()
    rounds = [e for e in events if e.name == "drafter_round"]
    inside = [e for e in events if e.name != "drafter_round" and any(
        r.time_range.start <= e.time_range.start and e.time_range.end <= r.time_range.end for r in rounds)]
    table: dict[tuple, list[float]] = {}
    for e in inside:
        key = (e.name, str(e.input_shapes)[:70])
        row = table.setdefault(key, [0.0, 0])
        row[0] += e.self_cpu_time_total
        row[1] += 1
    total = sum(v[0] for v in table.values())
    print(f"\nops inside {len(rounds)} drafter rounds: {total / 1e3:.1f} ms self CPU in all")
    print(f"| op | input shapes | self ms / round | calls / round | share |\n|---|---|---|---|---|")
    for (name, shapes), (t, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[: args.rows]:
        print(f"| {name} | {shapes} | {t / 1e3 / len(rounds):.2f} | {n / len(rounds):.1f} | {t / total:.0%} |")


if __name__ == "__main__":
    main()
