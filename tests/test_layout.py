"""The package's import direction, as the README's layout section declares it: a module imports only from lower
layers (or from inside its own subpackage), including imports placed inside functions. Fails on an upward import,
and on any import circle between modules (inside a subpackage too, ``TYPE_CHECKING`` and function-level imports
included)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import hf_retrace

PACKAGE = Path(hf_retrace.__file__).parent
# lowest first; the README's line: cli -> training, bench, demo -> export, loading, side_by_side -> tuning -> generation
# -> modeling -> retrace, layers -> configuration, stats, defaults -> jsonl, sampling, divergence, chat, machine, atomic
LAYERS = [
    {"jsonl", "sampling", "divergence", "chat", "machine", "atomic"},
    {"configuration", "stats", "defaults"},
    {"retrace", "layers"},
    {"modeling"},
    {"generation"},
    {"tuning"},
    {"export", "loading", "side_by_side"},
    {"training", "bench", "demo"},
    {"cli"},
]
RANK = {component: rank for rank, layer in enumerate(LAYERS) for component in layer}


def _component(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _import_statements(path: Path, source: str | None = None) -> Iterator[tuple[str, list[str]]]:
    """``(module, names)`` for every import in ``path`` (or ``source`` read as that file): ``from module import
    names``, ``import module`` (no names); relative modules made absolute; at module level, under ``TYPE_CHECKING`` or
    inside functions alike."""
    package_parts = ["hf_retrace", *path.relative_to(PACKAGE).parent.parts]
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package_parts[: len(package_parts) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            yield module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


def _imported_components(path: Path) -> set[str]:
    """The package components ``path`` imports (relative or absolute, at module level or inside functions)."""
    found = set()
    for module, names in _import_statements(path):
        parts = module.split(".")
        if parts[0] != "hf_retrace":
            continue
        if len(parts) > 1:
            found.add(parts[1])
        elif module == "hf_retrace":  # `from hf_retrace import x`, `from .. import x` at the top of a subpackage
            found.update(name for name in names if f"hf_retrace.{name}" in MODULES)
    return found


def _module_name(path: Path) -> str:
    parts = ["hf_retrace", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imported_modules(path: Path, source: str | None = None) -> set[str]:
    """The package's modules ``path`` imports: ``from a import b`` imports ``a.b`` when that is a module, else ``a``."""
    found = set()
    for module, names in _import_statements(path, source):
        submodules = {f"{module}.{name}" for name in names if f"{module}.{name}" in MODULES}
        found |= submodules
        if len(submodules) < len(names) or not names:
            found.add(module)
    return (found & set(MODULES)) - {_module_name(path)}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle ``[a, b, ..., a]`` per group of modules that import each other (a strongly connected component of
    ``graph``, module -> the modules it imports, with more than one member)."""
    order, low, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(node: str) -> None:  # Tarjan's algorithm
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = set()
            while node not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return [_circle_through(graph, group) for group in groups]


def _circle_through(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"{sorted(group)} is not a circle")


def test_every_component_has_a_declared_layer():
    components = {_component(p) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE}
    components -= {"default_drafter"}
    assert components <= set(RANK), f"modules without a layer in this test and the README: {components - set(RANK)}"


def test_the_readme_layout_declares_these_layers_and_names_every_component():
    """README's layout section is the tree's: its "Imports flow" line is LAYERS (highest first), and its block names
    every module and subpackage of the package."""
    readme = (PACKAGE.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    flow = " ".join(section.split("Imports flow `", 1)[1].split("`", 1)[0].split())
    declared = [{name.strip() for name in group.split(",")} for group in flow.split("->")]
    assert declared == LAYERS[::-1], f"README's import flow {declared} is not this test's {LAYERS[::-1]}"
    block = section.split("```", 2)[1]
    names = {p.name if p.is_dir() else p.stem for p in PACKAGE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")}
    missing = sorted(n for n in names - {"default_drafter"} if f"{n}.py" not in block and f"{n}/" not in block)
    assert not missing, f"README's layout block does not name {missing}"


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


def test_no_import_circle():
    graph = {name: _imported_modules(path) for name, path in MODULES.items()}
    circles = [" -> ".join(circle) for circle in import_circles(graph)]
    assert not circles, "modules that import each other (directly or through others):\n" + "\n".join(circles)


def test_the_circle_finder_finds_circles_and_only_circles():
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_circles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    assert len(import_circles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}})) == 2


def test_the_circle_checker_sees_type_checking_function_level_and_submodule_imports():
    source = (
        "import torch\nfrom typing import TYPE_CHECKING\nfrom .. import loading\n"
        "if TYPE_CHECKING:\n    from .precomputed_features import PrecomputedFeatures\n"
        "def f():\n    from . import features\n    from .feature_dataset import FeatureDataset\n"
    )
    assert _imported_modules(PACKAGE / "training" / "feature_dataset.py", source) == {
        "hf_retrace.loading", "hf_retrace.training.precomputed_features", "hf_retrace.training.features"
    }  # only the package's modules, never the file itself
