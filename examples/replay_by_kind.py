"""The replay's prediction per kind of prompt (issue 41, item 4): where a tuned policy's predicted speed-up misses a
dev set's, is it the mixture of the recorded prompts or the cost model?

The tuner predicts one figure (tokens per step-cost) for the mixture of a drafter's recorded prompts: 8 each of six
kinds, alternating in the order ``examples/round_record_prompts.py`` writes them. This replays a cached or ``tune
--json`` choice at T=0 on each kind alone, with the same measured costs, so a dev set can be compared with the kind
that resembles it (GSM8K and MATH-500 with the math kinds, HumanEval with the code kinds, MT-Bench with chat and
second turns).

    python examples/replay_by_kind.py --policy ~/.cache/hf_retrace/policies/KEY.json
    python examples/replay_by_kind.py --policy tune.json --drafter path/to/drafter
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

KINDS = ["GSM8K train", "MATH train", "ShareGPT first turns", "library code", "ShareGPT code requests",
         "second turns"]  # examples/round_record_prompts.py's order; the kinds alternate


def main(argv: Sequence[str] | None = None) -> int:
    from hf_retrace.generation.policy import RoundPolicy
    from hf_retrace.tuning.records import replay_inputs
    from hf_retrace.tuning.replay import replay

    entry, records = replay_inputs(argv, __doc__.split("\n\n")[0])
    policy = RoundPolicy.from_dict(entry["policies"]["greedy"])
    if not policy.speculate:
        sys.exit("the --policy file's T=0 choice is plain decoding; there is no drafting policy to replay")
    answers, kinds = records.greedy, len(KINDS)
    print(f"T=0 choice: {policy.describe()}\n")
    print("| recorded prompts | prompts | predicted tokens per step-cost | τ |\n|---|---|---|---|")
    groups = [("all", answers)] + [(KINDS[k] if len(answers) % kinds == 0 else f"every {kinds}th from {k}",
                                    answers[k::kinds]) for k in range(kinds)]
    for name, group in groups:
        result = replay(group, policy, records.block_size - 1)
        print(f"| {name} | {len(group)} | {result['tokens_per_cost']:.2f} | {result['tau']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
