"""Code prompts with a clean licence: Python functions with docstrings, rendered as HumanEval-style problems.

Each public module-level function of the standard library and of the installed distributions whose licence is
permissive becomes ``imports + def signature + docstring``, as HumanEval's ``prompt`` field is written, wrapped in the
benchmark's instruction (:func:`hf_retrace.chat.humaneval_prompt`). Sources are read with :mod:`ast` (nothing is
imported, so no import side effects). Private names, tests, ``@overload`` stubs, functions without named parameters
and functions with a trivial docstring are skipped; prompts are deduplicated by normalized signature + docstring (and by the
docstring alone), and any whose name or docstring is a benchmark problem's (``excluded``) is left out.

Example::

    excluded = benchmark_exclusions(["HumanEval.jsonl.gz"])
    prompts = collect_code_prompts(excluded=excluded)
    prompts[0].record()  # {"id": "code:json.dumps", "prompt": "Write a solution ...", "package": "python", ...}
"""

from __future__ import annotations

import ast
import copy
import gzip
import importlib.metadata
import inspect
import json
import logging
import os
import re
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...atomic import atomic_path
from ...chat import humaneval_prompt

logger = logging.getLogger(__name__)


STDLIB_LICENCE = "PSF-2.0"
_PERMISSIVE = re.compile(
    r"\b(MIT|BSD|0BSD|Apache|ASL ?2|PSF|Python Software Foundation|ISC|Zlib|Unlicense|CC0|Public Domain|HPND|"
    r"BSL-1\.0|CNRI-Python|MIT-CMU|MIT-0)\b",
    re.IGNORECASE,
)
_COPYLEFT = re.compile(r"\b(A?GPL|LGPL|MPL|EPL|CDDL|EUPL|copyleft)", re.IGNORECASE)  # GPLv3, MPL-2.0 too
_TEST_PARTS = {"test", "tests", "testing", "conftest.py", "idle_test", "testsuite"}
_SKIPPED_STDLIB_PARTS = {"site-packages", "dist-packages", "idlelib", "turtledemo", "lib2to3", "ensurepip",
                         "pydoc_data"}


@dataclass(frozen=True)
class CodePrompt:
    """One function as a HumanEval-style problem: ``code`` is the ``prompt`` field, ``prompt`` the instruction."""

    id: str
    code: str
    entry_point: str
    docstring: str
    module: str
    package: str
    licence: str

    @property
    def prompt(self) -> str:
        return humaneval_prompt(self.code)

    def record(self) -> dict[str, Any]:
        """The JSONL record (``prompt`` is what the target is asked; the rest says where it came from)."""
        return {"id": self.id, "source": "code", "prompt": self.prompt, "code": self.code,
                "entry_point": self.entry_point, "module": self.module, "package": self.package,
                "licence": self.licence}


@dataclass(frozen=True)
class Exclusions:
    """Benchmark problems no prompt may repeat: their function names and normalized docstrings."""

    names: frozenset[str] = frozenset()
    docstrings: frozenset[str] = frozenset()

    def excludes(self, name: str, docstring: str) -> bool:
        normalized = normalize_text(docstring)
        return name in self.names or any(doc in normalized or normalized in doc for doc in self.docstrings)


# ---------------------------------------------------------------------------------------------------------------
# licences
# ---------------------------------------------------------------------------------------------------------------


def licence_of(metadata: Any) -> str:
    """A distribution's licence in a few words: ``License-Expression``, else a short ``License``, else classifiers."""
    expression = (metadata.get("License-Expression") or "").strip()
    if expression:
        return expression
    text = (metadata.get("License") or "").strip()
    classifiers = [c.split("::")[-1].strip() for c in metadata.get_all("Classifier") or [] if c.startswith("License")]
    short = text if text and len(text) <= 100 and "\n" not in text else ""  # long ones are the licence's full text
    return "; ".join(part for part in [short, *classifiers] if part and part.upper() != "UNKNOWN")


def is_permissive(licence: str) -> bool:
    """Whether a licence string names only permissive licences (MIT, BSD, Apache, PSF, ISC, ...); any copyleft
    licence (GPL, LGPL, MPL, ...) or an unknown one is not."""
    return bool(_PERMISSIVE.search(licence)) and not _COPYLEFT.search(licence)


# ---------------------------------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceFile:
    """A Python file to read, its dotted module name, and the package and licence it comes from."""

    path: Path
    module: str
    package: str
    licence: str


def _is_public_module(parts: tuple[str, ...]) -> bool:
    """No private component (``_vendor``, ``_internal``; ``__init__`` is fine) and no test folder or file."""
    for part in parts:
        stem = part.removesuffix(".py")
        if part in _TEST_PARTS or stem.startswith("test_") or stem.endswith("_test") or stem == "tests":
            return False
        if stem.startswith("_") and stem != "__init__":
            return False
    return all(part.isidentifier() for part in (p.removesuffix(".py") for p in parts))


def _module_name(parts: tuple[str, ...]) -> str:
    names = [part.removesuffix(".py") for part in parts]
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


def stdlib_sources() -> Iterator[SourceFile]:
    """The standard library's public pure-Python modules (tests, IDLE, demos and bundled wheels left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if _SKIPPED_STDLIB_PARTS.intersection(parts) or not _is_public_module(parts):
            continue
        yield SourceFile(path, _module_name(parts), "python", STDLIB_LICENCE)


def distribution_sources(skip: Iterable[str] = ()) -> Iterator[SourceFile]:
    """Public ``.py`` files of installed distributions whose licence :func:`is_permissive`, found through their
    ``RECORD`` (nothing is imported). Distributions named in ``skip`` and those without a permissive licence are
    left out (logged)."""
    skipped = {name.lower().replace("_", "-") for name in skip}
    seen: set[str] = set()
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"].lower()):
        name = dist.metadata["Name"]
        key = name.lower().replace("_", "-")
        if key in skipped or key in seen:
            continue
        seen.add(key)
        licence = licence_of(dist.metadata)
        if not is_permissive(licence):
            logger.info("skipping %s: licence %r is not known to be permissive", name, licence)
            continue
        for file in sorted(dist.files or [], key=str):
            parts = Path(str(file)).parts
            if not str(file).endswith(".py") or ".." in parts or (parts and parts[0].endswith((".data", "-info"))):
                continue
            if _is_public_module(parts):
                yield SourceFile(Path(str(dist.locate_file(file))), _module_name(parts), name, licence)


# ---------------------------------------------------------------------------------------------------------------
# one function -> one prompt
# ---------------------------------------------------------------------------------------------------------------


def normalize_text(text: str) -> str:
    """Lower case, runs of whitespace collapsed: the key that makes two docstrings or signatures the same."""
    return " ".join(text.lower().split())


def _referenced_names(function: ast.FunctionDef) -> set[str]:
    """Names the signature needs: in annotations (string annotations parsed too) and defaults; ``a.b`` gives ``a``."""
    args = function.args
    parameters = [a for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a]
    annotations = [a.annotation for a in parameters if a.annotation] + ([function.returns] if function.returns else [])
    defaults = [*args.defaults, *(d for d in args.kw_defaults if d is not None)]
    names = {n.id for node in [*annotations, *defaults] for n in ast.walk(node) if isinstance(n, ast.Name)}
    for node in annotations:  # "Tensor", "list[Path]": string annotations name types too
        for sub in ast.walk(node):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                try:
                    names |= {n.id for n in ast.walk(ast.parse(sub.value, mode="eval")) if isinstance(n, ast.Name)}
                except SyntaxError:
                    pass
    return names


def _absolute_module(module: str | None, level: int, here: str, is_package: bool) -> str | None:
    """The absolute module of ``from <level dots><module> import ...`` written in module ``here``."""
    if not level:
        return module
    package = here.split(".") if is_package else here.split(".")[:-1]
    if level - 1 >= len(package):
        return None
    return ".".join([*package[: len(package) - (level - 1)], *([module] if module else [])])


Binding = tuple[str | None, str, str | None]
"""How a module binds a name: ``(from-module or None for a plain import, imported name, as-name or None)``."""


def _module_bindings(tree: ast.Module, module: str, is_package: bool) -> dict[str, Binding]:
    """Name -> how it is imported, for imports at module level (``if TYPE_CHECKING:`` and ``try:`` included), and
    ``from <module> import name`` for the module's own top-level classes, functions and constants."""
    bindings: dict[str, Binding] = {}
    statements = list(tree.body)
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)):
            statements += [*node.body, *node.orelse]
    for node in statements:
        if isinstance(node, ast.Import):
            for alias in node.names:
                bindings.setdefault(alias.asname or alias.name.split(".")[0], (None, alias.name, alias.asname))
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            source = _absolute_module(node.module, node.level, module, is_package)
            for alias in node.names:
                if source is not None and alias.name != "*":
                    bindings.setdefault(alias.asname or alias.name, (source, alias.name, alias.asname))
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            bindings.setdefault(node.name, (module, node.name, None))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    bindings.setdefault(target.id, (module, target.id, None))
    return bindings


def _import_lines(bindings: Iterable[Binding]) -> list[str]:
    """``import a`` lines, then one ``from m import x, y as z`` line per module, sorted."""
    def named(name: str, asname: str | None) -> str:
        return f"{name} as {asname}" if asname else name

    bindings = list(bindings)
    plain = sorted({f"import {named(name, asname)}" for source, name, asname in bindings if source is None})
    grouped: dict[str, set[str]] = {}
    for source, name, asname in bindings:
        if source is not None:
            grouped.setdefault(source, set()).add(named(name, asname))
    return plain + [f"from {source} import {', '.join(sorted(names))}" for source, names in sorted(grouped.items())]


def _signature(function: ast.FunctionDef) -> str:
    """``def name(args) -> ret:`` without decorators, as :func:`ast.unparse` writes it (one line)."""
    bare = copy.copy(function)
    bare.decorator_list, bare.body = [], [ast.Pass()]
    return ast.unparse(bare).split("\n", 1)[0]


def _docstring_block(docstring: str) -> str:
    """The docstring as HumanEval writes it: four spaces, triple quotes, each line indented, closing quotes alone."""
    lines = docstring.replace("\\", "\\\\").split("\n")
    body = "\n".join("    " + line if line.strip() else "" for line in lines)
    return f'    """ {body.lstrip()}\n    """\n'


def _is_overload(function: ast.FunctionDef) -> bool:
    for decorator in function.decorator_list:
        name = decorator.attr if isinstance(decorator, ast.Attribute) else getattr(decorator, "id", "")
        if name == "overload":
            return True
    return False


def _has_named_parameters(function: ast.FunctionDef) -> bool:
    args = function.args
    return bool(args.posonlyargs or args.args or args.kwonlyargs)


def render_function(function: ast.FunctionDef, bindings: dict[str, Binding]) -> str:
    """HumanEval's ``prompt`` field for one function: the imports its signature needs, two blank lines, the
    signature, the docstring."""
    imports = _import_lines(bindings[name] for name in _referenced_names(function) if name in bindings)
    head = "\n".join(imports) + "\n\n\n" if imports else ""
    return head + _signature(function) + "\n" + _docstring_block(inspect.cleandoc(ast.get_docstring(function) or ""))


def _docstring_is_substantial(docstring: str, min_words: int, max_chars: int) -> bool:
    return len(docstring.split()) >= min_words and len(docstring) <= max_chars and '"""' not in docstring


def prompts_from_source(source: SourceFile, *, min_words: int = 12, max_chars: int = 1500) -> Iterator[CodePrompt]:
    """The code prompts of one file: its public module-level functions with a substantial docstring and named
    parameters (``@overload`` stubs skipped). A file that does not parse is skipped."""
    try:
        tree = ast.parse(source.path.read_text(encoding="utf-8"), str(source.path))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError) as exc:
        logger.info("skipping %s: %s", source.path, exc)
        return
    bindings: dict[str, Binding] | None = None
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or _is_overload(node):
            continue
        docstring = inspect.cleandoc(ast.get_docstring(node, clean=False) or "")
        if not _has_named_parameters(node) or not _docstring_is_substantial(docstring, min_words, max_chars):
            continue
        if bindings is None:
            bindings = _module_bindings(tree, source.module, source.path.name == "__init__.py")
        yield CodePrompt(id=f"code:{source.module}.{node.name}", code=render_function(node, bindings),
                         entry_point=node.name, docstring=docstring, module=source.module, package=source.package,
                         licence=source.licence)


def dedup_key(prompt: CodePrompt) -> str:
    """Normalized signature + docstring (imports left out): two prompts with the same key ask the same question."""
    return normalize_text(prompt.code[re.search(r"^def ", prompt.code, re.MULTILINE).start():])


def collect_code_prompts(
    sources: Iterable[SourceFile] | None = None,
    *,
    excluded: Exclusions = Exclusions(),
    min_words: int = 12,
    max_chars: int = 1500,
) -> list[CodePrompt]:
    """Distinct code prompts from ``sources`` (default: the standard library, then every installed distribution
    with a permissive licence, this package excluded), in source order.

    A prompt is dropped when its normalized signature + docstring, or its docstring alone, was seen before, or when
    ``excluded`` names its function or holds its docstring.
    """
    if sources is None:
        sources = [*stdlib_sources(), *distribution_sources(skip=["hf-retrace"])]
    prompts: list[CodePrompt] = []
    seen_keys: set[str] = set()
    seen_ids: set[str] = set()
    for source in sources:
        for prompt in prompts_from_source(source, min_words=min_words, max_chars=max_chars):
            keys = {dedup_key(prompt), normalize_text(prompt.docstring)}
            if keys & seen_keys or prompt.id in seen_ids or excluded.excludes(prompt.entry_point, prompt.docstring):
                continue
            seen_keys |= keys
            seen_ids.add(prompt.id)
            prompts.append(prompt)
    return prompts


# ---------------------------------------------------------------------------------------------------------------
# benchmark problems to stay away from
# ---------------------------------------------------------------------------------------------------------------


def _benchmark_records(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def _problem_code(record: dict[str, Any]) -> str:
    """The Python code of a benchmark record: HumanEval's ``prompt``, or the code block of a formatted prompt."""
    text = str(record.get("prompt", ""))
    block = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    return block.group(1) if block else text


def benchmark_exclusions(paths: Iterable[str | os.PathLike[str]]) -> Exclusions:
    """Function names and docstrings of benchmark problems (JSONL or ``.jsonl.gz`` with a ``prompt`` holding
    Python code, HumanEval's layout; ``entry_point`` when present). Every function defined in a problem counts."""
    names: set[str] = set()
    docstrings: set[str] = set()
    for path in map(Path, paths):
        for record in _benchmark_records(path):
            if record.get("entry_point"):
                names.add(str(record["entry_point"]))
            try:
                tree = ast.parse(_problem_code(record))
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                    docstring = ast.get_docstring(node)
                    if docstring and len(docstring.split()) >= 4:
                        docstrings.add(normalize_text(docstring))
    if not names:
        raise ValueError(f"No benchmark problems found in {list(map(str, paths))}; expected JSONL with a `prompt` "
                         "holding Python code (HumanEval's layout).")
    return Exclusions(frozenset(names), frozenset(docstrings))


def write_code_prompts(prompts: Iterable[CodePrompt], out: str | os.PathLike[str]) -> dict[str, Any]:
    """Write the prompts as JSONL (atomically); return counts by package and licence."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    by_package: dict[str, int] = {}
    licences: dict[str, str] = {}
    with atomic_path(out) as temporary, temporary.open("w", encoding="utf-8") as handle:
        for prompt in prompts:
            handle.write(json.dumps(prompt.record(), ensure_ascii=False) + "\n")
            by_package[prompt.package] = by_package.get(prompt.package, 0) + 1
            licences[prompt.package] = prompt.licence
    return {"num_prompts": sum(by_package.values()), "by_package": by_package, "licences": licences,
            "python": sys.version.split()[0]}
