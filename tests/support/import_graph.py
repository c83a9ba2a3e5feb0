"""The import graph of the installed flashckpt package, read from its sources with ``ast``.

Every module of ``flashckpt`` (the ``flashckpt_core/`` folder), ``flashckpt.integrations`` and
``flashckpt.patches`` is a node; an edge ``a -> b`` is an import of ``b`` anywhere in ``a``: at the top, inside
functions and classes, under ``if TYPE_CHECKING:`` (a type named by a lower layer is still knowledge of the
higher one: mypy follows it, and so does a reader), and in a ``lazy_attributes`` table (a module's
names imported on first use). ``from pkg import name`` is an import of ``pkg.name`` when that is a module,
else of ``pkg``; an import of a package's ``__init__`` is an edge to the package. Imports of anything outside
flashckpt are left out. Nothing is imported: the sources are parsed where the installed package finds them.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Import", "ROOTS", "modules", "imports_of", "graph", "cycles"]

#: the import names whose modules make up the graph
ROOTS = ("flashckpt", "flashckpt.integrations", "flashckpt.patches")


@dataclass(frozen=True, order=True)
class Import:
    """One import in ``module`` (at ``line``) of the flashckpt module ``target``."""

    module: str
    target: str
    line: int
    typing_only: bool = False

    def __str__(self) -> str:
        return f"{self.module} (line {self.line}) imports {self.target}" + (" under TYPE_CHECKING" if self.typing_only
                                                                           else "")


def _folder(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{package} is not an installed package")
    return Path(next(iter(spec.submodule_search_locations)))


def modules() -> dict[str, Path]:
    """Every module of the graph: its dotted name -> its source file."""
    out: dict[str, Path] = {}
    folders = {pkg: _folder(pkg) for pkg in ROOTS}
    for pkg, base in folders.items():
        for path in sorted(base.rglob("*.py")):
            if any(path.is_relative_to(other) for o, other in folders.items() if o != pkg and o.startswith(pkg + ".")):
                continue  # a sub-root's folder inside this one (not the case when installed from the tree)
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([pkg, *parts])] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _absolute(package: str, name: str, level: int) -> str:
    if not level:
        return name
    base = package.split(".")
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(name: str, path: Path, known: set[str]) -> list[Import]:
    """The imports of flashckpt modules in module ``name`` (source ``path``); ``known``: every module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def add(target: str, line: int, typing_only: bool) -> None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.append(Import(name, target, line, typing_only))

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, typing_only)
        elif isinstance(node, ast.ImportFrom):
            mod = _absolute(package, node.module or "", node.level)
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                add(sub if sub in known else mod, node.lineno, typing_only)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == \
                "lazy_attributes" and len(node.args) > 1 and isinstance(node.args[1], ast.Dict):
            for value in node.args[1].values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    target = value.value
                    level = len(target) - len(target.lstrip("."))
                    add(_absolute(package, target.lstrip("."), level), node.lineno, typing_only)
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(ast.parse(path.read_text(), str(path)), False)
    return sorted(set(found))


def graph() -> dict[str, list[Import]]:
    """Every module -> its imports of flashckpt modules."""
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(g: dict[str, list[Import]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    succ = {v: sorted({i.target for i in edges}) for v, edges in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on.add(v)
            ws = succ.get(v, [])
            if i < len(ws):
                work.append((v, i + 1))
                w = ws[i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            for w in ws:  # children done: take their low links
                if w in on:
                    low[v] = min(low[v], low[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out
