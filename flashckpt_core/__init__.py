"""flashckpt's engine: shared-memory snapshots, background persistence, atomic commits.

This package imports no training framework (torch only); adapters live in ``integrations``.

The public names are those in ``__all__``. The building blocks DLRover exports under the names
``TensorMeta``, ``SharedMemoryHandler``, ``SharedLock``, ``SharedQueue`` and ``SharedDict`` exist here
with other signatures and meanings (a slot layout record, the trainer's side of a shared-memory segment,
an ``flock``, proxies to the saver's named objects); they are internal, in ``flashckpt.format.tree``,
``flashckpt.memory.writer`` and ``flashckpt.transport.ipc``, and not exported, so that no code written against DLRover's classes half-works.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashckpt.util.lazy import lazy_attributes

if TYPE_CHECKING:
    from flashckpt.commit.retention import CheckpointDeletionStrategy, KeepLatestStepStrategy, KeepStepIntervalStrategy
    from flashckpt.config import StorageType
    from flashckpt.engine.durability import Durability
    from flashckpt.engine.engine import CheckpointEngine, LoadResult
    from flashckpt.engine.events import Event, Stats
    from flashckpt.engine.interval import storage_type_for
    from flashckpt.errors import (
        AlreadyExistsError,
        CheckpointCorruptError,
        CheckpointDirError,
        CheckpointNotFoundError,
        CheckpointTimeoutError,
        DurabilityLagError,
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
    from flashckpt.format.files import FileSet
    from flashckpt.memory.reader import SnapshotReader
    from flashckpt.storage.base import CheckpointStorage

# Public name -> the module defining it, imported on first use (PEP 562): the saver daemon, run as
# ``python -m flashckpt.saver.daemon``, imports only what it needs, and torch only when it persists.
# These are the names a user calls; the building blocks (CommitLayout, Manifest, PosixDiskStorage,
# CheckpointSaver, ...) stay importable from their modules.
_ERRORS = ("AlreadyExistsError", "CheckpointCorruptError", "CheckpointDirError", "CheckpointNotFoundError", "CheckpointTimeoutError",
           "DurabilityLagError", "EngineUseError", "FlashCheckpointError", "InvalidArgumentError", "InvalidArgumentTypeError", "InvalidStateDictError",
           "PersistError", "ProtocolError", "RankStateNotFoundError", "SaverError", "SharedMemoryError", "TrackerUpdateError",
           "UnsupportedStrategyError", "WriteRefusedError")
__getattr__, __dir__ = lazy_attributes(__name__, {
    "StorageType": "flashckpt.config", "CheckpointEngine": "flashckpt.engine.engine", "LoadResult": "flashckpt.engine.engine", "FileSet": "flashckpt.format.files",
    "storage_type_for": "flashckpt.engine.interval", "CheckpointDeletionStrategy": "flashckpt.commit.retention", "KeepLatestStepStrategy": "flashckpt.commit.retention",
    "KeepStepIntervalStrategy": "flashckpt.commit.retention", "Durability": "flashckpt.engine.durability",
    "Event": "flashckpt.engine.events", "Stats": "flashckpt.engine.events", "SnapshotReader": "flashckpt.memory.reader", "CheckpointStorage": "flashckpt.storage.base",
    **{name: "flashckpt.errors" for name in _ERRORS},
})


__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine", "LoadResult", "Durability", "Event", "Stats", "StorageType", "storage_type_for", "FileSet", "SnapshotReader",
    "CheckpointDeletionStrategy", "KeepLatestStepStrategy", "KeepStepIntervalStrategy", "CheckpointStorage",
    "FlashCheckpointError", "InvalidStateDictError", "InvalidArgumentError", "InvalidArgumentTypeError",
    "CheckpointDirError", "CheckpointNotFoundError", "SharedMemoryError", "SaverError", "PersistError",
    "TrackerUpdateError", "DurabilityLagError", "CheckpointCorruptError", "CheckpointTimeoutError", "ProtocolError",
    "UnsupportedStrategyError", "AlreadyExistsError", "WriteRefusedError", "EngineUseError", "RankStateNotFoundError",
    "__version__",
]
