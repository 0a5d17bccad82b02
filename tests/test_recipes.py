"""The shell recipes under examples/ call `hf-retrace` with flags the CLI has: a renamed flag fails here, not hours
into a background run."""

from __future__ import annotations

import json

import argparse
import re
from pathlib import Path

import pytest

from hf_retrace.cli import build_parser

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RECIPES = sorted(EXAMPLES.glob("*.sh"))


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _calls(script: Path) -> list[tuple[int, list[str]]]:
    """(line, words) of every `hf-retrace ...` call, continuation lines joined, up to the end of the command."""
    text = script.read_text(encoding="utf-8")
    joined = re.sub(r"\\\n", " ", text)
    calls = []
    for number, line in enumerate(joined.splitlines(), start=1):
        line = line.split(" #")[0]
        for match in re.finditer(r"(?:^|[\s;(&|])hf-retrace\s+([^;&|)]*)", line):
            calls.append((number, match.group(1).split()))
    return calls


def test_every_recipe_calls_the_cli():
    assert RECIPES and any(_calls(script) for script in RECIPES)


@pytest.mark.parametrize("script", RECIPES, ids=[s.name for s in RECIPES])
def test_recipe_flags_exist(script):
    for number, words in _calls(script):
        parser, command = build_parser(), ["hf-retrace"]
        while words and _subcommands(parser):
            choices = _subcommands(parser)
            assert words[0] in choices, f"{script.name}: `{' '.join(command)} {words[0]}` is not a command"
            parser, command = choices[words[0]], command + [words.pop(0)]
        known = {option for action in parser._actions for option in action.option_strings}
        flags = [word.split("=")[0] for word in words if word.startswith("--")]
        unknown = [flag for flag in flags if flag not in known]
        assert not unknown, f"{script.name} (joined line {number}): `{' '.join(command)}` has no {unknown}"


STUB = r'''#!/usr/bin/env bash
# a stand-in for the CLI: `data mix` writes 6 new prompts, `data generate` answers its prompt file into --out
cmd="$1 $2"; shift 2
get() { local k=$1; shift; while [ $# -gt 0 ]; do [ "$1" = "$k" ] && { echo "$2"; return; }; shift; done; }
case "$cmd" in
  "data mix") "$PYTHON" -c "
import json, sys, uuid
tag = uuid.uuid4().hex[:8]
open(sys.argv[1], 'w').write(''.join(json.dumps({'id': f'{tag}-{i}', 'prompt': 'x'}) + '\n' for i in range(6)))
" "$(get --out "$@")" ;;
  "data generate") out=$(get --out "$@"); mkdir -p "$out"
    "$PYTHON" -c "
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
open(sys.argv[2], 'w').write(''.join(json.dumps({'id': r['id'], 'prompt': 'x', 'response': 'y', 'finish': 'eos',
                                                   'response_tokens': 100}) + '\n' for r in records))
" "$(get --prompts "$@")" "$out/responses-$(printf %05d "$(ls "$out" | wc -l)").jsonl" ;;
  *) : ;;
esac
'''


def test_the_data_recipe_splits_rounds_over_workers_and_counts_every_folder(tmp_path):
    """examples/make_drafter_data.sh with WORKERS=2 (the CLI stubbed): each round's prompts split over two shard
    folders, the totals counting both; a later WORKERS=1 run still counts the second folder."""
    import os
    import shutil
    import subprocess
    import sys

    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("needs bash")
    (tmp_path / "bin").mkdir()
    stub = tmp_path / "bin" / "hf-retrace"
    stub.write_text(STUB)
    stub.chmod(0o755)
    shared, data = tmp_path / "shared", tmp_path / "data"
    (shared / "target").mkdir(parents=True)
    (shared / "target" / "smollm2-135m-instruct-greedy.jsonl").write_text(
        json.dumps({"id": "s0", "prompt": "p", "response": "r", "finish": "eos", "response_tokens": 5}) + "\n")
    (data / "sources").mkdir(parents=True)
    (data / "prompts").mkdir()
    for name in ("ShareGPT_V3_unfiltered_cleaned_split.json", "HumanEval.jsonl.gz"):
        (data / "sources" / name).write_text("x")
    (data / "prompts" / "code-library.jsonl").write_text("")

    def run(workers: int, answers: int) -> str:
        env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable,
                   PYTHONPATH=str(EXAMPLES.parent), SHARED=str(shared), DATA=str(data), WORKERS=str(workers),
                   TARGET_ANSWERS=str(answers), TARGET_TOKENS="100")
        done = subprocess.run([bash, str(EXAMPLES / "make_drafter_data.sh")], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    out = run(2, 7)
    assert "done: 7 answers, 605 response tokens" in out
    shards = {folder: sorted(p.name for p in (data / folder).glob("responses-*.jsonl"))
              for folder in ("responses", "responses-w1")}
    assert shards == {"responses": ["responses-00000.jsonl"], "responses-w1": ["responses-00000.jsonl"]}
    assert "done: 13 answers, 1205 response tokens" in run(1, 13)  # the second folder still counts
    assert len(list((data / "responses").glob("responses-*.jsonl"))) == 2
