"""What every part of the saver shares: its state (declared once, on ``SaverBase``), the names in the job's
runtime dir, the job lock, and small helpers."""

from __future__ import annotations

import collections
import logging
import os
import queue
import select
import socket
import stat
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.records_home import Held
from flashckpt.config import Knobs
from flashckpt.format.segment import (
    Segment,
    SlotHeader,
)
from flashckpt.saver.worker import PersistWorker
from flashckpt.storage.base import CheckpointStorage
from flashckpt.transport.messages import Persist
from flashckpt.util.lease import pid_running

log = logging.getLogger("flashckpt.saver")

@dataclass
class _StepState:
    status: str = "persisting"  # persisting -> committing -> committed | failed
    error: str | None = None
    commits_here: bool = False
    paths: set[str] = field(default_factory=set)  # where this node's ranks persist it (delete_path refuses them)
    ranks: set[int] = field(default_factory=set)  # the ranks whose files of it this saver writes


@dataclass(frozen=True)
class _CommitJob:
    """Commit ``step`` once every rank's done marker is there (``spec``: a ``Persist`` request's ``commit``)."""

    step: int
    spec: dict[str, Any]


@dataclass(frozen=True)
class _DeleteJob:
    """Delete committed ``steps`` (the newest committed step too with ``newest``); ``done``, when set,
    receives the steps deleted (a client waits on it)."""

    steps: tuple[int, ...]
    newest: bool = False
    done: Future[list[int]] | None = None


@dataclass(frozen=True)
class _DeletePathJob:
    """Delete a checkpoint's file or directory (a deletion strategy's ``delete_func``)."""

    path: str


#: What the commit thread does, in queue order: every change to the commit records happens on it.
CommitWork = _CommitJob | _DeleteJob | _DeletePathJob


@dataclass
class _ClientInfo:
    rank: int = -1
    local_rank: int = -1
    pid: int = 0
    final: bool = False
    said_bye: bool = False
    persists: bool = False
    commit: dict[str, Any] | None = None
    world_size: int = 0
    replicated: bool = False

    def owns(self, h: SlotHeader) -> bool:
        """Whether the snapshot of slot header ``h`` is this client's state: saved by its rank, in a job of its
        number of ranks (replicated state: any copy is every rank's)."""
        return self.replicated or (h.rank == self.rank and h.world_size == self.world_size)


@dataclass
class _Stats:
    persisted_bytes: int = 0
    persist_seconds: float = 0.0
    last_persist_s: float = 0.0
    last: dict[str, Any] = field(default_factory=dict)



class _Watch:
    """Whether process ``pid`` (the job's launcher) still runs: a pidfd where Linux has them (immune to
    pid reuse once opened), else ``kill(pid, 0)``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        self._gone = False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
        except (AttributeError, OSError):
            pass

    def gone(self) -> bool:
        if self._gone:
            return True
        if self._fd is not None:
            self._gone = bool(select.select([self._fd], [], [], 0)[0])  # readable once it exited
        else:
            self._gone = not pid_running(self.pid)
        return self._gone

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None



def _remove_in(dir_fd: int, name: str) -> None:
    """Removes ``name`` from the directory ``dir_fd`` without following a symbolic link: a link is
    removed, never its target; a directory is emptied through its own ``O_NOFOLLOW`` fd."""
    if not stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        for n in os.listdir(sub):
            _remove_in(sub, n)
    finally:
        os.close(sub)
    os.rmdir(name, dir_fd=dir_fd)



class SaverBase:
    """The state of a ``CheckpointSaver``, which its parts (server, segments, persist, last words, commit)
    share; set in ``CheckpointSaver.__init__``."""

    job_dir: str
    knobs: Knobs
    storage: CheckpointStorage
    layout: CommitLayout
    stats: _Stats
    _job_lock: Held | None
    _alloc_locks: dict[int, threading.Lock]
    _cv: threading.Condition
    _clients: dict[int, _ClientInfo]
    _ever_clients: int
    _steps: dict[int, _StepState]
    _errors: list[dict[str, Any]]
    _committed: list[int]
    _records_ready: bool  # the records thread's state (saver/housekeeping), under _cv
    _records_error: str | None
    _records_failures: int
    _records_since: float
    _start_committed: list[int]
    _inflight: int
    _persist_q: dict[int, queue.Queue[Persist | None]]  # persist jobs per local rank
    _commit_q: queue.Queue[CommitWork | None]  # the commit thread's work, in order
    _threads: list[threading.Thread]
    _queues: dict[str, collections.deque[Any]]
    _dicts: dict[str, dict[str, Any]]
    _segments: dict[str, Segment]
    _stop: threading.Event
    _idle_since: float
    _session_final: bool
    _persisters: dict[int, _ClientInfo]
    _last_words_lock: threading.Lock
    _signalled: bool
    _agent: _Watch | None
    _sock: socket.socket | None
    _persist_seen: float
    _spares_wanted: threading.Event
    _dir_fd: int | None
    _worker: PersistWorker
    _rep: Any  # saver/replica's _Replica: the peer service of a multi-node job, None before (and without) one

    if TYPE_CHECKING:  # the methods one part calls on another, declared for the type checker
        def _spawn(self, target: Any, name: str, *args: Any) -> threading.Thread: ...  # server
        def _segment(self, path: str) -> Segment: ...  # segments
        def _prepare_spares(self, seg: Segment) -> None: ...  # segments
        def _release_spares(self, seg: Segment, *, blocking: bool = True, force: bool = False) -> None: ...
        def _enqueue(self, req: Persist) -> None: ...  # persist
        def _work_done(self) -> None: ...  # lastwords
        def _step_done(self, step: int) -> bool: ...  # lastwords
        def _finish(self, step: int, error: str | None, *, committed: bool) -> None: ...  # committer
        def _shm_free(self) -> int: ...  # segments
        def _alloc(self, local_rank: int, meta_cap: int, data_cap: int, nslots: int) -> str: ...  # segments
        def _hold_slot(self, job: Persist) -> bool: ...  # lastwords
        def _unhold_slot(self, job: Persist) -> None: ...  # lastwords
        def _recover_missing(self, step: int, missing: list[int]) -> list[int]: ...  # replica
        def _take_over_commit(self, timeout: float | None, limit: int | None,
                              peers: list[dict[str, Any]]) -> int | None: ...  # replica
        def _newest_across_nodes(self) -> tuple[int | None, list[dict[str, Any]]]: ...  # replica
        def _drop_backups(self, need: int, *, keep: int = -1, older_than: int | None = None) -> int: ...
        def _saved_at(self, step: int) -> dict[str, float]: ...  # lastwords
        def _wait_step(self, step: int, timeout: float | None) -> None: ...  # lastwords
        def _await_records(self, what: str, timeout: float) -> None: ...  # housekeeping
