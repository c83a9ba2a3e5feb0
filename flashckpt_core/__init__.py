"""flashckpt's engine: shared-memory snapshots, background persistence, atomic commits.

This package imports no training framework (torch only); adapters live in ``integrations``.
"""

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

__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine", "LoadResult", "Located", "storage_type_for", "FileSet", "FileEntry", "StorageType", "TensorMeta", "SharedMemoryHandler", "CheckpointSaver",
    "SharedLock", "SharedQueue", "SharedDict", "CheckpointDeletionStrategy", "KeepLatestStepStrategy",
    "KeepStepIntervalStrategy", "CheckpointStorage", "PosixDiskStorage", "FileRecord", "CommitLayout",
    "Manifest", "FlashCheckpointError", "InvalidStateDictError", "CheckpointDirError", "SharedMemoryError",
    "SaverError", "PersistError", "CheckpointCorruptError", "CheckpointTimeoutError", "ProtocolError",
    "__version__",
]
