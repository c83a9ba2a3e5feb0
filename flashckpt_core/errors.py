"""The exception hierarchy of flashckpt: every error it raises derives from FlashCheckpointError."""

from __future__ import annotations

__all__ = [
    "FlashCheckpointError",
    "InvalidStateDictError",
    "CheckpointDirError",
    "SharedMemoryError",
    "SaverError",
    "PersistError",
    "CheckpointCorruptError",
    "CheckpointTimeoutError",
    "ProtocolError",
]


class FlashCheckpointError(Exception):
    """Base class of every error raised by flashckpt."""


class InvalidStateDictError(FlashCheckpointError, ValueError):
    """A state dict holds something that cannot be snapshotted (raised before anything is written)."""


class CheckpointDirError(FlashCheckpointError, OSError):
    """The checkpoint directory is missing, not writable or not usable."""


class SharedMemoryError(FlashCheckpointError, MemoryError):
    """Shared memory could not be allocated or attached (for example /dev/shm is too small)."""


class SaverError(FlashCheckpointError, RuntimeError):
    """The node's saver process could not be started, reached, or died."""


class PersistError(FlashCheckpointError, OSError):
    """Persisting or committing a snapshot to storage failed; earlier committed checkpoints are intact."""


class CheckpointCorruptError(FlashCheckpointError):
    """A persisted file does not match the size or checksum recorded in its manifest."""


class CheckpointTimeoutError(FlashCheckpointError, TimeoutError):
    """A bounded wait ran out (a persist, a commit, a free shared-memory slot)."""


class ProtocolError(FlashCheckpointError):
    """A control message between a trainer and the saver was malformed or rejected."""
