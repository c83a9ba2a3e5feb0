"""The node's saver: owns the shared memory, persists snapshots and commits them.

One saver runs per node and job. It is started by a launcher (``flashckpt-run``) or, under plain
``torchrun``/``python``, as a detached daemon by the first engine of the node (``ensure_saver``). It
serves trainers over a Unix socket in the job's 0700 runtime dir, persists on one thread per local
rank, commits on one thread, and exits once it has no clients and no work: at once when every client
said a final goodbye, else after a grace period that lets a restarted trainer re-attach. Trainers that
vanish without a goodbye (a crash) trigger the last-words persist of the newest complete snapshot.
"""

from __future__ import annotations

# ruff: noqa: E402  (the daemon defers torch before the imports below)
if __name__ == "__main__":  # the daemon never loads torch: its persist worker does (_persist_worker)
    from flashckpt._lazy import defer

    defer("torch")

import argparse
import collections
import errno
import json
import logging
import os
import queue
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import errors as E
from ._lease import Lease, pid_running
from ._persist_worker import PersistWorker
from ._protocol import Client, peer_uid, recv_msg, send_msg
from .commit import CommitLayout, TrackerUpdateError
from .config import Knobs, is_default_runtime_dir, make_private_dir, open_private_dir
from .ipc import SharedLock
from .shm import (
    COMPLETE,
    EMPTY,
    FLAG_PENDING,
    FLAG_PINNED,
    FLAG_UNRESERVED,
    WRITING,
    Segment,
    SlotHeader,
    live_snapshots,
    lock_path,
    segment_path,
    segment_paths,
)
from .storage import CheckpointStorage, PosixDiskStorage

__all__ = ["CheckpointSaver", "ensure_saver", "SOCKET_NAME"]

SAVER_MODULE = __spec__.name  # the daemon runs as ``python -m`` this module (flashckpt.saver, also when run with -m)

log = logging.getLogger(__name__)

SOCKET_NAME = "saver.sock"
_SPAWN_LOCK = "spawn.lock"
_LOG_NAME = "saver.log"


@dataclass
class _Job:
    step: int
    rank: int
    local_rank: int
    seg_path: str
    slot: int
    generation: int
    path: str
    commit: dict[str, Any] | None


@dataclass
class _StepState:
    status: str = "persisting"  # persisting -> committing -> committed | failed
    error: str | None = None
    commits_here: bool = False
    paths: set[str] = field(default_factory=set)  # where this node's ranks persist it (delete_path refuses them)


@dataclass
class _ClientInfo:
    rank: int = -1
    local_rank: int = -1
    pid: int = 0
    final: bool = False
    persists: bool = False
    commit: dict[str, Any] | None = None


@dataclass
class _Stats:
    persisted_bytes: int = 0
    persist_seconds: float = 0.0
    last_persist_s: float = 0.0
    last: dict[str, Any] = field(default_factory=dict)


class CheckpointSaver:
    """The saver of one job on one node.

    Args:
        job_dir: the job's runtime dir (segments, socket, locks); created 0700.
        checkpoint_dir: the checkpoint dir it persists into.
        storage: the storage backend (POSIX by default).
        knobs: environment knobs (read from the environment when None).
    """

    def __init__(self, job_dir: str, checkpoint_dir: str, *, storage: CheckpointStorage | None = None,
                 knobs: Knobs | None = None) -> None:
        self.job_dir = job_dir
        self.knobs = knobs or Knobs.from_env()
        self.storage = storage or PosixDiskStorage()
        # The runtime dir is named by the job key (config.job_key): markers and manifests carry it.
        self.layout = CommitLayout(checkpoint_dir, self.storage, job=os.path.basename(os.path.normpath(job_dir)))
        self._job_lock: Lease | None = None
        self._alloc_locks: dict[int, threading.Lock] = collections.defaultdict(threading.Lock)
        self._cv = threading.Condition()
        self._clients: dict[int, _ClientInfo] = {}
        self._ever_clients = 0
        self._steps: dict[int, _StepState] = {}
        self._errors: list[dict[str, Any]] = []
        self._committed: list[int] = []
        self._inflight = 0
        self._persist_q: dict[int, queue.Queue[_Job | None]] = {}
        self._commit_q: queue.Queue[tuple[int, dict[str, Any]] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._queues: dict[str, collections.deque[Any]] = collections.defaultdict(collections.deque)
        self._dicts: dict[str, dict[str, Any]] = collections.defaultdict(dict)
        self._segments: dict[str, Segment] = {}
        self._stop = threading.Event()
        self._idle_since = time.monotonic()
        self._session_final = False
        self._persisters: dict[int, _ClientInfo] = {}
        self._last_words_lock = threading.Lock()
        self._signalled = False
        self._persist_on_exit = False  # a client's goodbye asked for its snapshots to be persisted
        self._agent: _Watch | None = None  # the launcher of the job, when it has one
        self._sock: socket.socket | None = None
        self._persist_seen = -float("inf")  # monotonic time of the last persist activity (spare slot hold)
        self._dir_fd: int | None = None  # the job dir, checked: everything in it is reached through this fd
        self.stats = _Stats()
        # Writes the files (torch's work) in a process of its own, started on demand: see _persist_worker.
        self._worker = PersistWorker(self.layout.root, self.layout.job, self.storage, nice=self.knobs.persist_nice,
                                     idle_s=self.knobs.persist_worker_idle_s)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Creates the runtime dir, adopts segments left by an earlier saver, binds the socket."""
        self._dir_fd = open_private_dir(self.job_dir)
        self._adopt_segments()
        self._hold_job_lock()
        self._committed = self.layout.committed_steps()
        cleaned = self.layout.clean_uncommitted()
        if cleaned:
            log.warning("removed half-written, uncommitted steps %s left by an earlier run", cleaned)
        self._repair()
        try:
            os.unlink(SOCKET_NAME, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        # Bound through the checked dir's fd (/proc/self/fd/N is that very dir), not its path.
        in_fd = f"/proc/self/fd/{self._dir_fd}"
        path = os.path.join(in_fd if os.path.isdir(in_fd) else self.job_dir, SOCKET_NAME)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        sock.listen(128)
        self._sock = sock
        self._spawn(self._accept_loop, "accept")
        self._spawn(self._commit_loop, "commit")
        self._spawn(self._spare_keeper, "spare")
        log.info("saver %d serving %s for %s", os.getpid(), self.job_dir, self.layout.root)

    def _repair(self) -> None:
        """Completes what a crash or a failed write left after the last commits: the tracker is derived
        from the manifests (``CommitLayout.repair``). A storage that refuses is reported, not fatal."""
        try:
            for line in self.layout.repair():
                log.warning("repaired %s: %s", self.layout.meta, line)
        except OSError as e:
            log.error("could not repair the commit records in %s: %s; the next saver tries again", self.layout.meta, e)
        self._committed = self.layout.committed_steps()

    def _hold_job_lock(self) -> None:
        """Readies the commit records (stale ones removed, bound to the checkpoint dir) and holds this
        job's lock in them for the saver's life: other jobs' start-up clean-up then leaves this job's
        uncommitted steps alone (``CommitLayout.claim``, ``CommitLayout.clean_uncommitted``)."""
        self._job_lock = self.layout.claim()

    def _spawn(self, target: Any, name: str, *args: Any) -> threading.Thread:
        t = threading.Thread(target=target, args=args, name=f"flashckpt-saver-{name}", daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _adopt_segments(self) -> None:
        """Segments survive a killed saver: keep them, clearing flags of persists that died with it."""
        assert self._dir_fd is not None
        for name in os.listdir(self._dir_fd):
            if not name.endswith(".shm"):
                continue
            path = os.path.join(self.job_dir, name)
            try:
                seg = Segment(path, populate=False)
            except (OSError, E.FlashCheckpointError):
                os.unlink(name, dir_fd=self._dir_fd)
                continue
            with SharedLock(lock_path(self.job_dir, seg.local_rank)):
                for i in range(seg.nslots):
                    seg.set_flags(i, seg.header(i).flags & ~(FLAG_PINNED | FLAG_PENDING))
            self._segments[path] = seg
            log.info("adopted segment %s (steps %s)", path, [s for s, _ in seg.complete_steps()])

    def serve_forever(self) -> None:
        """Runs until there is no client and no work: at once after final goodbyes, else after grace."""
        with self._cv:
            while not self._stop.is_set():
                if not self._clients and self._inflight == 0:
                    if self._ever_clients and self._session_final:
                        if self._persist_on_exit:
                            self._signalled = True  # last words, then exit
                        break
                    if self._agent is not None and self._agent.gone():
                        log.info("the job's launcher (pid %d) exited: no restart can come; exiting",
                                 self._agent.pid)
                        self._signalled = True
                        break
                    if self._ever_clients and not self._holds_snapshot():
                        log.info("no client and no snapshot a restart could use: exiting")
                        break
                    # The grace period applies after a crash (or a goodbye keeping the snapshots), while
                    # a snapshot is held. A saver nobody attached to yet waits at least as long as its
                    # spawner does, so a short grace cannot make it exit under the first trainer's hello.
                    grace = self.knobs.grace_s if self._ever_clients else max(self.knobs.grace_s,
                                                                              self.knobs.spawn_timeout_s)
                    if time.monotonic() - self._idle_since >= grace:
                        log.info("no client for %.0f s: exiting", grace)
                        break
                self._cv.wait(timeout=0.5)
            # Decided to exit: say so under the lock hello registers under, so a trainer attaching at
            # this instant is refused (and retries on the next saver) instead of joining a dying one.
            self._stop.set()
        if self._signalled and self.knobs.last_words:
            try:
                self.save_shm_to_storage(timeout=self.knobs.term_timeout_s)
            except Exception:
                log.exception("last-words persist before exiting failed")
        if self._agent is not None:
            self._agent.close()
        self.shutdown()

    def _holds_snapshot(self) -> bool:
        """Whether a segment holds a complete snapshot (something a restarted trainer could load)."""
        for path in list(self._segments):
            try:
                if self._segments[path].complete_steps():
                    return True
            except (OSError, ValueError, E.FlashCheckpointError):
                return True  # unreadable: keep it rather than drop it
        return False

    def request_stop(self, *, last_words: bool = False) -> None:
        """Asks ``serve_forever`` to return (signal-safe: only sets flags). With ``last_words`` the
        newest snapshot is persisted and committed first (SIGTERM)."""
        self._signalled = self._signalled or last_words
        self._stop.set()

    def shutdown(self, drain_timeout: float = 60.0) -> None:
        """Finishes running persists (bounded), stops serving, removes the job's segments, locks, socket."""
        self._stop.set()
        with self._cv:
            deadline = time.monotonic() + drain_timeout
            while self._inflight > 0 and time.monotonic() < deadline:
                self._cv.wait(timeout=0.2)
            if self._inflight:
                log.error("exiting with %d persist(s) unfinished after %.0f s", self._inflight, drain_timeout)
        self._worker.close()
        try:
            spawn_lock: SharedLock | None = lock_job(self.job_dir)
        except E.SaverError as e:  # the path no longer leads to a dir of ours: clean only through our fd
            log.error("%s; removing only this saver's own files, through the job dir it checked at start", e)
            spawn_lock = None
        try:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            for q in self._persist_q.values():
                q.put(None)
            self._commit_q.put(None)
            for seg in self._segments.values():
                seg.close()
            self._segments.clear()
            # Through the fd of the job dir checked at start (or now): a symbolic link is removed, never
            # followed, and nothing outside that very dir is touched even if its path was swapped since.
            dir_fd = self._dir_fd if self._dir_fd is not None else open_private_dir(self.job_dir)
            self._dir_fd = None
            try:
                for name in os.listdir(dir_fd):
                    if name != _SPAWN_LOCK:
                        _remove_in(dir_fd, name)
                os.unlink(_SPAWN_LOCK, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
            if spawn_lock is not None:
                os.rmdir(self.job_dir)  # rmdir never follows a symbolic link, and removes only an empty dir
            if spawn_lock is not None and is_default_runtime_dir(os.path.dirname(self.job_dir)):
                try:
                    os.rmdir(os.path.dirname(self.job_dir))  # our per-user root, when no other job uses it
                except OSError:
                    pass
        except OSError as e:
            log.warning("cleaning up %s: %s", self.job_dir, e)
        finally:
            # The job lock goes first: a saver this spawn lock lets start next must not find it held.
            if self._job_lock is not None:
                self._job_lock.release()
                self._job_lock = None
            if spawn_lock is not None:
                spawn_lock.release()
        log.info("saver %d exited; runtime dir %s removed", os.getpid(), self.job_dir)

    # ------------------------------------------------------------------ server
    def _accept_loop(self) -> None:
        cid = 0
        while not self._stop.is_set():
            sock = self._sock
            if sock is None:
                return
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            try:
                if peer_uid(conn) != os.getuid():
                    log.warning("refused a connection from another uid")
                    conn.close()
                    continue
            except OSError:
                conn.close()
                continue
            cid += 1
            self._spawn(self._serve_conn, f"conn{cid}", conn, cid)

    def _serve_conn(self, conn: socket.socket, cid: int) -> None:
        info: _ClientInfo | None = None
        try:
            while True:
                try:
                    msg = recv_msg(conn)
                except E.ProtocolError as e:
                    log.warning("rejected a malformed control message: %s", e)
                    send_msg(conn, {"ok": False, "error": str(e), "kind": "ProtocolError"})
                    return
                op = msg.get("op")
                # Every reply echoes its request's id: a client that gave up on a request (a timeout)
                # recognizes the late reply and discards it instead of taking it for a later one's.
                echo = {"id": msg["id"]} if "id" in msg else {}
                if op == "hello":
                    try:
                        info = _ClientInfo(int(msg["rank"]), int(msg["local_rank"]), int(msg.get("pid", 0)),
                                           persists=bool(msg.get("persists", False)), commit=msg.get("commit"))
                    except (KeyError, TypeError, ValueError) as e:  # reply, rather than drop the connection
                        send_msg(conn, {"ok": False, "error": f"bad 'hello' request: {e!r}", "kind": "ProtocolError",
                                        **echo})
                        continue
                    with self._cv:
                        refused = self._stop.is_set()  # exiting: its runtime dir is about to be removed
                        if not refused:
                            if not self._clients:
                                self._session_final = True  # a new session of clients begins
                                self._persist_on_exit = False
                            agent = int(msg.get("agent_pid", 0) or 0)
                            if agent > 0 and (self._agent is None or self._agent.pid != agent):
                                if self._agent is not None:
                                    self._agent.close()
                                self._agent = _Watch(agent)
                            self._clients[cid] = info
                            self._ever_clients += 1
                            if info.persists:  # who persists what, for last words after a crash
                                self._persisters[info.local_rank] = info
                    if refused:
                        send_msg(conn, {"ok": False, "kind": "SaverError",
                                        "error": "the saver is shutting down; start or reach the next one", **echo})
                        return
                try:
                    reply = self._handle(op, msg, info)
                except E.FlashCheckpointError as e:
                    reply = {"ok": False, "error": str(e), "kind": type(e).__name__}
                except (KeyError, TypeError, ValueError) as e:
                    reply = {"ok": False, "error": f"bad {op!r} request: {e!r}", "kind": "ProtocolError"}
                except OSError as e:
                    reply = {"ok": False, "error": f"{op}: {e}", "kind": "PersistError"}
                send_msg(conn, {**reply, **echo})
                if op == "bye":
                    return
        except (ConnectionError, OSError):
            pass
        finally:
            conn.close()
            with self._cv:
                gone = self._clients.pop(cid, None)
                if gone is not None and not gone.final:
                    self._session_final = False
                    log.warning("client rank %d (pid %d) disconnected without goodbye", gone.rank, gone.pid)
                    if self.knobs.last_words and not self._stop.is_set():
                        self._inflight += 1  # keeps the saver alive until the last words are written
                        self._spawn(self._last_words_thread, "last-words")
                if not self._clients:
                    self._idle_since = time.monotonic()
                self._cv.notify_all()

    def _handle(self, op: Any, msg: dict[str, Any], info: _ClientInfo | None) -> dict[str, Any]:
        if op == "hello":
            return {"ok": True, "pid": os.getpid(), **self._status(0)}
        if op == "alloc":
            return {"ok": True, "path": self._alloc(int(msg["local_rank"]), int(msg["meta_cap"]),
                                                    int(msg["data_cap"]), int(msg.get("nslots", self.knobs.slots)))}
        if op == "persist":
            self._enqueue(msg)
            self._reap_quietly(int(msg["local_rank"]))
            return {"ok": True, **self._status(int(msg.get("cursor", 0)))}
        if op == "status":
            if "local_rank" in msg:
                self._reap_quietly(int(msg["local_rank"]))
            return {"ok": True, **self._status(int(msg.get("cursor", 0)))}
        if op == "wait":
            return {"ok": True, **self._wait(float(msg.get("timeout_s", 0) or 0), int(msg.get("cursor", 0)))}
        if op == "last_words":
            step = self.save_shm_to_storage(timeout=float(msg.get("timeout_s", self.knobs.commit_timeout_s)))
            return {"ok": True, "step": step, **self._status(int(msg.get("cursor", 0)))}
        if op == "delete_steps":
            steps = [int(s) for s in msg["steps"]]
            if msg.get("background", False):
                # Unlinking a GB-sized file takes a fraction of a second: never inside a trainer's save().
                with self._cv:
                    self._inflight += 1
                self._commit_q.put((-1, {"delete": steps}))
                return {"ok": True, "scheduled": steps}
            return {"ok": True, "deleted": self._delete_steps(steps)}
        if op == "delete_path":
            path = os.path.abspath(str(msg["path"]))
            steps = self._path_deletion(path)  # refusals raise CheckpointDirError, before anything is deleted
            if not os.path.lexists(path):
                return {"ok": True, "missing": True}
            with self._cv:
                self._inflight += 1
            self._commit_q.put((-1, {"delete_path": path}))
            return {"ok": True, "scheduled": steps}
        if op == "give_way":
            # Another job of this user is short of shared memory: an idle saver (clients came and went,
            # none is attached, no work) persists what is newer than its last commit and exits.
            with self._cv:
                idle = bool(self._ever_clients) and not self._clients and self._inflight == 0 and \
                    not self._stop.is_set()
                if msg.get("dry_run"):
                    return {"ok": True, "idle": idle, "idle_s": time.monotonic() - self._idle_since}
                if idle:
                    self._signalled = True  # last words, then exit
                    self._stop.set()
                    self._cv.notify_all()
            return {"ok": True, "giving_way": idle}
        if op == "bye":
            if info is not None:
                info.final = bool(msg.get("final", True))
                if msg.get("intent") == "persist":
                    with self._cv:
                        self._persist_on_exit = True
            return {"ok": True}
        if op == "q_put":
            with self._cv:
                self._queues[str(msg["name"])].append(msg["item"])
                self._cv.notify_all()
            return {"ok": True}
        if op == "q_get":
            name, deadline = str(msg["name"]), time.monotonic() + float(msg.get("timeout_s", 0))
            with self._cv:
                while not self._queues[name]:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stop.is_set():
                        return {"ok": True, "found": False}
                    self._cv.wait(timeout=left)
                return {"ok": True, "found": True, "item": self._queues[name].popleft()}
        if op == "q_size":
            with self._cv:
                return {"ok": True, "size": len(self._queues[str(msg["name"])])}
        if op == "d_update":
            items = msg["items"]
            if not isinstance(items, dict):
                raise TypeError("items must be an object")
            with self._cv:
                self._dicts[str(msg["name"])].update(items)
            return {"ok": True}
        if op == "d_get":
            with self._cv:
                return {"ok": True, "items": dict(self._dicts[str(msg["name"])])}
        raise E.ProtocolError(f"unknown operation {op!r}")

    # ------------------------------------------------------------------ shared memory
    def _alloc(self, local_rank: int, meta_cap: int, data_cap: int, nslots: int) -> str:
        if not (0 <= local_rank < 1 << 16) or meta_cap <= 0 or data_cap < 0 or nslots not in (1, 2):
            raise E.ProtocolError(f"alloc: bad arguments {local_rank=} {meta_cap=} {data_cap=} {nslots=}")
        with self._cv:
            lock = self._alloc_locks[local_rank]
        with lock:  # one allocation of a local rank at a time: each gets the next epoch
            return self._alloc_locked(local_rank, meta_cap, data_cap, nslots)

    def _alloc_locked(self, local_rank: int, meta_cap: int, data_cap: int, nslots: int) -> str:
        existing = segment_paths(self.job_dir, local_rank)
        epoch = existing[-1][0] + 1 if existing else 0
        # Two slots come with a spare: its memory is reserved only while a persist holds a slot and the
        # other holds the newest snapshot (see shm), so only its header page is needed now.
        spare = 1 if nslots == 2 else 0
        need = 4096 + nslots * (4096 + _page(meta_cap) + _page(data_cap)) + spare * 4096
        free = self._shm_free()
        if need > free:  # first this job's own spare slots, then other jobs' idle savers
            self._release_spares_now()
            free = self._shm_free()
        if need > free:
            free = self._make_room(need)
        if need > free:
            raise E.SharedMemoryError(
                f"local rank {local_rank} needs {need} bytes ({need / 2**30:.2f} GiB) of shared memory for "
                f"{nslots} snapshot slot(s) but only {free} bytes are free in {self.job_dir} (ENOSPC: no space "
                "left for the snapshot). Enlarge /dev/shm "
                "(docker run --shm-size=..., a Kubernetes emptyDir with medium: Memory), use FLASHCKPT_SLOTS=1, "
                "or checkpoint less state per rank.")
        path = segment_path(self.job_dir, local_rank, epoch)
        Segment.create(path, local_rank=local_rank, epoch=epoch, nslots=nslots + spare,
                       meta_cap=meta_cap, data_cap=data_cap, spare=spare)
        self._segments[path] = Segment(path, populate=False)
        log.info("allocated %s: %d slot(s), %d bytes", path, nslots, need)
        self._reap_segments(local_rank)
        return path

    def _make_room(self, need: int) -> int:
        """Asks the idle savers of this user's other jobs (no client, no work: kept only for their grace
        period) to give way, the longest idle first, until ``need`` bytes are free. Each persists what
        is newer than its last commit, then exits and frees its shared memory. Returns the bytes free."""
        if self.knobs.shm_limit_bytes and \
                self.knobs.shm_limit_bytes - sum(seg.size for seg in self._segments.values()) < need:
            return self._shm_free()  # this job's own limit binds: other jobs' memory would not help
        root = os.path.dirname(self.job_dir)
        idle: list[tuple[float, str, Client]] = []
        try:
            names = os.listdir(root)
        except OSError:
            return self._shm_free()
        for name in names:
            d = os.path.join(root, name)
            try:
                st = os.lstat(d)
            except OSError:
                continue
            if d == self.job_dir or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            try:
                c = Client(os.path.join(d, SOCKET_NAME), timeout=10)
            except OSError:
                continue
            try:
                r = c.call("give_way", dry_run=True)
            except E.FlashCheckpointError:
                r = {}
            if r.get("idle"):
                idle.append((float(r.get("idle_s", 0.0)), d, c))
            else:
                c.close()
        idle.sort(key=lambda x: -x[0])
        free = self._shm_free()
        try:
            for idle_s, d, c in idle:
                if free >= need:
                    break
                try:
                    if not c.call("give_way").get("giving_way"):
                        continue
                except E.FlashCheckpointError:
                    continue
                log.warning("event=give_way job_dir=%s idle_s=%.0f: it persists its newest snapshot and exits "
                            "to free shared memory for this job", d, idle_s)
                deadline = time.monotonic() + self.knobs.term_timeout_s
                while os.path.exists(os.path.join(d, SOCKET_NAME)) and time.monotonic() < deadline:
                    time.sleep(0.05)
                free = self._shm_free()
        finally:
            for _, _, c in idle:
                c.close()
        return free

    def _shm_free(self) -> int:
        st = os.statvfs(self.job_dir)
        free = st.f_bavail * st.f_frsize
        if self.knobs.shm_limit_bytes:
            used = sum(seg.reserved_bytes() for seg in self._segments.values())
            free = min(free, max(0, self.knobs.shm_limit_bytes - used))
        return free

    def _reap_segments(self, local_rank: int) -> None:
        """Unlinks older segments of ``local_rank`` once none of their slots is pinned or pending.

        Their newest snapshot stays readable until the newest segment holds a complete one."""
        paths = segment_paths(self.job_dir, local_rank)
        if len(paths) < 2:
            return
        newest = self._segment(paths[-1][1])
        if not newest.complete_steps():
            return
        with SharedLock(lock_path(self.job_dir, local_rank)):
            for _epoch, path in paths[:-1]:
                seg = self._segment(path)
                if any(seg.header(i).flags & (FLAG_PINNED | FLAG_PENDING) for i in range(seg.nslots)):
                    continue
                os.unlink(path)
                self._segments.pop(path).close()

    def _prepare_spare(self, seg: Segment) -> None:
        """Reserves and faults in a segment's spare slot as a persist begins, off the trainer's pause: a
        snapshot taken while the persist runs may need it, and first-touching fresh shared memory (the
        kernel zeroes each page) costs ~0.8 s per GB. Best effort: when /dev/shm cannot hold it, the
        snapshot that needs it waits for this persist instead (see shm)."""
        spares = [i for i in range(seg.nslots) if seg.header(i).flags & FLAG_UNRESERVED]
        if not spares:
            return
        try:
            seg.reserve(spares[0], clear_flag=False)  # no lock held: fallocate is idempotent
        except OSError as e:
            log.warning("could not reserve the spare snapshot slot of %s (%d bytes): %s; a snapshot taken "
                        "during this persist will wait for it", seg.path, seg.slot_size, e)
            return
        with SharedLock(lock_path(self.job_dir, seg.local_rank)):
            h = seg.header(spares[0])
            if h.flags & FLAG_UNRESERVED and not h.flags & FLAG_PINNED:
                seg.set_flags(spares[0], h.flags & ~FLAG_UNRESERVED)

    def _release_spare(self, seg: Segment, *, blocking: bool = True, force: bool = False) -> None:
        """Gives back the memory of one slot of a segment with a spare once all its slots are reserved and
        none is held for a persist: the spare is needed only while a persist runs. It is kept for
        ``FLASHCKPT_SPARE_HOLD_S`` after the last persist (reserving it again costs a first touch of
        fresh memory, which the next snapshot during a persist would pay), unless ``force`` (/dev/shm is
        short). The slot given back is the oldest that is neither being written nor the newest complete
        one. Without ``blocking`` it does nothing while the segment's lock is taken (a request handler
        never waits on a trainer)."""
        if seg.nslots < 3:
            return
        if not force and time.monotonic() - self._persist_seen < self.knobs.spare_hold_s:
            return
        lock = SharedLock(lock_path(self.job_dir, seg.local_rank))
        if not lock.acquire(blocking=blocking):
            return
        try:
            hs = [seg.header(i) for i in range(seg.nslots)]
            if any(h.flags & (FLAG_PINNED | FLAG_PENDING | FLAG_UNRESERVED) for h in hs):
                return
            newest = max((i for i, h in enumerate(hs) if h.state == COMPLETE), key=lambda i: (hs[i].seq, i),
                         default=None)
            idle = [i for i, h in enumerate(hs) if i != newest and h.state != WRITING]
            if not idle:
                return
            i = min(idle, key=lambda i: (hs[i].state == COMPLETE, hs[i].seq))
            h = hs[i]
            seg.write_header(i, SlotHeader(EMPTY, FLAG_UNRESERVED | FLAG_PINNED, -1, h.generation + 1,
                                           0, 0, 0, 0, 0.0, h.seq))
        finally:
            lock.release()
        seg.release(i)  # outside the lock: FLAG_PINNED keeps writers away meanwhile
        with SharedLock(lock_path(self.job_dir, seg.local_rank)):
            seg.set_flags(i, seg.header(i).flags & ~FLAG_PINNED)

    def _spare_keeper(self) -> None:
        """Gives the spare slots back once no persist has held a slot for the hold period."""
        while not self._stop.wait(1.0):
            if time.monotonic() - self._persist_seen < self.knobs.spare_hold_s:
                continue
            try:
                segs = list(self._segments.values())
            except RuntimeError:  # changed size meanwhile: next round
                continue
            for seg in segs:
                try:
                    self._release_spare(seg, blocking=False)
                except (OSError, ValueError, E.FlashCheckpointError) as e:  # ValueError: unmapped meanwhile
                    log.debug("giving back the spare slot of %s: %s", seg.path, e)

    def _release_spares_now(self) -> None:
        """/dev/shm is short: every spare slot not held for a persist gives its memory back at once."""
        for seg in list(self._segments.values()):
            try:
                self._release_spare(seg, force=True)
            except (OSError, ValueError, E.FlashCheckpointError) as e:
                log.warning("giving back the spare slot of %s: %s", seg.path, e)

    def _reap_quietly(self, local_rank: int) -> None:
        """Reaps outgrown segments after a snapshot (see ``_reap_segments``), never failing the request.

        ``_alloc`` alone cannot free them: when it runs, the new segment holds no snapshot yet, so the
        old one must stay; it becomes free only once the trainer completed a snapshot in the new one,
        which the trainer's next persist or status request tells us."""
        try:
            self._reap_segments(local_rank)
            paths = segment_paths(self.job_dir, local_rank)
            if paths:
                self._release_spare(self._segment(paths[-1][1]), blocking=False)
        except (OSError, E.FlashCheckpointError) as e:
            log.warning("freeing outgrown segments of local rank %d: %s", local_rank, e)

    def _segment(self, path: str) -> Segment:
        seg = self._segments.get(path)
        if seg is None:
            seg = self._segments[path] = Segment(path, populate=False)
        return seg

    # ------------------------------------------------------------------ persist
    def _enqueue(self, msg: dict[str, Any]) -> None:
        job = _Job(int(msg["step"]), int(msg["rank"]), int(msg["local_rank"]), str(msg["seg_path"]),
                   int(msg["slot"]), int(msg["generation"]), os.path.abspath(str(msg["path"])),
                   msg.get("commit"))
        if os.path.dirname(job.seg_path) != self.job_dir:
            raise E.ProtocolError(f"persist: segment {job.seg_path} is not in this job's runtime dir")
        # Refuses paths outside the checkpoint dir, in its commit records, or in another committed step's
        # directory (the engine checks this too, before its snapshot; this holds for any client).
        self.layout.check_target(job.step, job.path, files=[])
        with self._cv:
            st = self._steps.setdefault(job.step, _StepState())
            st.paths.add(job.path)
            if job.commit is not None:
                st.commits_here = True
            self._inflight += 1
            q = self._persist_q.get(job.local_rank)
            if q is None:
                q = self._persist_q[job.local_rank] = queue.Queue()
                self._spawn(self._persist_loop, f"persist{job.local_rank}", q)
        q.put(job)

    def _persist_loop(self, q: queue.Queue[_Job | None]) -> None:
        # The files are written by the persist worker, whose threads run knobs.persist_nice lower.
        while True:
            job = q.get()
            if job is None:
                return
            try:
                self._persist(job)
                if job.commit is not None:
                    self._commit_q.put((job.step, job.commit))
                else:
                    self._finish(job.step, None, committed=False)
            except Exception as e:  # reported to the trainer; the saver keeps serving
                log.exception("persist of step %d rank %d failed", job.step, job.rank)
                try:  # give the space back now (a full disk), not at the next start
                    self.layout.remove_rank_files(job.step, job.rank)
                except Exception:
                    log.exception("removing the files of the failed persist of step %d rank %d", job.step, job.rank)
                self.layout.write_failed(job.step, job.rank, f"{type(e).__name__}: {e}")
                self._finish(job.step, f"persisting step {job.step} of rank {job.rank} to {job.path} failed: "
                             f"{type(e).__name__}: {e}", committed=False)

    def _persist(self, job: _Job) -> None:
        t0 = time.perf_counter()
        seg = self._segment(job.seg_path)
        lock = SharedLock(lock_path(self.job_dir, seg.local_rank))
        with lock:
            h = seg.header(job.slot)
            if h.state != COMPLETE or h.generation != job.generation or h.step != job.step:
                seg.release_pending(job.slot, job.generation)
                raise E.PersistError(f"the snapshot of step {job.step} was overwritten before it was persisted")
            seg.set_flags(job.slot, h.flags | FLAG_PINNED)
        self._persist_seen = time.monotonic()
        self._prepare_spare(seg)
        try:
            self.layout.clear_markers(job.step, job.rank)  # an earlier save's of the same step
            # The worker writes the intent and the files (it maps the segment read-only); then the done marker.
            recs, is_set = self._worker.persist(seg_path=seg.path, slot=job.slot, generation=job.generation,
                                                step=job.step, rank=job.rank, path=job.path)
            self.layout.write_done(job.step, job.rank, recs, base=job.path if is_set else "", saved_at=h.wall_time)
        finally:
            with lock:
                h2 = seg.header(job.slot)
                if h2.generation == job.generation:
                    seg.set_flags(job.slot, h2.flags & ~(FLAG_PINNED | FLAG_PENDING))
            self._persist_seen = time.monotonic()
            try:
                self._release_spare(seg)
            except (OSError, E.FlashCheckpointError) as e:
                log.warning("giving back the spare slot of %s: %s", seg.path, e)
        dt = time.perf_counter() - t0
        size = sum(r.size for r in recs)
        with self._cv:
            self.stats.persisted_bytes += size
            self.stats.persist_seconds += dt
            self.stats.last_persist_s = dt
        log.info("event=persist step=%d rank=%d bytes=%d seconds=%.3f path=%s", job.step, job.rank,
                 size, dt, job.path)

    # ------------------------------------------------------------------ last words
    def _last_words_thread(self) -> None:
        try:
            self.save_shm_to_storage(timeout=self.knobs.commit_timeout_s)
        except Exception:
            log.exception("last-words persist failed")
        finally:
            with self._cv:
                self._work_done()

    def _work_done(self) -> None:
        """One unit of in-flight work (persist, commit, deletion, last words) ended. Holds ``_cv``."""
        self._inflight -= 1
        if self._inflight == 0 and not self._clients:
            self._idle_since = time.monotonic()
        self._cv.notify_all()

    def save_shm_to_storage(self, timeout: float | None = None) -> int | None:
        """Persists and commits the newest snapshot that every persisting local rank holds in memory,
        when it is newer than the last commit and not already being persisted. Waits for it.

        Safe to call concurrently and repeatedly (idempotent). Used after a trainer crash, on SIGTERM,
        and by ``flashckpt-run`` before it restarts failed workers.

        Returns:
            The step persisted (or already in flight), or None when there was nothing newer to persist.
        """
        with self._last_words_lock:
            with self._cv:
                persisters = dict(self._persisters)
                known = set(self._steps)
                newest_committed = self._committed[-1] if self._committed else -1
            saved_at = self._saved_at(newest_committed)
            if not persisters:
                return None
            held: dict[int, dict[int, tuple[Segment, int]]] = {}  # local rank -> step -> (segment, slot)
            for lr in persisters:
                segs = [self._segment(path) for _epoch, path in segment_paths(self.job_dir, lr)]
                held[lr] = {h.step: (seg, slot) for seg, slot, h in live_snapshots(segs)}
            common = set.intersection(*(set(steps) for steps in held.values()))

            def newer(s: int) -> bool:  # saved after the newest commit's snapshot (unknown time: by step)
                lr = min(held)
                seg, slot = held[lr][s]
                ref = saved_at.get(str(persisters[lr].rank), 0.0)  # that rank's own snapshot: one clock
                return seg.header(slot).wall_time > ref if ref else s > newest_committed

            for step in sorted((s for s in common if newer(s)), reverse=True):
                jobs = self._last_words_jobs(step, persisters, held)
                if jobs is not None:
                    break
            else:
                return None
            if step not in known:
                log.warning("event=last_words step=%d ranks=%s", step, sorted(i.rank for i in persisters.values()))
                for job in jobs:
                    if not job["path"]:
                        log.error("step %d of local rank %d has no persist path; not persisted", step,
                                  job["local_rank"])
                        return None
                held_jobs: list[dict[str, Any]] = []
                for job in jobs:
                    if not self._hold_slot(job):
                        for j in held_jobs:
                            self._unhold_slot(j)
                        log.warning("last words: the snapshot of step %d was overwritten meanwhile", step)
                        return None
                    held_jobs.append(job)
                for i, job in enumerate(jobs):
                    try:
                        self._enqueue(job)
                    except BaseException:
                        for j in jobs[i:]:
                            self._unhold_slot(j)
                        raise
        self._wait_step(step, timeout)
        return step

    def _hold_slot(self, job: dict[str, Any]) -> bool:
        """Flags a last-words persist's slot PENDING (as a trainer does for its persists), so that no
        snapshot overwrites it before the persist pins it; False when it was overwritten already."""
        seg = self._segment(job["seg_path"])
        with SharedLock(lock_path(self.job_dir, seg.local_rank)):
            return seg.hold_pending(job["slot"], job["generation"], job["step"])

    def _unhold_slot(self, job: dict[str, Any]) -> None:
        seg = self._segment(job["seg_path"])
        with SharedLock(lock_path(self.job_dir, seg.local_rank)):
            seg.release_pending(job["slot"], job["generation"])

    def _saved_at(self, step: int) -> dict[str, float]:
        """Rank -> the wall time of the snapshot committed ``step`` was persisted from ({} when unknown)."""
        if step < 0:
            return {}
        try:
            return {str(r): float(t) for r, t in self.layout.read_manifest(step).extra.get("saved_at_ranks", {}).items()}
        except (E.FlashCheckpointError, TypeError, ValueError):
            return {}

    def _last_words_jobs(self, step: int, persisters: dict[int, _ClientInfo],
                         held: dict[int, dict[int, tuple[Segment, int]]]) -> list[dict[str, Any]] | None:
        """The persist requests of ``step`` for every persisting local rank; None when a slot's
        metadata is unreadable (then an older step is tried)."""
        jobs = []
        for lr, info in persisters.items():
            seg, slot = held[lr][step]
            h = seg.header(slot)
            try:
                name = str(seg.read_meta(slot, h).get("name", ""))
            except (E.FlashCheckpointError, ValueError):
                return None
            jobs.append({"step": step, "rank": info.rank, "local_rank": lr, "seg_path": seg.path, "slot": slot,
                         "generation": h.generation, "path": name, "commit": info.commit})
        return jobs

    def _wait_step(self, step: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not self._step_done(step):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise E.CheckpointTimeoutError(f"last words: step {step} not committed within {timeout:.0f} s")
                self._cv.wait(timeout=0.2 if left is None else min(left, 0.2))

    def _step_done(self, step: int) -> bool:
        st = self._steps.get(step)
        if st is None:
            return True
        if st.commits_here:
            return st.status in ("committed", "failed")
        return st.status != "persisting"

    # ------------------------------------------------------------------ commit
    def _commit_loop(self) -> None:
        while True:
            item = self._commit_q.get()
            if item is None:
                return
            step, spec = item
            if "delete" in spec or "delete_path" in spec:  # retention, ordered after the commits queued before it
                try:
                    if "delete" in spec:
                        self._delete_steps([int(x) for x in spec["delete"]])
                    else:
                        self._delete_path(spec["delete_path"])
                except Exception:
                    log.exception("retention failed to delete %s", spec.get("delete", spec.get("delete_path")))
                with self._cv:
                    self._work_done()
                continue
            try:
                self.layout.commit(step, [int(r) for r in spec["ranks"]], int(spec["world_size"]),
                                   replicated=bool(spec.get("replicated", False)),
                                   extra=dict(spec.get("extra", {})),
                                   timeout=self.knobs.commit_timeout_s,
                                   stopping=lambda: self._stop.is_set() and not self._signalled)
                self._committed_now(step)
                log.info("event=commit step=%d ranks=%s", step, spec["ranks"])
                self._finish(step, None, committed=True)
            except TrackerUpdateError as e:  # committed: never reported as a failed step
                log.error("event=commit step=%d ranks=%s: %s", step, spec["ranks"], e)
                self._committed_now(step)
                with self._cv:
                    self._errors.append({"step": step, "error": str(e), "committed": True})
                self._finish(step, None, committed=True)
            except Exception as e:
                log.exception("commit of step %d failed", step)
                self._finish(step, f"committing step {step} failed: {e}", committed=False)

    def _committed_now(self, step: int) -> None:
        """Adds ``step`` to the committed steps, less those its commit superseded."""
        with self._cv:  # in commit order: the step committed last is the newest
            self._committed = [s for s in self._committed
                               if s != step and self.storage.exists(self.layout.manifest_path(s))] + [step]

    def _finish(self, step: int, error: str | None, *, committed: bool) -> None:
        with self._cv:
            st = self._steps.setdefault(step, _StepState())
            if error is not None:
                st.status, st.error = "failed", error
                self._errors.append({"step": step, "error": error})
            elif committed:
                st.status = "committed"
            elif st.status == "persisting":
                st.status = "persisted"
            self._work_done()

    def _status(self, cursor: int) -> dict[str, Any]:
        with self._cv:
            return {"committed": list(self._committed), "errors": self._errors[cursor:],
                    "cursor": len(self._errors), "inflight": self._inflight,
                    "last_persist_s": self.stats.last_persist_s}

    def _wait(self, timeout: float, cursor: int) -> dict[str, Any]:
        deadline = time.monotonic() + timeout if timeout > 0 else None
        with self._cv:
            while self._inflight > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise E.CheckpointTimeoutError(
                        f"wait(): {self._inflight} persist(s) still running after {timeout:.0f} s")
                self._cv.wait(timeout=min(left, 1.0) if left is not None else 1.0)
        return self._status(cursor)

    def _path_deletion(self, path: str) -> list[int]:
        """The committed steps whose files all lie at or under ``path``, which a deletion strategy's
        ``delete_func`` may remove (with them).

        Raises:
            CheckpointDirError: ``path`` may not be deleted: it is outside the checkpoint dir (or reaches
                out through a symlink), the checkpoint dir itself, flashckpt's commit records, or holds the
                newest committed step, only part of a committed step, or a step being persisted.
        """
        root, meta = self.layout.root, self.layout.meta
        what = f"delete_func({path!r})"
        if path == root:
            raise E.CheckpointDirError(f"{what}: that is the checkpoint dir itself; delete one checkpoint's file or "
                                       "directory inside it")
        try:
            self.layout.rel(path)
        except E.CheckpointDirError:
            raise E.CheckpointDirError(f"{what}: {path} is outside the checkpoint dir {root} (or reaches outside it "
                                       "through a symlink); only checkpoints inside it are deleted") from None
        if path == meta or path.startswith(meta + os.sep) or meta.startswith(path + os.sep):
            raise E.CheckpointDirError(f"{what}: {path} holds flashckpt's commit records ({meta}); they are "
                                       "removed with their steps, never directly")
        with self._cv:
            committed = list(self._committed)
            busy = {s: set(st.paths) for s, st in self._steps.items() if not self._step_done(s)}
        for s, targets in busy.items():
            for t in targets:
                if t == path or t.startswith(path + os.sep) or path.startswith(t + os.sep):
                    raise E.CheckpointDirError(f"{what}: step {s} is being persisted to {t}; it is not deleted "
                                               "while in flight (try again after its commit)")
        covered = []

        def under(f: str) -> bool:
            return f == path or f.startswith(path + os.sep)

        for s in committed:
            try:
                m = self.layout.read_manifest(s)
            except E.CheckpointCorruptError:
                continue
            files = [os.path.join(root, f.path) for f in m.all_files()]
            inside = [f for f in files if under(f)]
            if not inside:
                continue
            if s == committed[-1]:
                raise E.CheckpointDirError(f"{what}: {path} holds step {s}, the newest committed checkpoint, which "
                                           "is never deleted")
            if len(inside) < len(files):
                rest = [f for f in files if not under(f)]
                raise E.CheckpointDirError(f"{what}: {path} holds only part of committed step {s} (its other files: "
                                           f"{', '.join(rest[:3])}{', ...' if len(rest) > 3 else ''}); delete the "
                                           "whole checkpoint (or the step: delete_func(step))")
            covered.append(s)
        return covered

    def _delete_path(self, path: str) -> None:
        """Deletes ``path`` for a deletion strategy: the committed steps it holds (their records first),
        then what is left there. Checked again here: a persist or commit may have come since the request."""
        try:
            steps = self._path_deletion(path)
        except E.CheckpointDirError as e:
            log.error("not deleting %s: %s", path, e)
            return
        if steps:
            for s in steps:
                self.layout.delete_step(s)
            with self._cv:
                self._committed = [s for s in self._committed if s not in steps]
        if os.path.isdir(path) and not os.path.islink(path):
            self.storage.remove_tree(path)
        else:
            self.storage.remove(path)
        log.info("event=retention deleted_path=%s steps=%s", path, steps)

    def _delete_steps(self, steps: list[int]) -> list[int]:
        with self._cv:
            committed = list(self._committed)
        if not committed:
            return []
        newest = committed[-1]
        deleted = []
        for s in steps:
            if s == newest or s not in committed:
                continue  # never the newest committed step, never a step that is not committed
            self.layout.delete_step(s)
            deleted.append(s)
        with self._cv:
            self._committed = [s for s in self._committed if s not in deleted]
        if deleted:
            log.info("event=retention deleted=%s", deleted)
        return deleted


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


def _page(n: int) -> int:
    return (n + 4095) // 4096 * 4096


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


# ---------------------------------------------------------------------- daemon
def ensure_saver(job_dir: str, checkpoint_dir: str, knobs: Knobs) -> Client:
    """Connects to the job's saver on this node, starting a detached daemon first when none runs.

    The runtime dirs are checked first (``open_private_dir``: ours, private, no symbolic link), and the
    client refuses a socket served by another uid, before anything is sent on it. The daemon reports
    over a pipe (``--ready-fd``) that it serves, or why it could not start: that report reaches the
    trainer even when the daemon's log cannot be written (a full /dev/shm). A daemon that does not come
    up in time is stopped, so a failed start leaves no process behind."""
    path = os.path.join(job_dir, SOCKET_NAME)
    try:
        make_private_dir(job_dir)
    except OSError as e:
        raise E.SaverError(f"cannot prepare the saver's runtime dir {job_dir}: {_explain_os_error(e, job_dir)}") from e
    try:
        return Client(path, timeout=knobs.rpc_timeout_s)
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    try:
        spawn_lock = lock_job(job_dir)
    except OSError as e:
        raise E.SaverError(f"cannot prepare the saver's runtime dir {job_dir}: {_explain_os_error(e, job_dir)}") from e
    try:
        try:
            return Client(path, timeout=knobs.rpc_timeout_s)
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        return _spawn_saver(job_dir, checkpoint_dir, knobs)
    finally:
        spawn_lock.release()


def _spawn_saver(job_dir: str, checkpoint_dir: str, knobs: Knobs) -> Client:
    """Starts the daemon (the job's spawn lock is held) and connects to it."""
    path = os.path.join(job_dir, SOCKET_NAME)
    log_path = os.path.join(job_dir, _LOG_NAME)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        dir_fd = open_private_dir(job_dir)
        try:
            logf: Any = os.open(_LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                                0o600, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        no_log = ""
    except OSError as e:
        logf, no_log = subprocess.DEVNULL, f"its log {log_path} could not be created: {_explain_os_error(e, job_dir)}"
    rfd, wfd = os.pipe()
    try:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", SAVER_MODULE, "--daemonize", "--job-dir", job_dir,
                 "--checkpoint-dir", os.path.abspath(checkpoint_dir), "--ready-fd", str(wfd)],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, close_fds=True, pass_fds=(wfd,),
                start_new_session=True, env=env, cwd="/")
        finally:
            os.close(wfd)
            if isinstance(logf, int) and logf >= 0:
                os.close(logf)
        deadline = time.monotonic() + knobs.spawn_timeout_s
        rc = proc.wait(timeout=knobs.spawn_timeout_s)
        report = _read_ready(rfd, deadline)
    finally:
        os.close(rfd)

    def failed(what: str) -> E.SaverError:
        tail = _tail(log_path).strip()
        where = no_log or (f"see {log_path}:\n{tail}" if tail else f"its log {log_path} is empty")
        return E.SaverError(f"{what}; {where}")

    pid = int(report.get("pid", 0))
    if "error" in report:
        raise failed(f"the saver could not start: {report['error']}")
    if not report.get("ready"):
        if pid and pid_running(pid):  # neither ready nor failed within the time: stop it, it would serve nobody
            os.kill(pid, signal.SIGTERM)
            raise failed(f"the saver did not come up within {knobs.spawn_timeout_s:.0f} s and was stopped")
        raise failed(f"the saver died while starting (exit {rc})" if rc else "the saver died while starting")
    try:
        return Client(path, timeout=knobs.rpc_timeout_s)
    except (FileNotFoundError, ConnectionRefusedError) as e:
        raise failed(f"the saver (pid {pid}) reported ready but its socket {path} refused: {e}") from None


def _read_ready(fd: int, deadline: float) -> dict[str, Any]:
    """The daemon's start-up report: one JSON object per line (``{"pid": N}``, then ``{"ready": true}``
    or ``{"error": "..."}``), merged; stops at ready/error, at end of file (every writer gone: the
    daemon died) or at ``deadline``."""
    buf = b""
    out: dict[str, Any] = {}
    while "ready" not in out and "error" not in out:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            try:
                out.update(json.loads(line))
            except ValueError:
                pass
    return out


def _report(fd: int | None, msg: dict[str, Any]) -> None:
    """Writes one start-up report line to the spawner's pipe (see ``_read_ready``); never raises."""
    if fd is None:
        return
    try:
        os.write(fd, json.dumps(msg).encode() + b"\n")
    except OSError:
        pass


def _explain_os_error(e: BaseException, where: str) -> str:
    """``e`` in words; a full file system (ENOSPC/EDQUOT) says so and what to do."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"no space left in {where} (ENOSPC: {e.strerror}): the file system of the runtime dir "
                "(/dev/shm, or FLASHCKPT_RUNTIME_DIR) is full. Free space there (`flashckpt gc` removes the "
                "shared memory of dead jobs), enlarge it (docker run --shm-size=...) or set "
                "FLASHCKPT_RUNTIME_DIR to a larger RAM-backed file system")
    return f"{type(e).__name__}: {e}"


def lock_job(job_dir: str) -> SharedLock:
    """Takes the job's spawn lock, which serializes starting a saver with a saver's clean-up.

    Retries when the lock file was unlinked (by an exiting saver) while we waited on it."""
    path = os.path.join(job_dir, _SPAWN_LOCK)
    while True:
        make_private_dir(job_dir)
        lock = SharedLock(path)
        lock.acquire()
        try:
            same = os.lstat(path).st_ino == os.fstat(lock.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return lock
        lock.release()


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {SAVER_MODULE}", description="flashckpt node saver")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--daemonize", action="store_true", help="fork into the background and return at once")
    p.add_argument("--ready-fd", type=int, default=None,
                   help="a pipe to report on: a JSON line with the daemon's pid, then one saying it serves "
                        "(ready) or why it could not start (error)")
    args = p.parse_args(argv)
    if args.daemonize:
        child = os.fork()
        if child > 0:
            # The spawner reaps this parent; the daemon is re-parented and never a zombie of it. Its pid
            # lets the spawner stop it should it not come up.
            _report(args.ready_fd, {"pid": child})
            os._exit(0)
    logging.basicConfig(level=os.environ.get("FLASHCKPT_SAVER_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    saver = CheckpointSaver(args.job_dir, args.checkpoint_dir)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: saver.request_stop(last_words=True))
    try:
        saver.start()
    except BaseException as e:
        # A saver that cannot serve exits and removes what it made; the spawner gets the reason over the
        # pipe (the log may be on the very file system that is full).
        log.exception("the saver could not start")
        _report(args.ready_fd, {"error": _explain_os_error(e, args.job_dir)})
        saver.shutdown(drain_timeout=0)
        return 1
    _report(args.ready_fd, {"ready": True, "pid": os.getpid()})
    if args.ready_fd is not None:
        os.close(args.ready_fd)
    saver.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
