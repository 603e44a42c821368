"""Functions take values, not long lists of parameters: no function of the package takes more than 8 named
parameters (self / cls, *args and **kwargs not counted), except the custom operators' and Triton kernels'
signatures (they mirror the operators' schemas, the kernels' pointers and sizes) and the functions listed in
``OVER`` with the count they have today. The list may only shrink: a listed function may not grow, and one brought
to 8 or fewer must leave it."""

from __future__ import annotations

import ast
from pathlib import Path

import routeformer

ROOT = Path(routeformer.__file__).parent
MOST = 8
# What is left over 8 (issues 34, 44): nothing. The public attention functions take f(inputs, options, executor, *,
# causal, rel) since issue 44. Keep it empty.
OVER: dict[str, int] = {}
# custom operators' registrations, and Triton kernels (their signatures are the kernel's pointers and sizes)
OPERATOR = ("custom_op", "register_fake", "register_kernel", "register_autograd", "triton.jit")


def _named(args: ast.arguments) -> int:
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    return len([n for n in names if n not in ("self", "cls", "ctx")])


def _is_operator(node: ast.FunctionDef, parent: ast.AST | None) -> bool:
    """A custom operator's signature: registered through torch.library, or an autograd.Function's forward /
    backward."""
    if any(word in ast.unparse(d) for d in node.decorator_list for word in OPERATOR):
        return True
    return (isinstance(parent, ast.ClassDef) and node.name in ("forward", "backward")
            and any("Function" in ast.unparse(b) for b in parent.bases))


def parameter_counts(root: Path) -> dict[str, int]:
    """'path:Qualified.name' -> named parameters, for every function over ``MOST`` that is not an operator's."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str, parent: ast.AST | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", child)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count = _named(child.args)
                if count > MOST and not _is_operator(child, parent):
                    found[f"{prefix}{child.name}"] = count
                visit(child, f"{prefix}{child.name}.<locals>.", None)
            else:
                visit(child, prefix, parent)

    for path in sorted(root.rglob("*.py")):
        visit(ast.parse(path.read_text()), f"{path.relative_to(root).as_posix()}:", None)
    return found


def test_no_function_takes_more_parameters_than_it_did() -> None:
    found = parameter_counts(ROOT)
    new = {name: n for name, n in found.items() if name not in OVER}
    grown = {name: (OVER[name], n) for name, n in found.items() if name in OVER and n > OVER[name]}
    assert new == {}, f"functions over {MOST} named parameters: pass values (see executors.Inputs): {new}"
    assert grown == {}, f"functions that grew (listed count, now): {grown}"
    gone = sorted(set(OVER) - set(found))
    assert gone == [], f"brought to {MOST} or fewer (or renamed): take them off OVER: {gone}"


def test_the_count_sees_operators_and_long_signatures(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "import torch\n"
        "def long(a, b, c, d, e, f, g, h, i, *args, **kwargs): pass\n"
        "def short(self, a, b, c, d, e, f, g, h): pass\n"
        "@torch.library.register_fake('x::y')\n"
        "def _(a, b, c, d, e, f, g, h, i): pass\n"
        "class F(torch.autograd.Function):\n"
        "    @staticmethod\n"
        "    def forward(ctx, a, b, c, d, e, f, g, h, i): pass\n"
        "class M:\n"
        "    def __init__(self, a, b, c, d, e, f, g, h, i): pass\n")
    assert parameter_counts(pkg) == {"a.py:long": 9, "a.py:M.__init__": 9}
