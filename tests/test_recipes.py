"""The shell recipes under examples/ call `hf-retrace` with flags the CLI has: a renamed flag fails here, not hours
into a background run."""

from __future__ import annotations

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
