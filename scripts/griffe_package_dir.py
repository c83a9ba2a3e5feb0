"""A griffe extension that lays out ``flashckpt`` as installed, for the API reference (mkdocs.yml).

pyproject's ``package-dir`` maps three source folders to one import root: ``flashckpt_core/`` is
``flashckpt``, ``integrations/`` is ``flashckpt.integrations`` and ``patches/`` is ``flashckpt.patches``.
griffe finds ``flashckpt`` through the editable install, but looks for its subpackages only inside
``flashckpt_core/``, so ``::: flashckpt.integrations.hf`` would not resolve. When griffe has loaded
``flashckpt``, this extension reads the mapping from pyproject.toml and loads each other folder, from its
source (statically, nothing imported), as the subpackage the mapping names.

Names a module imports on first use (``__getattr__, __dir__ = lazy_attributes(__name__, {name: module})``,
PEP 562) become aliases to their definitions, as ``from module import name`` would make them. It also
adds what Lightning's adapter sets up at run time: ``flashckpt.integrations.lightning`` imports
its classes on first use (from ``_lightning_classes``, with lightning itself) and their
``__init_subclass__`` gives them their docstring (a module constant) and the public module's name, which
a reading of the source cannot see; ``RUNTIME_CLASSES`` says the same to griffe.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import griffe

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent

# public name -> (the class's definition, the module constant its __init_subclass__ makes its docstring)
RUNTIME_CLASSES = {
    "flashckpt.integrations.lightning.FlashCheckpointIO": (
        "flashckpt.integrations._lightning_classes.FlashCheckpointIO", "flashckpt.integrations._lightning_io._IO_DOC"),
    "flashckpt.integrations.lightning.FlashMemorySnapshot": (
        "flashckpt.integrations._lightning_classes.FlashMemorySnapshot", "flashckpt.integrations.lightning._CB_DOC"),
}


def package_dirs(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Path]:
    """Returns pyproject's ``[tool.setuptools] package-dir``: package name -> source folder."""
    mapping = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def lazy_table(module: griffe.Module) -> dict[str, str]:
    """``{name: absolute module}`` of the literal dict given to ``lazy_attributes`` in ``module``'s source."""
    path = module.filepath
    if not isinstance(path, Path) or path.suffix != ".py":
        return {}
    package = module.path if path.name == "__init__.py" else module.path.rpartition(".")[0]
    table: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_attributes"
                and len(node.args) > 1 and isinstance(node.args[1], ast.Dict)):
            for key, value in zip(node.args[1].keys, node.args[1].values):
                if isinstance(key, ast.Constant) and isinstance(value, ast.Constant):
                    target = str(value.value)
                    table[str(key.value)] = package + target if target.startswith(".") else target
    return table


class PackageDirs(griffe.Extension):
    """Loads a package that pyproject maps from its source folder, with the mapped folders as subpackages."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        dirs = package_dirs()
        if pkg.name not in dirs:
            return
        # griffe has no public call that loads a folder under a given name and parent; _load_module is the
        # one its own loader uses for every module (griffe 1.x and 2.x).
        init = dirs[pkg.name] / "__init__.py"
        if pkg.filepath != init:
            # found by import, or as something else of that name on the search path (the console script
            # .venv/bin/flashckpt when mkdocs runs as a script): load it from its source instead
            pkg = loader._load_module(pkg.name, init, submodules=True)
        for name, folder in sorted(dirs.items()):
            parent_path, _, last = name.rpartition(".")
            if parent_path.split(".")[0] != pkg.name:
                continue
            parent = loader.modules_collection.get_member(parent_path)
            parent.set_member(last, loader._load_module(last, folder / "__init__.py", submodules=True, parent=parent))
        loader.expand_exports(pkg)
        loader.expand_wildcards(pkg, external=False)
        self._lazy_names(pkg)
        for public, (target, doc) in RUNTIME_CLASSES.items():
            if public.split(".")[0] == pkg.name:
                self._runtime_class(loader, public, target, doc)

    def _lazy_names(self, module: griffe.Module) -> None:
        """Adds the names of ``module``'s (and its submodules') ``lazy_attributes`` tables as aliases."""
        for name, target in lazy_table(module).items():
            if name not in module.members:
                module.set_member(name, griffe.Alias(name, f"{target}.{name}", parent=module))
        for member in list(module.members.values()):
            if isinstance(member, griffe.Module):
                self._lazy_names(member)

    @staticmethod
    def _runtime_class(loader: griffe.GriffeLoader, public: str, target: str, doc: str) -> None:
        """Gives class ``target`` the docstring held by constant ``doc`` and names it ``public``."""
        cls = loader.modules_collection.get_member(target)
        value = loader.modules_collection.get_member(doc).value
        cls.docstring = griffe.Docstring(ast.literal_eval(str(value)), parent=cls, parser=loader.docstring_parser,
                                         parser_options=loader.docstring_options)
        module_path, _, name = public.rpartition(".")
        module = loader.modules_collection.get_member(module_path)
        module.set_member(name, griffe.Alias(name, target, parent=module))
