"""The package's import direction, as the README's layout section declares it: a module imports only from lower
layers (or from inside its own subpackage), including imports placed inside functions. Fails on an upward import."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_retrace

PACKAGE = Path(hf_retrace.__file__).parent
# lowest first; the README's line: cli -> training, bench, demo -> export, loading -> generation -> modeling -> retrace
# -> configuration, stats, defaults, side_by_side -> jsonl, sampling
LAYERS = [
    {"jsonl", "sampling"},
    {"configuration", "stats", "defaults", "side_by_side"},
    {"retrace"},
    {"modeling"},
    {"generation"},
    {"export", "loading"},
    {"training", "bench", "demo"},
    {"cli"},
]
RANK = {component: rank for rank, layer in enumerate(LAYERS) for component in layer}


def _component(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imported_components(path: Path) -> set[str]:
    """The package components ``path`` imports (relative or absolute, at module level or inside functions)."""
    package_parts = ["hf_retrace", *path.relative_to(PACKAGE).parent.parts]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                names = [node.module] if node.module else [alias.name for alias in node.names]
                targets = [".".join([*base, *name.split(".")]) for name in names]
            else:
                targets = [node.module or ""]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] == "hf_retrace" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_component_has_a_declared_layer():
    components = {_component(p) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE}
    components -= {"default_drafter"}
    assert components <= set(RANK), f"modules without a layer in this test and the README: {components - set(RANK)}"


def test_no_module_imports_upward_or_sideways():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue  # the package's public surface re-exports the core
        own = _component(path)
        for imported in _imported_components(path) - {own}:
            if RANK.get(imported, -1) >= RANK[own]:
                wrong.append(f"{path.relative_to(PACKAGE)} imports {imported}")
    assert not wrong, "imports against the declared direction:\n" + "\n".join(wrong)


def test_the_checker_sees_function_level_and_relative_imports():
    sample = PACKAGE / "modeling.py"
    assert {"configuration", "retrace", "stats"} <= _imported_components(sample)
    assert "loading" in _imported_components(PACKAGE / "bench" / "runner.py")  # imported inside a function
