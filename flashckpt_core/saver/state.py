"""What the parts of a saver truly share: ``SaverState`` (the job, its storage and commit layout, the knobs,
one condition variable and the stop flag, the book of steps in flight and committed, the clients' sessions
as last words need them, the commit queue), and the small records the parts pass each other.

Every field of ``SaverState`` that changes is read and written under ``cv``, except ``stop`` (an event),
``commit_q`` (a thread-safe queue) and ``threads`` (appended to by ``spawn`` only). Each part keeps its own
state in its own object (``saver/server`` lists the parts); this module imports only the layers below the
saver."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.config import Knobs
from flashckpt.format.segment import SlotHeader
from flashckpt.storage.base import CheckpointStorage, take_retries

__all__ = ["SaverState", "StepState", "ClientInfo", "Stats", "CommitJob", "LocalCommitJob", "DeleteJob", "DeletePathJob", "CommitWork",
           "saved_at", "log"]

log = logging.getLogger("flashckpt.saver")

_COMMITS_KEPT = 16  # commit records a status reply carries (the newest)
_EVENTS_KEPT = 1024  # events the journal keeps for the trainers (``SaverState.note``)


@dataclass
class StepState:
    status: str = "persisting"  # persisting -> committing -> committed | failed
    error: str | None = None
    commits_here: bool = False
    paths: set[str] = field(default_factory=set)  # where this node's ranks persist it (delete_path refuses them)
    ranks: set[int] = field(default_factory=set)  # the ranks whose files of it this saver writes
    local_done: set[int] = field(default_factory=set)  # ranks whose files are on the local tier (done markers)
    spec: dict[str, Any] | None = None  # the durable commit spec (global rank 0's node)


@dataclass(frozen=True)
class CommitJob:
    """Commit ``step`` once every rank's done marker is there (``spec``: a ``Persist`` request's ``commit``)."""

    step: int
    spec: dict[str, Any]


@dataclass(frozen=True)
class LocalCommitJob:
    """Commit ``step`` on the local tier once ``ranks`` (this node's persisting ranks) have their done markers
    there; ``tier``: a ``Persist`` request's ``local`` (world size, replicated), ``spec``: the durable commit
    spec when this node commits the step on the durable tier."""

    step: int
    ranks: tuple[int, ...]
    tier: dict[str, Any]
    spec: dict[str, Any] | None


@dataclass(frozen=True)
class DeleteJob:
    """Delete committed ``steps`` (the newest committed step too with ``newest``); ``done``, when set,
    receives the steps deleted (a client waits on it)."""

    steps: tuple[int, ...]
    newest: bool = False
    done: Future[list[int]] | None = None


@dataclass(frozen=True)
class DeletePathJob:
    """Delete a checkpoint's file or directory (a deletion strategy's ``delete_func``)."""

    path: str


#: What the commit thread does, in queue order: every change to the commit records happens on it.
CommitWork = CommitJob | LocalCommitJob | DeleteJob | DeletePathJob


@dataclass
class ClientInfo:
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
class Stats:
    persisted_bytes: int = 0
    persist_seconds: float = 0.0
    last_persist_s: float = 0.0
    last: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class SaverState:
    """The state every part of a ``CheckpointSaver`` shares; each part receives it in its constructor."""

    job_dir: str
    knobs: Knobs
    storage: CheckpointStorage
    layout: CommitLayout
    cv: threading.Condition = field(default_factory=threading.Condition)
    stop: threading.Event = field(default_factory=threading.Event)
    stats: Stats = field(default_factory=Stats)
    steps: dict[int, StepState] = field(default_factory=dict)  # the steps this saver persists or commits
    errors: list[dict[str, Any]] = field(default_factory=list)  # reported to clients (a cursor each)
    commits: list[dict[str, Any]] = field(default_factory=list)  # the newest commits' times (``note_commit``)
    failures: dict[tuple[int, int], str] = field(default_factory=dict)  # (step, rank) -> why its persist here failed
    committed: list[int] = field(default_factory=list)  # in commit order: the last is the newest
    inflight: int = 0  # units of work running: persists, commits, deletions, last words
    commit_q: queue.Queue[CommitWork | None] = field(default_factory=queue.Queue)  # the commit thread's work
    clients: dict[int, ClientInfo] = field(default_factory=dict)  # connection id -> the client that said hello
    persisters: dict[int, ClientInfo] = field(default_factory=dict)  # local rank -> who persists (last words)
    idle_since: float = field(default_factory=time.monotonic)  # no client and no work since
    signalled: bool = False  # last words before exiting (SIGTERM, final goodbyes, giving way)
    last_words_lock: threading.Lock = field(default_factory=threading.Lock)  # one choice of a step to persist
    threads: list[threading.Thread] = field(default_factory=list)
    local: CommitLayout | None = None  # the node-local tier's commit records (None: no local tier)
    local_keep: int = 2  # locally committed steps kept (0: all)
    durable_keep: int = 0  # steps the checkpoint dir keeps, as the newest local commit's engine said (0: all)
    uploading: set[int] = field(default_factory=set)  # locally committed steps not yet committed on the durable tier
    journal: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=_EVENTS_KEPT))  # ``note``
    event_seq: int = 0  # the sequence number of the newest event in ``journal``
    running: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)  # (step, rank) -> a persist running
    started_at: float = field(default_factory=time.time)

    def spawn(self, target: Any, name: str, *args: Any) -> threading.Thread:
        """Starts a daemon thread of the saver named ``flashckpt-saver-<name>``."""
        t = threading.Thread(target=target, args=args, name=f"flashckpt-saver-{name}", daemon=True)
        t.start()
        self.threads.append(t)
        return t

    def work_done(self) -> None:
        """One unit of in-flight work (persist, commit, deletion, last words) ended. Holds ``cv``."""
        self.inflight -= 1
        if self.inflight == 0 and not self.clients:
            self.idle_since = time.monotonic()
        self.cv.notify_all()

    def step_done(self, step: int) -> bool:
        """Whether nothing of ``step`` runs here any more. Holds ``cv``."""
        st = self.steps.get(step)
        if st is None:
            return True
        if st.commits_here:
            return st.status in ("committed", "failed")
        return st.status not in ("persisting", "uploading")

    def finish(self, step: int, error: str | None, *, committed: bool) -> None:
        """Records the end of this saver's work on ``step`` (a persist, or the commit)."""
        with self.cv:
            st = self.steps.setdefault(step, StepState())
            if error is not None:
                st.status, st.error = "failed", error
                self.errors.append({"step": step, "error": error})
            elif committed:
                st.status = "committed"
            elif st.status in ("persisting", "uploading"):
                st.status = "persisted"
            self.work_done()

    def note_commit(self, step: int, tier: str, snapshot_at: float) -> dict[str, Any]:
        """Records that ``step`` is committed on ``tier`` ("durable": the checkpoint dir) now; ``snapshot_at``:
        the wall time of the oldest snapshot its files came from (0: unknown). The record (step, tier,
        snapshot_at, committed_at, lag_s: the durability lag) goes to clients with every status reply (the
        newest ``_COMMITS_KEPT``) and is returned."""
        now = time.time()
        rec = {"step": step, "tier": tier, "snapshot_at": snapshot_at, "committed_at": now,
               "lag_s": max(0.0, now - snapshot_at) if snapshot_at > 0 else None}
        with self.cv:
            self.commits = (self.commits + [rec])[-_COMMITS_KEPT:]
        return rec

    def note(self, kind: str, *, level: int | None = logging.INFO, **fields: Any) -> None:
        """One event of this saver, for the trainers' event stream: kept in the journal (the newest
        ``_EVENTS_KEPT``; each trainer reads it from its cursor with every status reply, ``events_since``) and
        logged at ``level`` as ``event=<kind> key=value ...`` in the given order (None: not logged; the caller
        logged it already). ``fields`` must be JSON values."""
        rec = {"kind": kind, "time": time.time(), **fields}
        with self.cv:
            self.event_seq += 1
            rec["seq"] = self.event_seq
            self.journal.append(rec)
        if level is not None and log.isEnabledFor(level):
            log.log(level, "event=%s %s", kind, " ".join(f"{k}={_shown(v)}" for k, v in fields.items()))

    def events_since(self, seq: int) -> tuple[list[dict[str, Any]], int]:
        """The events after sequence number ``seq`` (a trainer's cursor; -1: none, only the cursor) and the
        newest sequence number. A cursor older than the journal gets what is left (the reply's first ``seq``
        says how many were missed). The retries counted since the last call become one ``retry`` event (not
        at a hello, ``seq`` -1, whose cursor starts after it)."""
        retries = take_retries() if seq >= 0 else {}
        if retries:
            self.note("retry", level=logging.DEBUG, counts=retries)
        with self.cv:
            if seq < 0 or seq >= self.event_seq:
                return [], self.event_seq
            return [e for e in self.journal if e["seq"] > seq], self.event_seq

    def wait_step(self, step: int, timeout: float | None) -> None:
        """Waits until ``step_done(step)``; raises CheckpointTimeoutError after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cv:
            while not self.step_done(step):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise E.CheckpointTimeoutError(f"last words: step {step} not committed within {timeout:.0f} s")
                self.cv.wait(timeout=0.2 if left is None else min(left, 0.2))

    def newest_committed(self) -> int:
        """The newest committed step (-1: none)."""
        with self.cv:
            return self.committed[-1] if self.committed else -1


def _shown(v: Any) -> str:
    """A field's value in an ``event=`` log line: seconds to the millisecond, None as "?"."""
    if v is None:
        return "?"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def saved_at(layout: CommitLayout, step: int) -> dict[str, float]:
    """Rank -> the wall time of the snapshot committed ``step`` was persisted from ({} when unknown)."""
    if step < 0:
        return {}
    try:
        return layout.read_manifest(step).saved_at_ranks()
    except (E.FlashCheckpointError, TypeError, ValueError):
        return {}
