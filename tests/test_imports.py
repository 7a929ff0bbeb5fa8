"""The import graph of ``seqgen_cli`` has no circle: every import, read from the source with ``ast``: at module
level (``if TYPE_CHECKING:`` ones too) and inside functions (the lazy ones: deferring an import does not make an
arrow that runs back up any less of one)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "seqgen_cli"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.Module, package: str) -> set[str]:
    """Names a module imports anywhere (top level, ``if``/``try`` blocks, functions): ``a.b`` and, for ``from a
    import b``, ``a`` and ``a.b`` (``b`` may be a module)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imports = imported_names(ast.parse(path.read_text(encoding="utf-8")), package)
        graph[name] = {m for m in imports if m in files and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_imports_form_no_circle() -> None:
    graph = import_graph()
    assert "seqgen_cli.pipeline.job" in graph and graph["seqgen_cli.pipeline.job"]  # the graph was read
    assert circles(graph) == []


# The floors, top to bottom (docs/ARCHITECTURE.md): a module imports only from its own floor and the ones below.
# A module not named here (by its first name under seqgen_cli) is on the ground floor.
FLOORS = {
    "cli": 0,
    "cli_options": 0,
    "__main__": 0,
    "pipeline": 1,
    "bench": 1,
    "generator": 2,
    "verify": 2,
    "loading": 3,
    "config": 3,
    "memory": 3,
    "models": 4,
    "search": 5,
}
GROUND = max(FLOORS.values()) + 1


def floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS.get(parts[1], GROUND) if len(parts) > 1 else GROUND


def arrows_up(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a in graph for b in graph[a] if floor(b) < floor(a))


def test_nothing_imports_a_floor_above_its_own() -> None:
    graph = import_graph()
    assert "seqgen_cli.models.capture" in graph and graph["seqgen_cli.models.capture"]  # the graph was read
    assert arrows_up(graph) == []


def test_an_arrow_up_is_found() -> None:
    graph = {"seqgen_cli.models.capture": {"seqgen_cli.memory"}, "seqgen_cli.memory": {"seqgen_cli.budget"}}
    assert arrows_up(graph) == [("seqgen_cli.models.capture", "seqgen_cli.memory")]


def test_a_circle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_type_checking_relative_and_function_level_imports_count() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .job import Job\n")
    assert "seqgen_cli.pipeline.job" in imported_names(tree, "seqgen_cli.pipeline")
    inner = ast.parse("def f():\n    import seqgen_cli.pipeline.job\n")
    assert imported_names(inner, "seqgen_cli") == {"seqgen_cli.pipeline.job"}


def _longest(path: Path, kinds: tuple[type, ...]) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree) if isinstance(n, kinds)]


def test_every_search_function_fits_a_screen() -> None:
    """The decode loops stay a set of named helpers: no function in search/ over 60 lines."""
    long = [
        (p.name, name, n)
        for p in sorted((PACKAGE / "search").glob("*.py"))
        for name, n in _longest(p, (ast.FunctionDef,))
        if n > 60
    ]
    assert not long, long


def test_no_class_outgrows_a_reading() -> None:
    """Every module of the package, models/ included: no class over 250 lines, no file over 600 (split what
    grows)."""
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 80 and any(p.parent.name == "models" for p in files)
    big = [(p.name, name, n) for p in files for name, n in _longest(p, (ast.ClassDef,)) if n > 250]
    assert not big, big
    long = [(p.name, n) for p in files if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600]
    assert not long, long


def test_no_size_is_met_by_packing_lines() -> None:
    """A size cap is met by splitting, never by packing lines under ``# fmt: skip`` (ruff format lays out what
    ruff formats)."""
    packed = [
        f"{p.relative_to(PACKAGE)}:{i}"
        for p in sorted(PACKAGE.rglob("*.py"))
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert not packed, packed
