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


# The packages in layers, lowest first: a module imports from its own package or from a lower layer, never from a
# higher one nor sideways (from another package of its own layer). "" is the package's own __init__.
LAYERS = [
    ("checks", "documents", "durable", "hugepages", "lengths"),
    ("executors", "data"),
    ("attention",),
    ("model",),
    ("train", "testing", ""),
    ("analysis", "bench"),
    ("cli",),
    ("__main__",),
]


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(package: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if package in names)


def against_the_layers(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import (module, what it imports) that points up a layer or sideways to another package of its layer."""
    return sorted((a, b) for a, deps in graph.items() for b in deps
                  if _package(a) != _package(b) and _layer(_package(b)) >= _layer(_package(a)))


def test_the_layers_import_downwards_only() -> None:
    """checks, documents, durable, hugepages, lengths < executors, data < attention < model < train, testing <
    analysis, bench < cli: every package of the source is in a layer, and a module imports from its own package or those
    below."""
    graph = import_graph(ROOT)
    unplaced = sorted({_package(m) for m in graph} - {p for names in LAYERS for p in names})
    assert unplaced == [], f"packages in no layer (add them to LAYERS): {unplaced}"
    assert against_the_layers(graph) == []


def test_the_layer_check_sees_an_upward_and_a_sideways_import() -> None:
    graph = {"routeformer.train.loop": {"routeformer.bench.text", "routeformer.model.config"},
             "routeformer.bench.text": {"routeformer.analysis.run", "routeformer.bench.measure"},
             "routeformer.executors.ranges": {"routeformer.executors.tiles.op"}}
    assert against_the_layers(graph) == [("routeformer.bench.text", "routeformer.analysis.run"),
                                          ("routeformer.train.loop", "routeformer.bench.text")]


BACKENDS = ("routeformer.executors.fused", "routeformer.executors.tiles", "routeformer.executors.flex")
# The executor module that reaches the backends: the registry (the activation goes through the executor, as the
# attention does).
FRONTS = {"routeformer.executors.interface"}


def test_a_backend_imports_no_other_backend_and_shared_modules_none() -> None:
    """What the backends share lives in the neutral executor modules (rows, lse, inputs ...): a backend imports no
    other backend, and the neutral modules none, but the registry."""
    graph = import_graph(ROOT)

    def backend(module: str) -> str | None:
        return next((b for b in BACKENDS if module == b or module.startswith(b + ".")), None)

    crossing = sorted((a, b) for a, deps in graph.items() for b in deps
                      if a.startswith("routeformer.executors") and backend(b) is not None
                      and backend(a) != backend(b) and a not in FRONTS)
    assert crossing == []
