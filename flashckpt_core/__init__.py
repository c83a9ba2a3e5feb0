"""flashckpt's engine: shared-memory snapshots, background persistence, atomic commits.

This package imports no training framework (torch only); adapters live in ``integrations``.

The public names are those in ``__all__``. The building blocks DLRover exports under the names
``TensorMeta``, ``SharedMemoryHandler``, ``SharedLock``, ``SharedQueue`` and ``SharedDict`` exist here
with other signatures and meanings (a slot layout record, the trainer's side of a shared-memory segment,
an ``flock``, proxies to the saver's named objects); they are internal, in ``flashckpt._tree``,
``.snapshot_writer`` and ``.ipc``, and not exported, so that no code written against DLRover's classes half-works.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .commit import CommitLayout, Manifest
    from .config import StorageType
    from .engine import CheckpointEngine, LoadResult, Located
    from .errors import (
                         CheckpointCorruptError,
                         CheckpointDirError,
                         CheckpointTimeoutError,
                         FlashCheckpointError,
                         InvalidStateDictError,
                         PersistError,
                         ProtocolError,
                         SaverError,
                         SharedMemoryError,
    )
    from .files import FileEntry, FileSet
    from .interval import storage_type_for
    from .retention import CheckpointDeletionStrategy, KeepLatestStepStrategy, KeepStepIntervalStrategy
    from .saver import CheckpointSaver
    from .storage import CheckpointStorage, FileRecord, PosixDiskStorage

# Public name -> the module defining it, imported on first use (PEP 562): the saver daemon, run as
# ``python -m flashckpt.saver.daemon``, imports only what it needs, and torch only when it persists.
_WHERE = {
    "CommitLayout": "commit", "Manifest": "commit", "StorageType": "config",
    "CheckpointEngine": "engine", "LoadResult": "engine", "Located": "engine", "FileEntry": "files",
    "FileSet": "files", "storage_type_for": "interval", "CheckpointDeletionStrategy": "retention",
    "KeepLatestStepStrategy": "retention", "KeepStepIntervalStrategy": "retention", "CheckpointSaver": "saver",
    "CheckpointStorage": "storage", "FileRecord": "storage", "PosixDiskStorage": "storage",
    **{name: "errors" for name in ("CheckpointCorruptError", "CheckpointDirError", "CheckpointTimeoutError",
                                   "FlashCheckpointError", "InvalidStateDictError", "PersistError",
                                   "ProtocolError", "SaverError", "SharedMemoryError")},
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine", "LoadResult", "Located", "storage_type_for", "FileSet", "FileEntry", "StorageType",
    "CheckpointSaver", "CheckpointDeletionStrategy", "KeepLatestStepStrategy",
    "KeepStepIntervalStrategy", "CheckpointStorage", "PosixDiskStorage", "FileRecord", "CommitLayout",
    "Manifest", "FlashCheckpointError", "InvalidStateDictError", "CheckpointDirError", "SharedMemoryError",
    "SaverError", "PersistError", "CheckpointCorruptError", "CheckpointTimeoutError", "ProtocolError",
    "__version__",
]
