"""What a cap on a batch round's drafts would buy (issue 39, docs/design/batching.md, Open 2), by the tuner's own
lockstep replay: the widest running row sets every round's verify, so a cap trades the tokens a long draft would
have won against the verify width it makes every row pay.

Replays a batch's tuned T=0 choice (a cached entry of a batch size, or ``hf-retrace tune --batch-size B --json``; a
plain choice replays the best drafting knobs it stores) on the drafter's recorded answers, ``B`` at a time with the
entry's measured costs and row share, with every round's drafts (the drafter's block and a lookup copy) capped at
``W``.

    python examples/replay_width_cap.py --policy ~/.cache/hf_retrace/policies/KEY.json
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

CAPS = (7, 5, 4, 3, 2)


def main(argv: Sequence[str] | None = None) -> int:
    from hf_retrace.generation.policy import RoundPolicy
    from hf_retrace.tuning.costs import MachineCosts
    from hf_retrace.tuning.records import replay_inputs
    from hf_retrace.tuning.replay import replay

    entry, records = replay_inputs(argv, __doc__.split("\n\n")[0])
    costs = MachineCosts.from_dict(entry["costs"])
    if costs.rows < 2:
        sys.exit("the --policy file was tuned at batch size 1; give a batch size's entry "
                 "(hf-retrace tune --batch-size B)")
    policy = RoundPolicy.from_dict(entry["policies"]["greedy"]).replace(speculate=True)
    print(f"{costs.rows} rows, row share {costs.row_share:.2f}; T=0 knobs: {policy.describe()}\n")
    print("| drafts a round at most | predicted speed-up over plain batched decoding | τ |\n|---|---|---|")
    for cap in CAPS:
        capped = policy.replace(lookup_cap=min(policy.lookup_cap, cap), lookup_start=min(policy.lookup_start, cap))
        result = replay(records.greedy, capped, min(cap, records.block_size - 1), rows=costs.rows,
                        row_share=costs.row_share)
        print(f"| {cap} | {result['tokens_per_cost']:.3f} | {result['tau']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
