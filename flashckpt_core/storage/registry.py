"""The one resolver that picks a storage backend by a checkpoint dir's URL scheme (``storage_for``).

``file://`` URLs and plain paths are served by ``PosixDiskStorage`` (``flashckpt.storage.posix``); other schemes
by the backend registered for them: in code (``register_storage``) or by an installed distribution through the
entry-point group ``flashckpt.storage`` (name: the scheme; object: a ``CheckpointStorage`` subclass, built with
``from_url(url)``). See docs/storage.md.
"""

from __future__ import annotations

import os
from typing import Any

from flashckpt import errors as E
from flashckpt.config import STORAGE_OPTIONS_ENV, knob
from flashckpt.storage import locations
from flashckpt.storage.base import CheckpointStorage
from flashckpt.storage.locations import url_scheme

__all__ = ["storage_for", "register_storage", "storage_spec", "storage_from_spec", "options_from_env", "checkpoint_location", "OPTIONS_ENV",
           "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "flashckpt.storage"

_REGISTRY: dict[str, type[CheckpointStorage]] = {}


def register_storage(scheme: str, backend: type[CheckpointStorage]) -> None:
    """Serves ``<scheme>://`` checkpoint dirs with ``backend`` in this process (installed distributions
    register through the entry-point group ``flashckpt.storage`` instead, which every process sees)."""
    if not (isinstance(backend, type) and issubclass(backend, CheckpointStorage)):
        raise E.InvalidArgumentTypeError(f"register_storage({scheme!r}, {backend!r}): a CheckpointStorage subclass "
                                         "is needed")
    _REGISTRY[scheme.lower()] = backend

#: the backends of this distribution, by scheme (also in its entry points, found without them)
_BUILTIN = {"file": "flashckpt.storage.posix:PosixDiskStorage", "s3": "flashckpt.storage.s3.backend:S3Storage"}

#: how a saver daemon and its persist worker receive the ``storage_options`` of the engine that started them
OPTIONS_ENV = STORAGE_OPTIONS_ENV


def storage_for(url: str | os.PathLike[str], options: dict[str, Any] | None = None) -> CheckpointStorage:
    """The storage backend serving checkpoint dir ``url`` (a plain path or a URL), built with ``options``
    (``storage_options``: the backend's own, e.g. ``S3Options``' fields for ``s3://``).

    Raises:
        InvalidArgumentError: no backend serves the URL's scheme (the message lists those installed), or
            it takes no such option.
    """
    scheme = url_scheme(url)
    if scheme in _BUILTIN and scheme not in _REGISTRY:
        return storage_from_spec(_BUILTIN[scheme], os.fspath(url), options)
    backend = _REGISTRY.get(scheme) or _from_entry_points(scheme)
    if backend is None:
        known = sorted(set(_REGISTRY) | _entry_point_names() | {"file"})
        raise E.InvalidArgumentError(
            f"no storage backend serves {os.fspath(url)!r} ({scheme}:// URLs); installed: "
            f"{', '.join(s + '://' for s in known)}. A backend registers for its scheme in the entry-point group "
            f"{ENTRY_POINT_GROUP!r} (or with flashckpt.storage.base.register_storage); see docs/storage.md")
    return _build(backend, os.fspath(url), options)


def checkpoint_location(checkpoint_dir: str | os.PathLike[str], what: str = "CheckpointEngine") -> str:
    """The checkpoint dir a user gave, as flashckpt uses it: a local path as given (``file://`` mapped to
    its path; relative paths stay relative), or the normalized URL of a backend that serves its scheme.

    Raises:
        CheckpointDirError: a URL no installed backend serves (the message lists those that are), or a
            bad ``file://`` URL / empty path.
        InvalidArgumentTypeError: not a path.
    """
    d = os.fspath(checkpoint_dir) if isinstance(checkpoint_dir, (str, os.PathLike)) else checkpoint_dir
    if isinstance(d, str) and locations.is_url(d):
        try:
            storage_for(d)
        except E.InvalidArgumentError as e:
            raise E.CheckpointDirError(f"{what}({d!r}): {e}; or mount the store (for example with mountpoint-s3 "
                                       "or s3fs) and pass the mount's path") from None
        head, path = locations.split_url(locations.normpath(d))
        if path == "/" and not head.split("://", 1)[1]:
            raise E.CheckpointDirError(f"{what}({d!r}): the URL names no bucket or container")
        return locations.normpath(d)
    return locations.local_dir(d, what)


def _build(backend: type[CheckpointStorage], url: str, options: dict[str, Any] | None) -> CheckpointStorage:
    try:
        return backend.from_url(url, **(options or {}))
    except TypeError as e:
        if options:
            raise E.InvalidArgumentError(f"storage_options {sorted(options)}: {backend.__name__} takes none of "
                                         f"them ({e})") from None
        raise


def storage_spec(storage: CheckpointStorage) -> str:
    """``module:qualname`` of ``storage``'s class: how the saver tells its daemon and persist worker which
    backend to build (``storage_from_spec``), so that a backend registered in code only reaches them too."""
    cls = type(storage)
    return f"{cls.__module__}:{cls.__qualname__}"


def storage_from_spec(spec: str, url: str, options: dict[str, Any] | None = None) -> CheckpointStorage:
    """The backend ``storage_spec`` names, built for ``url`` with ``options``; ``storage_for(url, options)``
    when ``spec`` is empty.

    Raises:
        InvalidArgumentTypeError: ``spec`` names no ``CheckpointStorage`` subclass.
    """
    if not spec:
        return storage_for(url, options)
    import importlib

    module, _, name = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, CheckpointStorage)):
        raise E.InvalidArgumentTypeError(f"{spec} is not a CheckpointStorage subclass")
    return _build(obj, url, options)


def options_from_env() -> dict[str, Any]:
    """The ``storage_options`` a saver daemon or persist worker was started with (``OPTIONS_ENV``)."""
    return dict(knob("storage_options") or {})


def _entry_points() -> list[Any]:
    from importlib.metadata import entry_points

    return list(entry_points(group=ENTRY_POINT_GROUP))


def _entry_point_names() -> set[str]:
    return {ep.name.lower() for ep in _entry_points()}


def _from_entry_points(scheme: str) -> type[CheckpointStorage] | None:
    for ep in _entry_points():
        if ep.name.lower() == scheme:
            backend = ep.load()
            if not (isinstance(backend, type) and issubclass(backend, CheckpointStorage)):
                raise E.InvalidArgumentTypeError(f"the entry point {ep.name} = {ep.value} in group "
                                                 f"{ENTRY_POINT_GROUP!r} is not a CheckpointStorage subclass")
            _REGISTRY[scheme] = backend
            return backend
    return None

