"""The layers of flashckpt: no import cycle between modules, and no import from a lower room to a higher one.

The graph (``tests/support/import_graph.py``) is built with ``ast`` from the installed package's sources:
imports inside functions count, and so do imports under ``if TYPE_CHECKING:`` (a lower layer that names a
higher layer's type depends on it: mypy follows the import, and a reader must know the higher layer).

``ROOMS`` is the architecture: a module's room comes from its package (``ROOM_OF``), and a room may import
only itself and the rooms listed for it. Bottom to top: the leaf (errors, config, util) < format < storage <
commit < transport < memory < engine; the saver (the daemon side) stands beside the engine, on memory;
launch above both; the CLI and the package's ``__init__`` on top; the adapters (integrations, then patches)
over the whole core.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
from import_graph import Import, cycles, graph, imports_of

LEAF = ("leaf",)
FORMAT = LEAF + ("format",)
STORAGE = FORMAT + ("storage",)
COMMIT = STORAGE + ("commit",)
TRANSPORT = COMMIT + ("transport",)
MEMORY = TRANSPORT + ("memory",)
ENGINE = MEMORY + ("engine",)
CORE = ENGINE + ("saver", "launch", "cli", "top")

#: room -> the rooms it may import (besides itself)
ROOMS: dict[str, tuple[str, ...]] = {
    "leaf": (),
    "format": LEAF,
    "storage": FORMAT,
    "commit": STORAGE,
    "transport": COMMIT,
    "memory": TRANSPORT,
    "engine": MEMORY,  # never the saver (the daemon side) nor launch
    "saver": MEMORY,  # the daemon side: up to memory, never the engine
    "launch": ENGINE + ("saver",),
    "cli": ENGINE + ("saver", "launch"),
    "top": ENGINE + ("saver", "launch", "cli"),
    "integrations": CORE,
    "patches": CORE + ("integrations",),
}

#: a module's room: the longest prefix of its name listed here
ROOM_OF = {
    "flashckpt": "top", "flashckpt.errors": "leaf", "flashckpt.config": "leaf", "flashckpt.util": "leaf",
    "flashckpt.cli": "cli", "flashckpt.integrations": "integrations", "flashckpt.patches": "patches",
    "flashckpt.export": "cli",  # a command's module (flashckpt export), which cli.parser() registers
    "flashckpt.status": "cli",  # a command's module (flashckpt status), which cli.parser() registers
    **{f"flashckpt.{room}": room for room in ("format", "storage", "commit", "transport", "memory", "engine", "saver",
                                              "launch")},
}


def room_of(module: str) -> str:
    name = module
    while name not in ROOM_OF:
        if "." not in name:
            raise AssertionError(f"{module}: in no room of ROOM_OF; give its package one")
        name = name.rpartition(".")[0]
    return ROOM_OF[name]


def _private_adapter_module(target: str) -> bool:
    return target.startswith("flashckpt.integrations.") and target.rpartition(".")[2].startswith("_")


def _rooms(src: str, dst: str) -> Callable[[Import], bool]:
    return lambda i: room_of(i.module) == src and room_of(i.target) == dst


#: rules with a test of their own (the room table implies most of them; these name who brings them down)
RULES: dict[str, Callable[[Import], bool]] = {
    "patches import no private integrations._* module":
        lambda i: room_of(i.module) == "patches" and _private_adapter_module(i.target),
    "the engine does not import launch": _rooms("engine", "launch"),
    "transport does not import the saver": _rooms("transport", "saver"),
    "memory does not import the engine": _rooms("memory", "engine"),
}

#: cycles with a test of their own: the modules among which no cycle may remain
CYCLE_RULES: dict[str, frozenset[str]] = {
    "the engine and memory import no cycle": frozenset({"flashckpt.engine.engine", "flashckpt.memory.reader",
                                                        "flashckpt.memory.writer"}),
    "the hf and accelerate adapters import no cycle": frozenset({"flashckpt.integrations.accelerate",
                                                                 "flashckpt.integrations.hf"}),
}

@functools.cache
def _graph() -> dict[str, list[Import]]:
    return graph()


def _violations() -> list[tuple[Import, str]]:
    out = []
    for edges in _graph().values():
        for i in edges:
            src, dst = room_of(i.module), room_of(i.target)
            for rule, breaks in RULES.items():
                if breaks(i):
                    out.append((i, rule))
            if src != dst and dst not in ROOMS[src]:
                out.append((i, f"{src} may import only {', '.join(ROOMS[src]) or 'itself'}, not {dst}"))
    return sorted(out)


def _report(found: list[tuple[Import, str]]) -> str:
    return "\n".join(f"  {i}: {rule}" for i, rule in found)


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("""from typing import TYPE_CHECKING
import os
from flashckpt import errors
from . import sibling
if TYPE_CHECKING:
    from flashckpt.engine.engine import CheckpointEngine
def f():
    import flashckpt.saver.server
__getattr__, __dir__ = lazy_attributes(__name__, {"X": ".lazy"})
""")
    known = {"flashckpt.errors", "flashckpt.storage.sibling", "flashckpt.storage.lazy", "flashckpt.engine.engine",
             "flashckpt.saver", "flashckpt.saver.server", "flashckpt.storage.m"}
    found = {(i.target, i.line, i.typing_only) for i in imports_of("flashckpt.storage.m", src, known)}
    assert found == {("flashckpt.errors", 3, False), ("flashckpt.storage.sibling", 4, False),
                     ("flashckpt.engine.engine", 6, True), ("flashckpt.saver.server", 8, False),
                     ("flashckpt.storage.lazy", 9, False)}
    assert cycles({"a": [Import("a", "b", 1)], "b": [Import("b", "a", 1)], "c": [Import("c", "a", 1)]}) == [["a", "b"]]


def test_every_module_has_a_room() -> None:
    for module in _graph():
        assert room_of(module) in ROOMS, module


def test_no_import_cycle() -> None:
    """No cycle, imports in functions and under TYPE_CHECKING included (those of ``CYCLE_RULES`` tested apart)."""
    found = [c for c in cycles(_graph()) if not any(set(c) <= mods for mods in CYCLE_RULES.values())]
    assert not found, "import cycles (each a set of modules importing each other):\n" + \
        "\n".join(f"  {c}" for c in found)


@pytest.mark.parametrize("rule", sorted(CYCLE_RULES))
def test_cycle_rule(rule: str) -> None:
    found = [c for c in cycles(_graph()) if set(c) & CYCLE_RULES[rule]]
    assert not found, f"import cycles against the rule {rule!r}:\n" + "\n".join(f"  {c}" for c in found)


def test_no_upward_import() -> None:
    """Every import goes to the importer's room or a room below it (those of ``RULES`` tested apart)."""
    ruled = {i for i, rule in _violations() if rule in RULES}
    upward = [(i, rule) for i, rule in _violations() if i not in ruled]
    assert not upward, "imports against the room table (ROOMS):\n" + _report(upward)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_rule(rule: str) -> None:
    found = [(i, r) for i, r in _violations() if r == rule]
    assert not found, f"imports against the rule {rule!r}:\n" + _report(found)
