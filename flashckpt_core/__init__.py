"""flashckpt's engine: shared-memory snapshots, background persistence, atomic commits.

This package imports no training framework (torch only); adapters live in ``integrations``.

The public names are those in ``__all__``. The building blocks DLRover exports under the names
``TensorMeta``, ``SharedMemoryHandler``, ``SharedLock``, ``SharedQueue`` and ``SharedDict`` exist here
with other signatures and meanings (a slot layout record, the trainer's side of a shared-memory segment,
an ``flock``, proxies to the saver's named objects); they are internal, in ``flashckpt._tree``,
``.snapshot_writer`` and ``.ipc``, and not exported, so that no code written against DLRover's classes half-works.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_attributes

if TYPE_CHECKING:
    from .config import StorageType
    from .engine import CheckpointEngine, LoadResult
    from .errors import (
        AlreadyExistsError,
        CheckpointCorruptError,
        CheckpointDirError,
        CheckpointNotFoundError,
        CheckpointTimeoutError,
        EngineUseError,
        FlashCheckpointError,
        InvalidArgumentError,
        InvalidArgumentTypeError,
        InvalidStateDictError,
        PersistError,
        ProtocolError,
        RankStateNotFoundError,
        SaverError,
        SharedMemoryError,
        TrackerUpdateError,
        UnsupportedStrategyError,
        WriteRefusedError,
    )
    from .files import FileSet
    from .interval import storage_type_for
    from .retention import CheckpointDeletionStrategy, KeepLatestStepStrategy, KeepStepIntervalStrategy
    from .snapshot_reader import SnapshotReader
    from .storage import CheckpointStorage

# Public name -> the module defining it, imported on first use (PEP 562): the saver daemon, run as
# ``python -m flashckpt.saver.daemon``, imports only what it needs, and torch only when it persists.
# These are the names a user calls; the building blocks (CommitLayout, Manifest, PosixDiskStorage,
# CheckpointSaver, ...) stay importable from their modules.
_ERRORS = ("AlreadyExistsError", "CheckpointCorruptError", "CheckpointDirError", "CheckpointNotFoundError", "CheckpointTimeoutError",
           "EngineUseError", "FlashCheckpointError", "InvalidArgumentError", "InvalidArgumentTypeError", "InvalidStateDictError",
           "PersistError", "ProtocolError", "RankStateNotFoundError", "SaverError", "SharedMemoryError", "TrackerUpdateError",
           "UnsupportedStrategyError", "WriteRefusedError")
__getattr__, __dir__ = lazy_attributes(__name__, {
    "StorageType": ".config", "CheckpointEngine": ".engine", "LoadResult": ".engine", "FileSet": ".files",
    "storage_type_for": ".interval", "CheckpointDeletionStrategy": ".retention", "KeepLatestStepStrategy": ".retention",
    "KeepStepIntervalStrategy": ".retention", "SnapshotReader": ".snapshot_reader", "CheckpointStorage": ".storage",
    **{name: ".errors" for name in _ERRORS},
})


__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine", "LoadResult", "StorageType", "storage_type_for", "FileSet", "SnapshotReader",
    "CheckpointDeletionStrategy", "KeepLatestStepStrategy", "KeepStepIntervalStrategy", "CheckpointStorage",
    "FlashCheckpointError", "InvalidStateDictError", "InvalidArgumentError", "InvalidArgumentTypeError",
    "CheckpointDirError", "CheckpointNotFoundError", "SharedMemoryError", "SaverError", "PersistError",
    "TrackerUpdateError", "CheckpointCorruptError", "CheckpointTimeoutError", "ProtocolError",
    "UnsupportedStrategyError", "AlreadyExistsError", "WriteRefusedError", "EngineUseError", "RankStateNotFoundError",
    "__version__",
]
