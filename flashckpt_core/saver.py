"""The node's saver: owns the shared memory, persists snapshots and commits them.

One saver runs per node and job. It is started by a launcher (``flashckpt-run``) or, under plain
``torchrun``/``python``, as a detached daemon by the first engine of the node (``ensure_saver``). It
serves trainers over a Unix socket in the job's 0700 runtime dir, persists on one thread per local
rank, commits on one thread, and exits once it has no clients and no work: at once when every client
said a final goodbye, else after a grace period that lets a restarted trainer re-attach. Trainers that
vanish without a goodbye (a crash) trigger the last-words persist of the newest complete snapshot.
"""

from __future__ import annotations

import argparse
import collections
import functools
import logging
import os
import pickle
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import errors as E
from ._protocol import Client, peer_uid, recv_msg, send_msg
from ._tree import TensorMeta, build_tensor, split_opaque, unflatten
from .commit import CommitLayout
from .config import Knobs, is_default_runtime_dir, make_private_dir
from .files import FileSet, is_fileset_tree
from .filewriter import write_parts
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
from .storage import CheckpointStorage, FileRecord, HashingWriter, PosixDiskStorage
from .torchfile import torch_save_parts, zip_crc_slots

__all__ = ["CheckpointSaver", "ensure_saver", "SOCKET_NAME"]

log = logging.getLogger(__name__)

SOCKET_NAME = "saver.sock"
_SPAWN_LOCK = "spawn.lock"
_LOG_NAME = "saver.log"
_PID_NAME = "saver.pid"


class _Opaque:
    """An opaque leaf inside a persisted file: unpickles to the trainer's object with pickle.loads."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return (pickle.loads, (self.raw,))


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
        self.layout = CommitLayout(checkpoint_dir, self.storage)
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
        self._sock: socket.socket | None = None
        self.stats = _Stats()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Creates the runtime dir, adopts segments left by an earlier saver, binds the socket."""
        make_private_dir(self.job_dir)
        self._adopt_segments()
        self._committed = self.layout.committed_steps()
        cleaned = self.layout.clean_uncommitted()
        if cleaned:
            log.warning("removed half-written, uncommitted steps %s left by an earlier run", cleaned)
        self.layout.finish_trackers()
        path = os.path.join(self.job_dir, SOCKET_NAME)
        if os.path.exists(path):
            os.unlink(path)
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
        log.info("saver %d serving %s for %s", os.getpid(), self.job_dir, self.layout.root)

    def _spawn(self, target: Any, name: str, *args: Any) -> threading.Thread:
        t = threading.Thread(target=target, args=args, name=f"flashckpt-saver-{name}", daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _adopt_segments(self) -> None:
        """Segments survive a killed saver: keep them, clearing flags of persists that died with it."""
        for name in os.listdir(self.job_dir):
            if not name.endswith(".shm"):
                continue
            path = os.path.join(self.job_dir, name)
            try:
                seg = Segment(path, populate=False)
            except (OSError, E.FlashCheckpointError):
                os.unlink(path)
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
                        break
                    # A saver nobody attached to yet waits at least as long as its spawner does, so a
                    # short grace cannot make it exit under the first trainer's hello.
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
                log.exception("last-words persist on SIGTERM failed")
        self.shutdown()

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
        spawn_lock = lock_job(self.job_dir)
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
            for name in os.listdir(self.job_dir):
                if name != _SPAWN_LOCK:
                    p = os.path.join(self.job_dir, name)
                    shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
            os.unlink(os.path.join(self.job_dir, _SPAWN_LOCK))
            os.rmdir(self.job_dir)
            if is_default_runtime_dir(os.path.dirname(self.job_dir)):
                try:
                    os.rmdir(os.path.dirname(self.job_dir))  # our per-user root, when no other job uses it
                except OSError:
                    pass
        except OSError as e:
            log.warning("cleaning up %s: %s", self.job_dir, e)
        finally:
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
                if op == "hello":
                    try:
                        info = _ClientInfo(int(msg["rank"]), int(msg["local_rank"]), int(msg.get("pid", 0)),
                                           persists=bool(msg.get("persists", False)), commit=msg.get("commit"))
                    except (KeyError, TypeError, ValueError) as e:  # reply, rather than drop the connection
                        send_msg(conn, {"ok": False, "error": f"bad 'hello' request: {e!r}", "kind": "ProtocolError"})
                        continue
                    with self._cv:
                        refused = self._stop.is_set()  # exiting: its runtime dir is about to be removed
                        if not refused:
                            if not self._clients:
                                self._session_final = True  # a new session of clients begins
                            self._clients[cid] = info
                            self._ever_clients += 1
                            if info.persists:  # who persists what, for last words after a crash
                                self._persisters[info.local_rank] = info
                    if refused:
                        send_msg(conn, {"ok": False, "kind": "SaverError",
                                        "error": "the saver is shutting down; start or reach the next one"})
                        return
                try:
                    reply = self._handle(op, msg, info)
                except E.FlashCheckpointError as e:
                    reply = {"ok": False, "error": str(e), "kind": type(e).__name__}
                except (KeyError, TypeError, ValueError) as e:
                    reply = {"ok": False, "error": f"bad {op!r} request: {e!r}", "kind": "ProtocolError"}
                except OSError as e:
                    reply = {"ok": False, "error": f"{op}: {e}", "kind": "PersistError"}
                send_msg(conn, reply)
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
        if op == "bye":
            if info is not None:
                info.final = bool(msg.get("final", True))
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
        existing = segment_paths(self.job_dir, local_rank)
        epoch = existing[-1][0] + 1 if existing else 0
        # Two slots come with a spare: its memory is reserved only while a persist holds a slot and the
        # other holds the newest snapshot (see shm), so only its header page is needed now.
        spare = 1 if nslots == 2 else 0
        need = 4096 + nslots * (4096 + _page(meta_cap) + _page(data_cap)) + spare * 4096
        free = self._shm_free()
        if need > free:
            raise E.SharedMemoryError(
                f"local rank {local_rank} needs {need} bytes ({need / 2**30:.2f} GiB) of shared memory for "
                f"{nslots} snapshot slot(s) but only {free} bytes are free in {self.job_dir}. Enlarge /dev/shm "
                "(docker run --shm-size=..., a Kubernetes emptyDir with medium: Memory), use FLASHCKPT_SLOTS=1, "
                "or checkpoint less state per rank.")
        path = segment_path(self.job_dir, local_rank, epoch)
        Segment.create(path, local_rank=local_rank, epoch=epoch, nslots=nslots + spare,
                       meta_cap=meta_cap, data_cap=data_cap, spare=spare)
        self._segments[path] = Segment(path, populate=False)
        log.info("allocated %s: %d slot(s), %d bytes", path, nslots, need)
        self._reap_segments(local_rank)
        return path

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

    def _release_spare(self, seg: Segment) -> None:
        """Gives back the memory of one slot of a segment with a spare once all its slots are reserved and
        none is held for a persist: the spare is needed only while a persist runs. The slot given back is
        the oldest that is neither being written nor the newest complete one."""
        if seg.nslots < 3:
            return
        with SharedLock(lock_path(self.job_dir, seg.local_rank)):
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
        seg.release(i)  # outside the lock: FLAG_PINNED keeps writers away meanwhile
        with SharedLock(lock_path(self.job_dir, seg.local_rank)):
            seg.set_flags(i, seg.header(i).flags & ~FLAG_PINNED)

    def _reap_quietly(self, local_rank: int) -> None:
        """Reaps outgrown segments after a snapshot (see ``_reap_segments``), never failing the request.

        ``_alloc`` alone cannot free them: when it runs, the new segment holds no snapshot yet, so the
        old one must stay; it becomes free only once the trainer completed a snapshot in the new one,
        which the trainer's next persist or status request tells us."""
        try:
            self._reap_segments(local_rank)
            paths = segment_paths(self.job_dir, local_rank)
            if paths:
                self._release_spare(self._segment(paths[-1][1]))
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
        self.layout.rel(job.path)  # refuses paths outside the checkpoint dir
        with self._cv:
            st = self._steps.setdefault(job.step, _StepState())
            if job.commit is not None:
                st.commits_here = True
            self._inflight += 1
            q = self._persist_q.get(job.local_rank)
            if q is None:
                q = self._persist_q[job.local_rank] = queue.Queue()
                self._spawn(self._persist_loop, f"persist{job.local_rank}", q)
        q.put(job)

    def _persist_loop(self, q: queue.Queue[_Job | None]) -> None:
        if self.knobs.persist_nice:
            # Linux nice is per thread; the writer threads this one starts inherit it. The saver's other
            # threads (snapshot bookkeeping, commits) keep their priority.
            try:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self.knobs.persist_nice)
            except OSError as e:
                log.warning("could not lower the persist thread's priority: %s", e)
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
                if h.generation == job.generation:
                    seg.set_flags(job.slot, h.flags & ~FLAG_PENDING)
                raise E.PersistError(f"the snapshot of step {job.step} was overwritten before it was persisted")
            seg.set_flags(job.slot, h.flags | FLAG_PINNED)
        self._prepare_spare(seg)
        try:
            self.layout.clear_markers(job.step, job.rank)  # an earlier save's of the same step
            tree = self._zero_copy_tree(seg, job.slot, h)
            is_set = is_fileset_tree(tree)
            if is_set:
                recs = self._persist_fileset(job, FileSet.decode(tree))
            else:
                self.layout.write_intent(job.step, job.rank, [job.path])
                recs = [self.storage.write_file(job.path, functools.partial(_torch_save, tree))]
            del tree  # drop the views of the segment before it may be unmapped
            self.layout.write_done(job.step, job.rank, recs, base=job.path if is_set else "", saved_at=h.wall_time)
        finally:
            with lock:
                h2 = seg.header(job.slot)
                if h2.generation == job.generation:
                    seg.set_flags(job.slot, h2.flags & ~(FLAG_PINNED | FLAG_PENDING))
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

    def _persist_fileset(self, job: _Job, fs: FileSet) -> list[FileRecord]:
        """Writes a rank's file set: plain files in place; commit-time and tracker files staged for the
        commit. The intent names every final path a crash could leave behind (not trackers: they are
        only written once the step is committed)."""
        targets = {}
        for i, (name, e) in enumerate(sorted(fs.items())):
            final = self.layout.abs(name) if e.kind == "tracker" else os.path.join(job.path, name)
            self.layout.rel(final)  # inside the checkpoint dir
            targets[name] = (final, self.layout.staged_path(job.step, job.rank, i) if e.kind != "file" else "")
        self.layout.write_intent(job.step, job.rank, [f for n, (f, _) in targets.items() if fs[n].kind != "tracker"])
        recs = []
        for name, e in sorted(fs.items()):
            final, staged = targets[name]
            writer = _torch_save if e.format == "torch" else _raw_save
            rec = self.storage.write_file(staged or final, functools.partial(writer, e.data))
            recs.append(FileRecord(final, rec.size, rec.xxh3, e.format, name, e.kind, staged))
        return recs

    def _zero_copy_tree(self, seg: Segment, slot: int, h: Any) -> Any:
        """The snapshot's tree with tensors viewing the segment (no copy) and opaque leaves embedded."""
        meta = seg.read_meta(slot, h)
        data_off = seg.data_off(slot)
        storages: dict[tuple[int, int], torch.UntypedStorage] = {}
        tensors = []
        for v in meta["tensors"]:
            m = TensorMeta.from_json(v)
            key = (m.offset, m.nbytes)
            st = storages.get(key)
            if st is None:
                st = (torch.frombuffer(seg.mm, dtype=torch.uint8, count=m.nbytes, offset=data_off + m.offset)
                      .untyped_storage() if m.nbytes else torch.UntypedStorage(0))
                storages[key] = st
            tensors.append(build_tensor(st, m))
        blob_off = data_off + h.tensor_bytes
        blob = seg.mm[blob_off: blob_off + h.blob_len]
        opaque = [_Opaque(b) for b in split_opaque(blob, meta["opaque"])]
        return unflatten(meta["tree"], tensors, opaque)

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

            def newer(s: int) -> bool:  # saved after the newest commit's snapshot (legacy manifests: by step)
                seg, slot = held[min(held)][s]
                return seg.header(slot).wall_time > saved_at if saved_at else s > newest_committed

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
                for job in jobs:
                    self._enqueue(job)
        self._wait_step(step, timeout)
        return step

    def _saved_at(self, step: int) -> float:
        """The snapshot wall time committed ``step`` was persisted from; 0.0 when unknown."""
        if step < 0:
            return 0.0
        try:
            return float(self.layout.read_manifest(step).extra.get("saved_at", 0.0))
        except (E.FlashCheckpointError, TypeError, ValueError):
            return 0.0

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
            if "delete" in spec:  # retention, ordered after the commits queued before it
                try:
                    self._delete_steps([int(x) for x in spec["delete"]])
                except Exception:
                    log.exception("retention failed to delete steps %s", spec["delete"])
                with self._cv:
                    self._work_done()
                continue
            try:
                self.layout.commit(step, [int(r) for r in spec["ranks"]], int(spec["world_size"]),
                                   replicated=bool(spec.get("replicated", False)),
                                   extra=dict(spec.get("extra", {})),
                                   timeout=self.knobs.commit_timeout_s,
                                   stopping=lambda: self._stop.is_set() and not self._signalled)
                with self._cv:
                    self._committed = [s for s in self._committed if s != step] + [step]  # commit order
                log.info("event=commit step=%d ranks=%s", step, spec["ranks"])
                self._finish(step, None, committed=True)
            except Exception as e:
                log.exception("commit of step %d failed", step)
                self._finish(step, f"committing step {step} failed: {e}", committed=False)

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


def _page(n: int) -> int:
    return (n + 4095) // 4096 * 4096


def _raw_save(parts: list[Any], path: str) -> tuple[int, str]:
    return write_parts(path, parts)


def _torch_save(tree: Any, path: str) -> tuple[int, str]:
    """Writes ``torch.save(tree)``'s file to ``path``; returns (size, xxh3).

    The file is split into its ``torch.save`` bytes and the storages' data (``torch_save_parts``) and
    streamed to disk with direct I/O (``write_parts``), the zip CRC-32s filled in on the way when torch's
    CRC option is on (its default). A torch whose archive layout the split does not recognize gets a
    plain ``torch.save`` instead (``_torch_save_plain``)."""
    try:
        parts = torch_save_parts(tree)
        slots = zip_crc_slots(parts) if torch.serialization.get_crc32_options() else None
    except E.FlashCheckpointError as e:
        global _warned_plain
        if not _warned_plain:
            _warned_plain = True
            log.warning("%s; persisting with torch.save instead", e)
        return _torch_save_plain(tree, path)
    return write_parts(path, parts, crc_slots=slots)


_warned_plain = False


def _torch_save_plain(tree: Any, path: str) -> tuple[int, str]:
    """``torch.save`` through a Python file object that checksums as it writes; returns (size, xxh3).

    Writing through a file object also makes a failing write surface as its OSError: given a path,
    torch's C++ writer reports ENOSPC, EDQUOT or EIO only as an opaque ``RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos ...``, while here the failing ``write`` raises the OSError,
    which torch leaves as the RuntimeError's context: re-raise it, so the trainer's PersistError says
    "No space left on device"."""
    with open(path, "wb") as f:
        w = HashingWriter(f)
        try:
            torch.save(tree, w)  # type: ignore[arg-type]
        except RuntimeError as e:
            if isinstance(e.__context__, OSError):
                raise e.__context__ from e
            raise
    return w.size, w.hexdigest()


# ---------------------------------------------------------------------- daemon
def ensure_saver(job_dir: str, checkpoint_dir: str, knobs: Knobs) -> Client:
    """Connects to the job's saver on this node, starting a detached daemon first when none runs."""
    path = os.path.join(job_dir, SOCKET_NAME)
    try:
        return Client(path, timeout=knobs.rpc_timeout_s)
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    make_private_dir(job_dir)
    if os.stat(job_dir).st_uid != os.getuid():
        raise E.SaverError(f"the runtime dir {job_dir} belongs to another user; set FLASHCKPT_RUNTIME_DIR")
    spawn_lock = lock_job(job_dir)
    try:
        try:
            return Client(path, timeout=knobs.rpc_timeout_s)
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        log_path = os.path.join(job_dir, _LOG_NAME)
        try:
            os.unlink(os.path.join(job_dir, _PID_NAME))  # left by a saver that was killed
        except FileNotFoundError:
            pass
        env = dict(os.environ)
        pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.setdefault("OMP_NUM_THREADS", "1")
        with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "flashckpt_core.saver", "--daemonize", "--job-dir", job_dir,
                 "--checkpoint-dir", os.path.abspath(checkpoint_dir)],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, close_fds=True, start_new_session=True,
                env=env, cwd="/")
        rc = proc.wait(timeout=knobs.spawn_timeout_s)
        if rc != 0:
            raise E.SaverError(f"starting the saver failed (exit {rc}); see {log_path}:\n{_tail(log_path)}")
        deadline = time.monotonic() + knobs.spawn_timeout_s
        while True:
            try:
                return Client(path, timeout=knobs.rpc_timeout_s)
            except (FileNotFoundError, ConnectionRefusedError):
                if not _pid_alive(os.path.join(job_dir, _PID_NAME)):
                    raise E.SaverError(f"the saver died while starting; see {log_path}:\n{_tail(log_path)}") from None
                if time.monotonic() >= deadline:
                    raise E.SaverError(f"the saver did not come up within {knobs.spawn_timeout_s:.0f} s; "
                                       f"see {log_path}:\n{_tail(log_path)}") from None
                time.sleep(0.02)
    finally:
        spawn_lock.release()


def lock_job(job_dir: str) -> SharedLock:
    """Takes the job's spawn lock, which serializes starting a saver with a saver's clean-up.

    Retries when the lock file was unlinked (by an exiting saver) while we waited on it."""
    path = os.path.join(job_dir, _SPAWN_LOCK)
    while True:
        make_private_dir(job_dir)
        lock = SharedLock(path)
        lock.acquire()
        try:
            same = os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return lock
        lock.release()


def _pid_alive(pid_file: str) -> bool:
    try:
        with open(pid_file) as f:
            pid = int(f.read().strip() or 0)
    except (FileNotFoundError, ValueError):
        return True  # not written yet: assume starting
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashckpt_core.saver", description="flashckpt node saver")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--daemonize", action="store_true", help="fork into the background and return at once")
    args = p.parse_args(argv)
    if args.daemonize:
        child = os.fork()
        if child > 0:
            # The spawner reaps this parent; the daemon is re-parented and never a zombie of it. Its pid
            # lets the spawner fail fast if it dies while starting.
            fd = os.open(os.path.join(args.job_dir, _PID_NAME), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, str(child).encode())
            os.close(fd)
            os._exit(0)
    logging.basicConfig(level=os.environ.get("FLASHCKPT_SAVER_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    saver = CheckpointSaver(args.job_dir, args.checkpoint_dir)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: saver.request_stop(last_words=True))
    saver.start()
    saver.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
