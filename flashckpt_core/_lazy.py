"""Deferred imports: a module that loads on its first attribute access, not at ``import``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from typing import Any

__all__ = ["defer"]

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
