"""The package's modules import each other without circles: every import (at the top of a module, inside a
function, or one only a type checker reads) points one way; and the layers point down: the executors import
nothing from the mechanisms, the mechanisms nothing from the model."""

from __future__ import annotations

import ast
from pathlib import Path

import routeformer

ROOT = Path(routeformer.__file__).parent


def _modules(root: Path) -> dict[str, tuple[Path, list[str]]]:
    """Dotted module name -> (file, the package its relative imports start from)."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[:-1]
        if parts[-1] == "__init__":
            parts = package
        found[".".join(parts)] = (path, package)
    return found


class _Imports(ast.NodeVisitor):
    """The package modules one module imports (type-only imports under ``if TYPE_CHECKING:`` included: a circle
    a type checker must untangle is one a reader must too)."""

    def __init__(self, package: list[str], modules: dict) -> None:
        self.package, self.modules, self.deps = package, modules, set()

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        start = self.package[:len(self.package) - node.level + 1] if node.level else []
        base = ".".join(start + ([node.module] if node.module else []))
        for alias in node.names:
            target = f"{base}.{alias.name}"
            self.deps.add(target if target in self.modules else base)

    def visit_Import(self, node: ast.Import) -> None:
        self.deps.update(alias.name for alias in node.names)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module's set of package modules it imports."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, (path, package) in modules.items():
        visitor = _Imports(package, modules)
        visitor.visit(ast.parse(path.read_text()))
        graph[name] = {d for d in visitor.deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    graph = import_graph(ROOT)
    assert "routeformer.model.generate" in graph["routeformer.model.transformer"]  # the graph sees imports
    assert cycles(graph) == []


def test_the_check_sees_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"
                              "def g():\n    from . import c\n")
    (pkg / "c.py").write_text("from pkg.a import f\n")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.c"]]
    (pkg / "c.py").write_text("")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]  # the type-only import closes one too
    (pkg / "b.py").write_text("def g():\n    pass\n")
    assert cycles(import_graph(pkg)) == []


LAYERS = ["routeformer.checks", "routeformer.executors", "routeformer.attention", "routeformer.model"]


def _layer(module: str) -> int | None:
    return next((i for i, name in enumerate(LAYERS) if module == name or module.startswith(name + ".")), None)


def test_the_layers_import_downwards_only() -> None:
    """checks < executors < attention < model: a module imports from its own layer or those below it."""
    upward = [(a, b) for a, deps in import_graph(ROOT).items() for b in deps
              if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)]
    assert upward == []
