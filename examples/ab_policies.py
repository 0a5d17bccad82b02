"""A paired A/B of round policies on the dev sets: several `hf-retrace tune --json` files (their T=0 policy) against
plain decoding, prompt by prompt in one process, so that the machine's drift between benchmark runs (5-10 % per set
on a 2-core VM) does not decide which tuning was better.

Per prompt (the first turn), a one-token call is timed twice and its minimum taken off every call (the prefill);
then plain decoding (on the kernels the first file's policy prices plain decoding with: the fastest plain, as the
tuner weighs it) and each policy decode ``--max-new-tokens`` greedily, the arms' order rotated from prompt to prompt.
Prints each set's decode speed per arm and its speed-up over plain, and the mean over the sets. Run it alone on the
machine; it takes about 100 s per arm for 8 prompts a set at 128 tokens on a 2-core EPYC.

    hf-retrace tune --json a.json; hf-retrace tune --json b.json   # e.g. a busy and a clean first use (issue 41)
    python examples/ab_policies.py a.json b.json --limit 8 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hf_retrace  # noqa: F401  (installs the dispatch)
from hf_retrace.bench.datasets import load_prompts
from hf_retrace.chat import prompt_token_ids
from hf_retrace.generation.policy import RoundPolicy
from hf_retrace.loading import load_drafter, load_target
from hf_retrace.tuning.verify import plain_view

SETS = ("gsm8k", "math500", "humaneval", "mtbench")


def _policy(path: Path) -> RoundPolicy:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return RoundPolicy.from_dict(data["policies"]["greedy"], where=f"{path}, policies.greedy")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"ab_policies: {path} is not a `hf-retrace tune --json` file ({error}); write one with "
                         "`hf-retrace tune --json FILE`.") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="`hf-retrace tune --json` files")
    parser.add_argument("--limit", type=int, default=8, help="prompts per set (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    policies = [_policy(path) for path in args.files]  # every file checked before the models load
    target, tokenizer = load_target(None)
    drafter = load_drafter(None)
    arms = [("plain", plain_view(drafter, policies[0]))]
    arms += [(path.name, drafter.with_policy(policy.replace(speculate=True))) for path, policy in zip(args.files,
                                                                                                      policies)]

    def decode(view, ids: torch.Tensor, new_tokens: int) -> tuple[float, int]:
        torch.manual_seed(0)
        started = time.perf_counter()
        out = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, assistant_model=view)
        return time.perf_counter() - started, out.shape[1] - ids.shape[1]

    warm = torch.tensor([prompt_token_ids(tokenizer, ["Hello"])[0]])
    for _, view in arms:  # first calls pay one-time costs
        decode(view, warm, 8)
    means: dict[str, list[float]] = {label: [] for label, _ in arms}
    for name in SETS:
        seconds = {label: 0.0 for label, _ in arms}
        tokens = {label: 0 for label, _ in arms}
        for index, prompt in enumerate(load_prompts(name, limit=args.limit)):
            ids = torch.tensor([prompt_token_ids(tokenizer, [prompt.turns[0]])[0]])
            prefill = min(decode(arms[0][1], ids, 1)[0] for _ in range(2))
            turn = index % len(arms)
            for label, view in arms[turn:] + arms[:turn]:
                took, new = decode(view, ids, args.max_new_tokens)
                seconds[label] += took - prefill
                tokens[label] += new - 1
        speeds = {label: tokens[label] / seconds[label] for label in seconds}
        for label in speeds:
            means[label].append(speeds[label] / speeds["plain"])
        print(f"{name}: " + "; ".join(f"{label} {speeds[label]:.1f} tok/s ({speeds[label] / speeds['plain']:.3f}x)"
                                      for label in speeds), flush=True)
    print("mean speed-up over the sets: " + "; ".join(f"{label} {sum(v) / len(v):.3f}x" for label, v in means.items()))


if __name__ == "__main__":
    main()
