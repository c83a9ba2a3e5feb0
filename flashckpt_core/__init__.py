"""flashckpt's engine: shared-memory snapshots, background persistence, atomic commits.

This package imports no training framework (torch only); adapters live in ``integrations``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._tree import TensorMeta
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
    from .ipc import SharedDict, SharedLock, SharedQueue
    from .retention import CheckpointDeletionStrategy, KeepLatestStepStrategy, KeepStepIntervalStrategy
    from .saver import CheckpointSaver
    from .shm import SharedMemoryHandler
    from .storage import CheckpointStorage, FileRecord, PosixDiskStorage

# Public name -> the module defining it, imported on first use (PEP 562): the saver daemon, run as
# ``python -m flashckpt_core.saver``, imports only what it needs, and torch only when it persists.
_WHERE = {
    "TensorMeta": "_tree", "CommitLayout": "commit", "Manifest": "commit", "StorageType": "config",
    "CheckpointEngine": "engine", "LoadResult": "engine", "Located": "engine", "FileEntry": "files",
    "FileSet": "files", "storage_type_for": "interval", "SharedDict": "ipc", "SharedLock": "ipc",
    "SharedQueue": "ipc", "CheckpointDeletionStrategy": "retention", "KeepLatestStepStrategy": "retention",
    "KeepStepIntervalStrategy": "retention", "CheckpointSaver": "saver", "SharedMemoryHandler": "shm",
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
    "CheckpointEngine", "LoadResult", "Located", "storage_type_for", "FileSet", "FileEntry", "StorageType", "TensorMeta", "SharedMemoryHandler", "CheckpointSaver",
    "SharedLock", "SharedQueue", "SharedDict", "CheckpointDeletionStrategy", "KeepLatestStepStrategy",
    "KeepStepIntervalStrategy", "CheckpointStorage", "PosixDiskStorage", "FileRecord", "CommitLayout",
    "Manifest", "FlashCheckpointError", "InvalidStateDictError", "CheckpointDirError", "SharedMemoryError",
    "SaverError", "PersistError", "CheckpointCorruptError", "CheckpointTimeoutError", "ProtocolError",
    "__version__",
]
