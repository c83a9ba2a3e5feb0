"""Where an adapter routes a framework's file I/O: whether a path lies inside a checkpoint directory (and
its name there), the step in a checkpoint directory's name, and framework attributes swapped while a
call runs.

- ``path_inside`` / ``rel_inside``: whether a path lies inside a directory (``..`` and symbolic links
  resolved; a store's URLs compared lexically), and its name there;
- ``step_of``: the step number in a checkpoint directory's name (``checkpoint-100``, ``iter_0000100``);
- ``swapped``: a framework's module attributes replaced for the duration of a call.

Imports only flashckpt's ``storage.locations`` (URLs); no framework. Nothing here is collective;
``swapped`` changes module attributes, so one thread at a time may use it on the same objects.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

from flashckpt.storage import locations

__all__ = ["path_inside", "rel_inside", "step_of", "swapped"]


def path_inside(path: str | os.PathLike[str], root: str | os.PathLike[str], *, strict: bool = False) -> bool:
    """Whether ``path`` lies inside ``root`` (``root`` itself counts unless ``strict``).

    Both are made absolute and resolved (``..`` and symbolic links, as far as they exist), so a path that
    leaves ``root`` through ``..`` or through a link to elsewhere is outside, and a path given through a
    link to ``root`` is inside. URLs of a store (``s3://...``) are compared lexically.
    """
    if locations.is_url(os.fspath(root)) or locations.is_url(os.fspath(path)):  # a store: lexically
        return locations.inside(os.fspath(path), os.fspath(root), strict=strict)
    p, r = os.path.realpath(os.fspath(path)), os.path.realpath(os.fspath(root))
    if p == r:
        return not strict
    return p.startswith(r.rstrip(os.sep) + os.sep)


def rel_inside(path: Any, root: str | os.PathLike[str]) -> str | None:
    """The name (``/``-separated) of ``path`` relative to ``root`` when it lies strictly inside it (see
    ``path_inside``), else None; None also for what is not a path (a file object)."""
    if not isinstance(path, (str, os.PathLike)) or not path_inside(path, root, strict=True):
        return None
    if locations.is_url(os.fspath(root)):
        return locations.relpath(os.fspath(path), os.fspath(root))
    return os.path.relpath(os.path.realpath(os.fspath(path)), os.path.realpath(os.fspath(root))).replace(os.sep, "/")


def step_of(path: str | os.PathLike[str], pattern: re.Pattern[str]) -> int | None:
    """The step in the name of the directory ``path`` (a trailing separator ignored), read by
    ``pattern``'s first group; None when the name does not match."""
    m = pattern.match(os.path.basename(os.path.normpath(os.fspath(path))))
    return int(m.group(1)) if m else None


@contextlib.contextmanager
def swapped(swaps: Sequence[tuple[Any, str, Any]]) -> Iterator[None]:
    """Sets ``obj.name = value`` for each swap (a framework's module function, while a call runs);
    restores them on exit, in reverse order (an attribute the object did not have of its own is removed)."""
    missing = object()
    saved = []
    try:
        for obj, name, value in swaps:
            saved.append((obj, name, obj.__dict__.get(name, missing) if hasattr(obj, "__dict__") else missing))
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is missing:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
            else:
                setattr(obj, name, old)
