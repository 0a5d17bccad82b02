"""The quick subset (``-m "not slow"``) is defined by the lists in ``conftest.py``: every module, test and fixture they
name must exist, or a renamed test would silently fall back into the quick subset (or out of it)."""

from __future__ import annotations

import ast
from pathlib import Path

import conftest

TESTS = Path(__file__).parent


def _definitions(module: str) -> tuple[set[str], set[str]]:
    """(test function names, fixture names) defined in ``module``."""
    tree = ast.parse((TESTS / module).read_text())
    tests, fixtures = set(), set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            if node.name.startswith("test_"):
                tests.add(node.name)
            if any("fixture" in ast.unparse(d) for d in node.decorator_list):
                fixtures.add(node.name)
    return tests, fixtures


def test_every_slow_module_test_and_fixture_named_in_conftest_exists():
    missing = [m for m in conftest.SLOW_MODULES if not (TESTS / m).is_file()]
    for module, names in conftest.SLOW_TESTS.items():
        missing += [f"{module}::{n}" for n in names - _definitions(module)[0]]
    for module, names in conftest.SLOW_FIXTURES.items():
        missing += [f"{module} fixture {n}" for n in names - _definitions(module)[1]]
    for module, name in conftest.CASE_SUITES.items():
        missing += [f"{module}::{name}"] if name not in _definitions(module)[0] else []
    assert not missing, f"conftest.py names what does not exist (renamed?): {missing}"
