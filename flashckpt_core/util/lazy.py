"""Deferred imports: a module's names that import their module on first use (``lazy_attributes``), and a
module that loads on its first attribute access, not at ``import`` (``defer``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["defer", "lazy_attributes"]

_lock = threading.Lock()


class _Deferred(types.ModuleType):
    """Stands in ``sys.modules`` for a module not imported yet; the first attribute it lacks imports the
    real module (one thread at a time) and takes over its namespace."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr != "__path__":
            raise AttributeError(attr)
        name = self.__name__
        with _lock:
            real = sys.modules.get(name)
            if real is None or real is self:
                sys.modules.pop(name, None)
                try:
                    real = importlib.import_module(name)
                except BaseException:
                    sys.modules.setdefault(name, self)
                    raise
                self.__dict__.update(real.__dict__)
        return getattr(real, attr)


def defer(name: str) -> None:
    """Makes ``import name`` (from here on, in this process) give a stand-in that imports the module on
    first use.

    The saver daemon defers torch this way: it imports modules it shares with trainers, which import
    torch, but needs torch only to persist; an idle saver then stays small (no torch: ~100 MB less).
    Only code that uses the module's attributes sees the difference (the first use takes the import)."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None:
        return
    stand_in = _Deferred(name)
    stand_in.__spec__ = spec  # not initializing: `import name` elsewhere returns the stand-in as is
    sys.modules[name] = stand_in


def lazy_attributes(module: str, where: Mapping[str, str], *,
                    import_error: Callable[[str, ImportError], BaseException] | None = None,
                    ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's ``__getattr__`` and ``__dir__`` (PEP 562) for names defined in other modules, each imported
    on the first use of one of its names, which is then kept in the module's namespace (the next use is a
    plain lookup). Use: ``__getattr__, __dir__ = lazy_attributes(__name__, {"Name": ".module", ...})``.

    Args:
        module: the module's ``__name__``.
        where: public name -> the module defining it: relative (``".server"``) to the module's package, or
            absolute.
        import_error: what to raise instead when importing the defining module of a name fails (given the
            name and the ImportError, which is chained); None: the ImportError itself.

    May run in several threads: the import system serializes the imports, and each stores the same value.
    """

    def __getattr__(name: str) -> Any:
        target = where.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        namespace = sys.modules[module]
        try:
            defining = importlib.import_module(target, namespace.__package__)
        except ImportError as e:
            if import_error is None:
                raise
            raise import_error(name, e) from e
        value = getattr(defining, name)
        setattr(namespace, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module])) | set(where))

    return __getattr__, __dir__
