"""The exception hierarchy of flashckpt: every error it raises derives from FlashCheckpointError.

Each class also derives from the builtin exception a Python user would catch for the same fault
(``ValueError`` for a bad argument, ``FileNotFoundError`` for a missing checkpoint, ``TimeoutError``, ...),
so ``except ValueError`` keeps working. The only builtins raised as such are the ones Python's own
protocols require: ``KeyError`` from a mapping's ``__getitem__``, ``NotImplementedError`` from an abstract
method, ``AttributeError`` from ``__getattr__``.
"""

from __future__ import annotations

__all__ = [
    "FlashCheckpointError",
    "InvalidStateDictError",
    "CheckpointDirError",
    "SharedMemoryError",
    "SaverError",
    "PersistError",
    "DurabilityLagError",
    "CheckpointCorruptError",
    "CheckpointTimeoutError",
    "ProtocolError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "CheckpointNotFoundError",
    "RankStateNotFoundError",
    "AlreadyExistsError",
    "TrackerUpdateError",
    "UnsupportedStrategyError",
    "WriteRefusedError",
    "EngineUseError",
]


class FlashCheckpointError(Exception):
    """Base class of every error raised by flashckpt."""


class InvalidStateDictError(FlashCheckpointError, ValueError):
    """A state dict holds something that cannot be snapshotted (raised before anything is written)."""


class InvalidArgumentError(FlashCheckpointError, ValueError):
    """An argument, setting or environment variable has a value flashckpt cannot use (raised before anything
    is written; the message names the argument and what to pass instead)."""


class InvalidArgumentTypeError(FlashCheckpointError, TypeError):
    """An argument has a type flashckpt cannot use (raised before anything is written)."""


class CheckpointNotFoundError(FlashCheckpointError, FileNotFoundError):
    """A checkpoint, step or file asked for by name does not exist."""


class RankStateNotFoundError(CheckpointNotFoundError):
    """A checkpoint holds no state of some rank of this job (it was saved by fewer ranks): every rank is
    refused alike rather than one of them being handed another rank's state."""


class AlreadyExistsError(FlashCheckpointError, FileExistsError):
    """A record that is created only once (a step's manifest) exists already: another writer made it."""


class WriteRefusedError(FlashCheckpointError, PermissionError):
    """A write or removal in the checkpoint dir that the training process leaves to the saver (the message
    says what writes there instead)."""


class UnsupportedStrategyError(FlashCheckpointError, TypeError):
    """A framework's distributed strategy or configuration that the adapter does not serve (the message names
    what to use instead)."""


class EngineUseError(FlashCheckpointError, RuntimeError):
    """A ``CheckpointEngine`` called from where it cannot serve: a process forked from the one that opened
    it, or a signal handler that interrupted a call of the same engine on its thread (raised before
    anything is done; the message says what to do instead)."""


class CheckpointDirError(FlashCheckpointError, OSError):
    """The checkpoint directory is missing, not writable or not usable."""


class SharedMemoryError(FlashCheckpointError, MemoryError):
    """Shared memory could not be allocated or attached (for example /dev/shm is too small)."""


class SaverError(FlashCheckpointError, RuntimeError):
    """The node's saver process could not be started, reached, or died."""


class PersistError(FlashCheckpointError, OSError):
    """Persisting or committing a snapshot to storage failed; earlier committed checkpoints are intact.

    ``failed_steps``: the steps whose persist or commit failed, where that is all the error is about
    (empty otherwise: a saver lost with its snapshots, a tracker update)."""

    failed_steps: tuple[int, ...] = ()


class DurabilityLagError(PersistError):
    """Storage is further behind the newest snapshot than the engine's bound (``max_lag_s``) allows, under
    ``on_persist_error="raise"``; the snapshot of the save that raised it is in memory."""


class TrackerUpdateError(PersistError):
    """A step was committed (its manifest is durable: it verifies and loads), but what follows the
    manifest failed: updating ``tracker.json``, writing a framework's tracker files or removing the
    steps it supersedes. A saver repairs these at its next start (``CommitLayout.repair``)."""

    def __init__(self, step: int, problems: list[str]) -> None:
        super().__init__(f"step {step} is committed and loadable, but " + "; ".join(problems) +
                         "; a saver repairs this at its next start (readers go by the manifests, not the tracker)")
        self.step = step


class CheckpointCorruptError(FlashCheckpointError):
    """A persisted file does not match the size or checksum recorded in its manifest."""


class CheckpointTimeoutError(FlashCheckpointError, TimeoutError):
    """A bounded wait ran out (a persist, a commit, a free shared-memory slot)."""


class ProtocolError(FlashCheckpointError):
    """A control message between a trainer and the saver was malformed or rejected."""
