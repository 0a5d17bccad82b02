"""Prompt recipes of ``hf-retrace data``: ``code-prompts``, ``chat-prompts`` and ``mix`` (flags and commands).

``code-prompts`` writes HumanEval-style problems from the library functions on this machine (``code_prompts``);
``chat-prompts`` splits chat prompts that nobody answered yet into code requests and the rest (``code_requests``) and
writes the second turns of the conversations whose first turn the target answered (``conversations``); ``mix`` takes
the next N unanswered prompts of each file into one file, so that one ``data generate`` run covers every kind.

Example::

    hf-retrace data code-prompts --out data/code.jsonl --exclude HumanEval.jsonl.gz
    hf-retrace data chat-prompts --prompts sharegpt-prompts.jsonl --conversations ShareGPT_V3.json \\
        --answers data/responses --out-dir data/chat
    hf-retrace data mix --prompts data/code.jsonl data/chat/second-turns.jsonl --answered data/responses \\
        --per-file 300 --out data/round.jsonl
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...chat import ID_FIELDS, record_id
from ...jsonl import iter_jsonl
from .chat_template import prompt_token_ids
from .code_prompts import Exclusions, benchmark_exclusions, collect_code_prompts, write_code_prompts
from .code_requests import code_request_kind
from .conversations import extract_turns, read_sharegpt, read_turns, second_turn_records, write_jsonl
from .prompts import read_prompts
from .response_shards import read_answered


def _usage_error(message: str) -> SystemExit:
    return SystemExit(f"hf-retrace data: {message}")


# ---------------------------------------------------------------------------------------------------------------
# code-prompts
# ---------------------------------------------------------------------------------------------------------------


def add_code_prompt_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSONL of prompts (id, prompt, code, entry_point, package, licence)")
    p.add_argument("--exclude", nargs="*", default=[],
                   help="benchmark problems to leave out (JSONL or .jsonl.gz whose `prompt` holds the code, e.g. "
                        "HumanEval.jsonl.gz): any function with one of their names or docstrings")
    p.add_argument("--min-words", type=int, default=12, help="docstrings shorter than this are trivial")
    p.add_argument("--max-chars", type=int, default=1500, help="docstrings longer than this are left out")
    p.add_argument("--seed", type=int, default=0, help="shuffles the prompts (packages mixed); -1 keeps source order")


def run_code_prompts(args: argparse.Namespace) -> int:
    missing = [path for path in args.exclude if not Path(path).is_file()]
    if missing:
        raise _usage_error(f"--exclude: not found: {missing}")
    excluded = benchmark_exclusions(args.exclude) if args.exclude else Exclusions()
    prompts = collect_code_prompts(excluded=excluded, min_words=args.min_words, max_chars=args.max_chars)
    if args.seed >= 0:
        random.Random(args.seed).shuffle(prompts)
    summary = write_code_prompts(prompts, args.out)
    top = ", ".join(f"{name} {count} ({summary['licences'][name]})"
                    for name, count in Counter(summary["by_package"]).most_common(12))
    print(f"[hf-retrace] {summary['num_prompts']} code prompts from {len(summary['by_package'])} packages "
          f"(Python {summary['python']}; {len(excluded.names)} benchmark function names excluded) in {args.out}; "
          f"most from: {top}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# chat-prompts
# ---------------------------------------------------------------------------------------------------------------


def add_chat_prompt_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, help="first-turn prompt JSONL (id, prompt), e.g. sharegpt-prompts.jsonl")
    p.add_argument("--conversations", required=True,
                   help="ShareGPT JSON (conversations; may be cut short) or the turns.jsonl this command wrote")
    p.add_argument("--answers", nargs="*", default=[],
                   help="the target's response files or shard folders: answered first turns are not asked again, "
                        "and their second turns are asked after the target's own answer")
    p.add_argument("--out-dir", required=True,
                   help="writes turns.jsonl, first-turns-code.jsonl, first-turns-chat.jsonl, second-turns.jsonl")
    p.add_argument("--id-prefix", default="sharegpt-", help="prefix of --prompts ids before the conversation id")
    p.add_argument("--target", default="default", help="whose tokenizer measures second turns (Hub id, folder)")
    p.add_argument("--max-prompt-tokens", type=int, default=768,
                   help="second turns longer than this (history included) are left out, as `data generate` would")


def _answers_by_id(paths: list[str]) -> dict[str, dict[str, Any]]:
    missing = [path for path in paths if not Path(path).exists()]
    if missing:
        raise _usage_error(f"--answers/--answered: not found: {missing}")
    return {str(record["id"]): record for record in read_answered(paths) if "id" in record}


def run_chat_prompts(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from ...loading import resolve_target

    out_dir = Path(args.out_dir)
    source = Path(args.conversations)
    if not source.is_file():
        raise _usage_error(f"--conversations: not found: {source}")
    if source.suffix == ".jsonl":
        turns = read_turns(source)
    else:
        turns = extract_turns(read_sharegpt(source), id_prefix=args.id_prefix)
        write_jsonl((conversation.record() for conversation in turns), out_dir / "turns.jsonl")
    answers = _answers_by_id(args.answers)
    has_second_turn = {conversation.id for conversation in turns}

    unanswered = [p for p in read_prompts(args.prompts) if p.id not in answers]
    unanswered.sort(key=lambda p: p.id not in has_second_turn)  # stable: a second turn can follow these soonest
    kinds = {p.id: code_request_kind(p.prompt) for p in unanswered}
    code = [{"id": p.id, "source": "sharegpt-code", "kind": kinds[p.id], "prompt": p.prompt}
            for p in unanswered if kinds[p.id]]
    chat = [{"id": p.id, "source": "sharegpt", "prompt": p.prompt} for p in unanswered if not kinds[p.id]]
    write_jsonl(code, out_dir / "first-turns-code.jsonl")
    write_jsonl(chat, out_dir / "first-turns-chat.jsonl")

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(args.target))
    seconds = second_turn_records(turns, answers)
    histories = [(record["turns"][0], record["answers"][0]) for record in seconds]
    token_ids = prompt_token_ids(tokenizer, [record["turns"][1] for record in seconds], histories)
    fitting = [record for record, ids in zip(seconds, token_ids) if len(ids) <= args.max_prompt_tokens]
    write_jsonl(fitting, out_dir / "second-turns.jsonl")
    print(f"[hf-retrace] {len(turns)} conversations with a second turn; unanswered first turns: {len(code)} ask for "
          f"code, {len(chat)} others; {len(fitting)} second turns after the target's answer (of {len(seconds)} "
          f"answered, {len(seconds) - len(fitting)} over {args.max_prompt_tokens} tokens) in {out_dir}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# mix
# ---------------------------------------------------------------------------------------------------------------


def add_mix_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, nargs="+", help="prompt JSONL files, each record with an id")
    p.add_argument("--answered", nargs="*", default=[],
                   help="response files or shard folders (a run in progress included): their ids are skipped")
    p.add_argument("--per-file", type=int, required=True, help="the next N unanswered prompts of each file")
    p.add_argument("--out", required=True, help="one prompt JSONL (records as they are, so multi-turn ones stay so)")
    p.add_argument("--target", default="default", help="whose chat template measures the prompts (Hub id, folder)")
    p.add_argument("--max-prompt-tokens", type=int, default=768,
                   help="prompts longer than this are passed over, as `data generate` would skip them (0: no limit)")


def _record_id(record: dict[str, Any], where: str) -> str:
    found = record_id(record)
    if found is None:
        raise _usage_error(f"{where}: a record without {list(ID_FIELDS)}; mix needs ids (they are what is skipped).")
    return found


def _prompt_length(tokenizer: Any, record: dict[str, Any]) -> int:
    [prompt] = read_prompts([record])
    return len(prompt_token_ids(tokenizer, [prompt.prompt], [prompt.history])[0])


def run_mix(args: argparse.Namespace) -> int:
    if args.per_file < 1:
        raise _usage_error(f"--per-file must be at least 1, got {args.per_file}.")
    missing = [path for path in args.prompts if not Path(path).is_file()]
    if missing:
        raise _usage_error(f"--prompts: not found: {missing}")
    tokenizer = None
    if args.max_prompt_tokens > 0:
        from transformers import AutoTokenizer

        from ...loading import resolve_target

        tokenizer = AutoTokenizer.from_pretrained(resolve_target(args.target))
    answered = set(_answers_by_id(args.answered))
    taken: list[dict[str, Any]] = []
    counts, seen, too_long = [], set(), 0
    for path in args.prompts:
        count = 0
        for line_number, record in iter_jsonl(Path(path)):
            if count == args.per_file:
                break
            record_id = _record_id(record, f"{path}:{line_number}")
            if record_id in answered or record_id in seen:
                continue
            seen.add(record_id)
            if tokenizer is not None and _prompt_length(tokenizer, record) > args.max_prompt_tokens:
                too_long += 1  # never answered, so it would come back every round
                continue
            taken.append(record)
            count += 1
        counts.append(f"{Path(path).name} {count}")
    write_jsonl(taken, args.out)
    print(f"[hf-retrace] {len(taken)} prompts ({', '.join(counts)}; {too_long} passed over, longer than "
          f"{args.max_prompt_tokens} tokens) in {args.out}")
    return 0


PROMPT_RECIPES: tuple[tuple[str, str, Callable[[argparse.ArgumentParser], None],
                            Callable[[argparse.Namespace], int]], ...] = (
    ("code-prompts", "HumanEval-style prompts from the library functions on this machine (permissive licences)",
     add_code_prompt_arguments, run_code_prompts),
    ("chat-prompts", "unanswered chat prompts split into code requests and others; second turns after the "
     "target's own answer", add_chat_prompt_arguments, run_chat_prompts),
    ("mix", "the next N unanswered prompts of each file, in one file", add_mix_arguments, run_mix),
)
"""(name, help, add the flags, run) of each recipe, for ``hf-retrace data``."""
