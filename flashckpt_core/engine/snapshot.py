"""Taking an engine's snapshots: ``Snapshots``.

A snapshot is the writer's copy of a state dict into a slot of shared memory (``memory.writer``): in the
caller's thread, or overlapped (``save(overlap=True)``) on a background thread while training goes on, the
tensors left alone until ``wait``. A finished snapshot is handed on (``done``: the engine's session, which
schedules its persist or collects the saver's news); an overlapped one when it is waited for.

``open_memory`` makes an engine's writer and reader of snapshots. Imports ``config`` and ``memory`` only. Used by one engine call at a time; only the copy of an
overlapped snapshot runs on the background thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from flashckpt.config import StorageType
from flashckpt.engine.ranks import RankInfo
from flashckpt.memory.reader import SnapshotReader
from flashckpt.memory.writer import Allocator, SharedMemoryHandler
from flashckpt.util.copy import Copier

__all__ = ["Snapshots", "open_memory"]

log = logging.getLogger(__name__)


class Snapshots:
    """One engine's snapshots.

    Args:
        handler: the engine's snapshot writer.
        writes: whether this rank writes snapshots (in replicated mode only local rank 0 does).
        done: what a finished snapshot is handed to: (step, storage type, persist target, its ``SlotRef``).
    """

    def __init__(self, handler: SharedMemoryHandler, *, writes: bool,
                 done: Callable[[int, StorageType, str, Any], None]) -> None:
        self.handler, self.writes, self._done = handler, writes, done
        self._bg: ThreadPoolExecutor | None = None
        self._pending: tuple[Future[Any], int, StorageType, str] | None = None

    @property
    def pending(self) -> bool:
        """Whether an overlapped snapshot was not waited for yet."""
        return self._pending is not None

    def take(self, step: int, state_dict: Any, storage_type: StorageType, target: str, *,
             overlap: bool) -> tuple[int, float, Any]:
        """Takes the snapshot of ``state_dict`` (to be persisted to ``target``): (its bytes of tensor data,
        the seconds the caller was held, its ``SlotRef``: None when overlapped, or when this rank writes
        none). The caller hands it on (``done``) unless it is ``pending``."""
        t0 = time.perf_counter()
        finish = self.handler.start_save(step, state_dict, ckpt_name=target, defer=overlap) if self.writes else None
        nbytes = self.handler.pending_bytes if finish is not None else 0
        if overlap and finish is not None:
            if self._bg is None:
                self._bg = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-snapshot")
            self._pending = (self._bg.submit(finish), step, storage_type, target)
            finish = None
        ref = finish() if finish is not None else None
        return nbytes, time.perf_counter() - t0, ref

    def wait(self) -> None:
        """Waits for the overlapped snapshot, if any, and hands it on.

        Raises:
            whatever the snapshot's copy raised (the slot is then left empty; earlier snapshots stay).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        fut, step, storage_type, target = pending
        self._done(step, storage_type, target, fut.result())

    def abandon(self, op: str) -> None:
        """After the runtime dir was lost: waits for an overlapped snapshot's copy (into the lost memory) to
        end, and hands nothing over."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending[0].result()
            except Exception as e:
                log.debug("%s(): the overlapped snapshot into the removed runtime dir failed: %s", op, e)

    def close(self) -> None:
        """Ends the background thread (after ``wait``)."""
        if self._bg is not None:
            self._bg.shutdown(wait=True)


def open_memory(ranks: RankInfo, job_dir: str, checkpoint_dir: str, *, replicated: bool, allocate: Allocator | None,
                copier: Copier, weights_only: bool) -> tuple[SharedMemoryHandler, SnapshotReader]:
    """An engine's snapshot writer (``allocate``: None where this rank writes none) and its reader of
    snapshots (the writer itself, or local rank 0's segments for local ranks > 0 in replicated mode)."""
    r = ranks
    # The rank that writes this local rank's snapshots takes its writer lease at its first save and
    # holds it until close: a second writer (another engine, another job with this job key) is refused.
    # It reads back only what this process may resume from: its rank's own snapshots (wherever they are on
    # this node), saved by a job of its number of ranks (replicated state: any copy), and none that another
    # live process writes (another training on this job key; the reader says so in the log).
    handler = SharedMemoryHandler(r.local_rank, job_dir, allocate=allocate, copier=copier, weights_only=weights_only,
                                  writer_info={"rank": r.rank, "world_size": r.world_size,
                                               "checkpoint_dir": checkpoint_dir},
                                  rank=None if replicated else r.rank,
                                  world_size=None if replicated else r.world_size, own_only=True)
    # Replicated, local ranks > 0 read local rank 0's segments, which a live sibling of this run writes:
    # the agreement with local rank 0 (which checks who writes them) decides whether memory serves.
    if not replicated or r.local_rank == 0:
        return handler, handler
    return handler, SnapshotReader.for_job_dir(0, job_dir, copier=copier, weights_only=weights_only)
