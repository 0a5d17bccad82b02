"""The replay's error on a benchmark's own texts (issue 41, item 4): where a tuned policy's prediction misses what
`hf-retrace bench` measured, is it the τ the recorded prompts promise, or the price of a round?

The tuner replays a drafter's recorded rounds (held-out training prompts) under the machine's measured costs. This
records the benchmark's own prompts the same way (the target's greedy answers, the drafter's teacher-forced blocks at
every position: analysis only, written where ``--answers`` says and never beside a drafter, whose tuner must not
see benchmark prompts), replays each T=0 row's round policy on them, and sets the replay beside the benchmark's report
row by row: τ, drafts a round and the positions decoded plainly (the rounds themselves; the replay counts the
guard's, a block cut to nothing and an answer's last token, the bench the guard's), then the verify's cost a round
in the tuner's one-token steps, modelled against measured (the price of the same rounds), then tokens per step-cost
against the speed-up measured over the run's fastest plain.

    hf-retrace bench --dataset gsm8k --dataset math500 --methods plain-no-onednn,default,static-0.5-8 --json run.json
    python examples/replay_error.py --bench run.json --policy ~/.cache/hf_retrace/policies/KEY.json \\
        --answers ~/.cache/hf_retrace/replay-error/run-answers.json.gz

Rows it can replay: every drafting method whose rounds the recorded blocks give (``default``, ``shipped``,
``static-*``, ``dflash``, ``dflash+lookup``, ...), each resolved from the method's own view over the ``--policy``
file's T=0 choice (give the entry the run's default used), guarded where the call was, priced with the same costs. Sets whose prompts have several
turns (MT-Bench) are skipped: their rows mix turns whose texts the first turn alone does not give.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def row_policy(method: str, drafter: Any, greedy: Any) -> Any:
    """The round policy a bench row ran, resolved as its call resolved it: the method's own drafter view
    (``bench.methods.Method.drafter_view``) over the tuned T=0 choice ``greedy``; None for a row the recorded blocks
    cannot replay (plain decoding, transformers' own paths, ReTrace: its blocks depend on the carry)."""
    from hf_retrace.bench.methods import ALL_METHODS
    from hf_retrace.generation.policy import resolve_policy

    spec = ALL_METHODS.get(method)
    if spec is None or spec.kind != "drafter" or spec.retrace:
        return None
    policy = resolve_policy(spec.drafter_view(drafter), None, None, resolver=lambda *args, **kwargs: greedy)
    return policy if policy.speculate and policy.proposal_mode == "argmax" else None


def priced_replay(answers: Sequence[Any], policy: Any, costs: Any, max_drafts: int) -> dict[str, float]:
    """The rounds ``policy`` runs on ``answers`` (as it ran: with the guard where it has costs, a fixed policy
    without) and their price under ``costs`` (a policy carrying the machine's measured costs)."""
    from hf_retrace.generation.policy import verify_cost
    from hf_retrace.tuning.replay import replay

    walk = replay(answers, policy, max_drafts, keep_rounds=True)
    log = walk["round_log"]
    rounds = max(len(log), 1)
    verify = sum(verify_cost(costs.verify_costs, k) for _, k, _ in log)
    cost = sum(costs.round_cost(k, source == "lookup") for source, k, _ in log) + walk["plain_steps"]
    return {"tau": walk["tau"], "drafted": sum(k for _, k, _ in log) / rounds, "plain_steps": walk["plain_steps"],
            "verify": verify / rounds, "tokens_per_cost": walk["tokens"] / cost if cost else 0.0}


def measured(row: dict[str, Any], fast: dict[str, Any], step_seconds: float) -> dict[str, float]:
    """A bench report row's rounds and costs in the tuner's units (one-token steps of ``step_seconds``)."""
    rounds = max(row["rounds"], 1)
    return {"tau": row["tau_per_round"], "drafted": row["mean_draft_length"],
            "plain_steps": row.get("guard_plain_steps") or 0, "verify": row["verify_seconds"] / rounds / step_seconds,
            "speedup": fast["decode_seconds_per_token"] / row["decode_seconds_per_token"]}


def record_sets(bench: dict[str, Any], drafter: Any, out: Path) -> dict[str, list[dict[str, Any]]]:
    """The benchmark's single-turn sets recorded as the tuner's records are (its settings: prompts, tokens, dtype)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_retrace.bench.datasets import load_prompts
    from hf_retrace.chat import prompt_token_ids
    from hf_retrace.defaults import ensure_default_target
    from hf_retrace.training.calibrate import greedy_answer, record_answers

    settings = bench["settings"]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[settings["dtype"]]
    path = ensure_default_target()
    tokenizer = AutoTokenizer.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    drafter = drafter.to(dtype)
    recorded = {}
    for name, limit in settings["datasets"].items():
        prompts = load_prompts(name, limit=limit)
        if any(len(p.turns) > 1 for p in prompts):
            print(f"{name}: skipped (several turns a prompt)", file=sys.stderr)
            continue
        ids = prompt_token_ids(tokenizer, [p.turns[0] for p in prompts])
        items = [greedy_answer(target, torch.tensor([i]), settings["max_new_tokens"]) for i in ids]
        recorded[name] = [a.to_dict() for a in record_answers(target, drafter, items)]
        print(f"{name}: {len(items)} answers recorded", file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt", encoding="utf-8") as f:
        json.dump(recorded, f)
    return recorded


def main(argv: Sequence[str] | None = None) -> int:
    from hf_retrace import ReTraceDrafter
    from hf_retrace.defaults import default_drafter_path
    from hf_retrace.generation.policy import RoundPolicy
    from hf_retrace.tuning.records import AnswerRecord

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", required=True, help="an `hf-retrace bench --json` report with T=0 rows")
    parser.add_argument("--policy", required=True, help="the policy cache entry (or `hf-retrace tune --json` file) "
                        "whose T=0 choice the run's default used: its costs price every row")
    parser.add_argument("--answers", required=True, help="the benchmark's recorded answers: read when the file "
                        "exists, else recorded (minutes) and written there; never a drafter's folder")
    parser.add_argument("--drafter", default=None, help="the drafter the run used (default: the shipped one)")
    args = parser.parse_args(argv)
    try:
        bench = json.loads(Path(args.bench).read_text(encoding="utf-8"))
        entry = json.loads(Path(args.policy).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SystemExit(f"--bench {args.bench} / --policy {args.policy}: {e}") from e
    try:
        greedy = RoundPolicy.from_dict(entry["policies"]["greedy"], where=args.policy)
        step = float(entry["costs"]["step_seconds"])
    except (KeyError, TypeError) as e:
        raise SystemExit(f"--policy {args.policy}: no {e} field; expected a policy cache entry or an `hf-retrace "
                         "tune --json` file (its policies and measured costs), not a bare policy") from e
    if not greedy.speculate or greedy.verify_costs is None:
        raise SystemExit(f"{args.policy}: its T=0 choice is plain decoding or has no measured costs; nothing to price")
    answers_file = Path(args.answers)
    if answers_file.is_dir() or (answers_file.parent / "config.json").exists():
        raise SystemExit(f"--answers {answers_file}: give a file outside any model or drafter folder (benchmark "
                         "prompts must never reach a drafter's recorded rounds)")
    drafter = ReTraceDrafter.from_pretrained(args.drafter or default_drafter_path()).eval()
    recorded = (json.load(gzip.open(answers_file, "rt", encoding="utf-8")) if answers_file.exists()
                else record_sets(bench, drafter, answers_file))
    max_drafts = drafter.config.block_size - 1
    print(f"costs: {args.policy} (one-token step {step * 1e3:.2f} ms); T=0 choice: {greedy.describe()}\n")
    print("| set | method | τ replay / bench | drafts a round | positions decoded plainly, replay / the guard's in the bench | verify a round, "
          "model / measured (steps) | tokens per step-cost, replay | speed-up over the fast plain, bench |")
    print("|---|---|---|---|---|---|---|---|")
    for name, records in recorded.items():
        rows = bench["results"].get(name, {})
        fast = (rows.get("plain-no-onednn") or rows.get("plain") or {}).get("T=0")
        answers = [AnswerRecord(**r) for r in records]
        for method, by_temperature in rows.items():
            row, ran = by_temperature.get("T=0"), row_policy(method, drafter, greedy)
            if row is None or ran is None or not row.get("rounds") or fast is None:
                continue
            replayed, real = priced_replay(answers, ran, greedy, max_drafts), measured(row, fast, step)
            print(f"| {name} | {method} | {replayed['tau']:.2f} / {real['tau']:.2f} | {replayed['drafted']:.2f} / "
                  f"{real['drafted']:.2f} | {replayed['plain_steps']} / {real['plain_steps']} | {replayed['verify']:.2f} / "
                  f"{real['verify']:.2f} ({real['verify'] / replayed['verify']:.2f}) | {replayed['tokens_per_cost']:.2f} | "
                  f"{real['speedup']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
