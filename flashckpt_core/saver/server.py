"""The saver of one job on one node: its life (start, serve, stop, clean up) and the control server, which
answers each request through a dispatch table."""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, ClassVar

from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.records_home import Held
from flashckpt.config import Knobs, dir_identity, is_default_runtime_dir, open_private_dir
from flashckpt.format.segment import (
    FLAGS_BUSY,
    Segment,
    lock_path,
)
from flashckpt.saver._base import (  # noqa: F401
    CommitWork,
    SaverBase,
    _ClientInfo,
    _DeleteJob,
    _DeletePathJob,
    _remove_in,
    _Stats,
    _StepState,
    _Watch,
    log,
)
from flashckpt.saver.committer import CommitPart
from flashckpt.saver.housekeeping import HousekeepingPart
from flashckpt.saver.lastwords import LastWordsPart
from flashckpt.saver.persist import PersistPart
from flashckpt.saver.replica import ReplicaPart
from flashckpt.saver.segments import SegmentsPart
from flashckpt.saver.worker import PersistWorker
from flashckpt.storage.base import CheckpointStorage
from flashckpt.storage.registry import storage_for
from flashckpt.transport import messages as M
from flashckpt.transport.ipc import SharedLock
from flashckpt.transport.messages import parse_request
from flashckpt.transport.spawn import SOCKET_NAME, SPAWN_LOCK, lock_job
from flashckpt.transport.wire import peer_uid, recv_msg, send_msg

__all__ = ["CheckpointSaver"]


class CheckpointSaver(ReplicaPart, SegmentsPart, PersistPart, LastWordsPart, CommitPart, HousekeepingPart, SaverBase):
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
        self.storage = storage or storage_for(checkpoint_dir)
        # The runtime dir is named by the job key (config.job_key): markers and manifests carry it.
        self.layout = CommitLayout(checkpoint_dir, self.storage, job=os.path.basename(os.path.normpath(job_dir)))
        self._job_lock: Held | None = None
        self._alloc_locks: dict[int, threading.Lock] = collections.defaultdict(threading.Lock)
        self._cv = threading.Condition()
        self._clients: dict[int, _ClientInfo] = {}
        self._ever_clients = 0
        self._steps: dict[int, _StepState] = {}
        self._errors: list[dict[str, Any]] = []
        self._committed: list[int] = []
        self._records_ready = False  # the start-up work on the commit records is done (saver/housekeeping)
        self._records_error: str | None = None  # why its last attempt failed
        self._records_failures = 0
        self._records_since = time.monotonic()
        self._start_committed: list[int] = []  # the committed steps once the records were ready
        self._inflight = 0
        self._persist_q: dict[int, queue.Queue[M.Persist | None]] = {}
        self._commit_q: queue.Queue[CommitWork | None] = queue.Queue()
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
        self._agent: _Watch | None = None  # the launcher of the job, when it has one
        self._sock: socket.socket | None = None
        self._persist_seen = -float("inf")  # monotonic time of the last persist activity (spare slot hold)
        self._spares_wanted = threading.Event()  # a persist was queued: the spare keeper reserves spares
        self._dir_fd: int | None = None  # the job dir, checked: everything in it is reached through this fd
        self._sock_ino = 0  # the inode of the socket this saver bound (0: not bound)
        self._rep = None  # the peer service of a multi-node job (saver/replica), from the first hello
        self.stats = _Stats()
        # Writes the files (torch's work) in a process of its own, started on demand: see _persist_worker.
        self._worker = PersistWorker(self.layout.root, self.layout.job, self.storage, nice=self.knobs.persist_nice,
                                     idle_s=self.knobs.persist_worker_idle_s)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Creates the runtime dir, adopts segments left by an earlier saver, binds the socket; the work on
        the commit records, which needs the store, runs on a thread of its own (``saver/housekeeping``)."""
        self._dir_fd = open_private_dir(self.job_dir)
        self._adopt_segments()
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
        self._sock_ino = os.stat(SOCKET_NAME, dir_fd=self._dir_fd, follow_symlinks=False).st_ino
        self._records_since = time.monotonic()
        self._spawn(self._housekeeping_loop, "records")
        self._spawn(self._accept_loop, "accept")
        self._spawn(self._commit_loop, "commit")
        self._spawn(self._spare_keeper, "spare")
        log.info("saver %d serving %s for %s", os.getpid(), self.job_dir, self.layout.root)

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
                    seg.set_flags(i, seg.header(i).flags & ~FLAGS_BUSY)
            self._segments[path] = seg
            log.info("adopted segment %s (steps %s)", path, [s for s, _ in seg.complete_steps()])

    def serve_forever(self) -> None:
        """Runs until there is no client and no work: at once after final goodbyes, else after grace.

        Every end of a trainer keeps its newest snapshot: when every client said a final goodbye (``close()``,
        the end of a ``with`` block, an exit without ``close()``), the saver persists what is newer than the
        last commit (last words), then exits; a client that leaves otherwise (a crash, ``close(release=
        False)``) has it persisted at once and the snapshots kept for the grace period (``_serve_conn``)."""
        with self._cv:
            while not self._stop.is_set():
                gone = self._runtime_gone()
                if gone:
                    log.warning("%s: the snapshots in it are lost and no trainer can reach this saver; exiting (the "
                                "trainers start a new saver at their next call)", gone)
                    break
                if not self._clients and self._inflight == 0:
                    if self._ever_clients and self._session_final:
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
                    # While the job's launcher lives, a restart of its workers can still come (it restarts
                    # them or exits, and its exit ends this wait above): a slow restart on a loaded machine
                    # never outlasts the snapshots it comes back for.
                    grace = self.knobs.grace_s if self._ever_clients else max(self.knobs.grace_s,
                                                                              self.knobs.spawn_timeout_s)
                    if time.monotonic() - self._idle_since >= grace and self._agent is None:
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

    def _runtime_gone(self) -> str:
        """Why this saver's runtime dir is no longer its own ("" while it is): removed or replaced at its
        path (``dir_identity``: systemd-logind's RemoveIPC, a tmp cleaner), or its socket removed or
        replaced (no trainer can connect; a new saver may serve the dir)."""
        if self._dir_fd is None or not self._sock_ino:
            return ""
        st = os.fstat(self._dir_fd)
        if dir_identity(self.job_dir) != (st.st_dev, st.st_ino):
            return f"the runtime dir {self.job_dir} was removed or replaced"
        try:
            ino = os.stat(SOCKET_NAME, dir_fd=self._dir_fd, follow_symlinks=False).st_ino
        except FileNotFoundError:
            ino = 0
        except OSError:
            return ""  # cannot tell
        return "" if ino == self._sock_ino else f"the socket {os.path.join(self.job_dir, SOCKET_NAME)} was removed"

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
        self._spares_wanted.set()  # the spare keeper sees the stop now
        with self._cv:
            deadline = time.monotonic() + drain_timeout
            while self._inflight > 0 and time.monotonic() < deadline:
                self._cv.wait(timeout=0.2)
            if self._inflight:
                log.error("exiting with %d persist(s) unfinished after %.0f s", self._inflight, drain_timeout)
        self._stop_replica()
        self._worker.close()
        self.storage.close()
        gone = self._runtime_gone()
        spawn_lock: SharedLock | None = None
        if not gone:
            try:
                spawn_lock = lock_job(self.job_dir)
            except E.SaverError as e:  # the path no longer leads to a dir of ours: clean only through our fd
                log.error("%s; removing only this saver's own files, through the job dir it checked at start", e)
        try:
            if self._sock is not None:
                try:  # wakes the accept loop (a close alone leaves a blocked accept() waiting)
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
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
                # A dir still at its path whose socket is gone may serve a new saver already: nothing in it
                # is removed by name. A dir removed or moved away is this saver's alone.
                at_path = gone and dir_identity(self.job_dir) == (os.fstat(dir_fd).st_dev, os.fstat(dir_fd).st_ino)
                for name in [] if at_path else os.listdir(dir_fd):
                    if name != SPAWN_LOCK:
                        _remove_in(dir_fd, name)
                if not at_path:
                    with contextlib.suppress(FileNotFoundError):  # a removed dir has none
                        os.unlink(SPAWN_LOCK, dir_fd=dir_fd)
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
            with self._cv:  # (the records thread takes it under this lock, letting it go once stopped)
                held, self._job_lock = self._job_lock, None
            if held is not None:
                held.release()
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
                # Every reply echoes its request's id: a client that gave up on a request (a timeout)
                # recognizes the late reply and discards it instead of taking it for a later one's.
                echo = {"id": msg["id"]} if "id" in msg else {}
                try:
                    req = parse_request(msg)
                except E.ProtocolError as e:  # reply, rather than drop the connection
                    send_msg(conn, {"ok": False, "error": str(e), "kind": "ProtocolError", **echo})
                    continue
                if isinstance(req, M.Hello):
                    info = _ClientInfo(req.rank, req.local_rank, req.pid, persists=req.persists, commit=req.commit,
                                       world_size=req.world_size, replicated=req.replicated)
                    if not self._attach(cid, info, req.agent_pid):
                        send_msg(conn, {"ok": False, "kind": "SaverError",
                                        "error": "the saver is shutting down; start or reach the next one", **echo})
                        return
                try:
                    if type(req) in self.NEEDS_RECORDS:
                        self._await_records(req.OP, self.knobs.records_timeout_s)
                    reply: dict[str, Any] = {"ok": True, **self._DISPATCH[type(req)](self, req, info).to_wire()}
                except E.FlashCheckpointError as e:
                    reply = {"ok": False, "error": str(e), "kind": type(e).__name__}
                except (KeyError, TypeError, ValueError) as e:
                    reply = {"ok": False, "error": f"bad {req.OP!r} request: {e!r}", "kind": "ProtocolError"}
                except OSError as e:
                    reply = {"ok": False, "error": f"{req.OP}: {e}", "kind": "PersistError"}
                send_msg(conn, {**reply, **echo})
                if isinstance(req, M.Bye):
                    return
        except (ConnectionError, OSError):
            pass
        finally:
            conn.close()
            with self._cv:
                gone = self._clients.pop(cid, None)
                if gone is not None and not gone.final:
                    self._session_final = False
                    if gone.said_bye:  # close(release=False): a restart is to load the snapshots
                        log.info("client rank %d (pid %d) left keeping its snapshots for a restart", gone.rank,
                                 gone.pid)
                    else:
                        log.warning("client rank %d (pid %d) disconnected without goodbye", gone.rank, gone.pid)
                    if self.knobs.last_words and not self._stop.is_set():
                        self._inflight += 1  # keeps the saver alive until the last words are written
                        self._spawn(self._last_words_thread, "last-words")
                if not self._clients:
                    self._idle_since = time.monotonic()
                self._cv.notify_all()

    def _attach(self, cid: int, info: _ClientInfo, agent: int) -> bool:
        """Registers a client that said hello; False when the saver is exiting (its runtime dir is about to
        be removed)."""
        with self._cv:
            if self._stop.is_set():
                return False
            if not self._clients:
                self._session_final = True  # a new session of clients begins
            if agent > 0 and (self._agent is None or self._agent.pid != agent):
                if self._agent is not None:
                    self._agent.close()
                self._agent = _Watch(agent)
            self._clients[cid] = info
            self._ever_clients += 1
            if info.persists:  # who persists what, for last words after a crash
                self._persisters[info.local_rank] = info
        return True

    # ------------------------------------------------------------------ requests (the dispatch table below)
    def _on_hello(self, req: M.Hello, info: _ClientInfo | None) -> M.Reply:
        self._replica_hello(req)
        return M.HelloReply(pid=os.getpid(), **self._status(0))

    def _on_await_records(self, req: M.AwaitRecords, info: _ClientInfo | None) -> M.Reply:
        self._await_records("the engine's first use of the commit records", req.timeout_s)
        with self._cv:
            return M.RecordsReply(committed=list(self._start_committed))

    def _on_inventory(self, req: M.Inventory, info: _ClientInfo | None) -> M.Reply:
        return self._inventory()

    def _on_fetch(self, req: M.Fetch, info: _ClientInfo | None) -> M.Reply:
        return self._fetch(req)

    def _on_alloc(self, req: M.Alloc, info: _ClientInfo | None) -> M.Reply:
        nslots = req.nslots if req.nslots is not None else self.knobs.slots
        return M.AllocReply(path=self._alloc(req.local_rank, req.meta_cap, req.data_cap, nslots))

    def _on_persist(self, req: M.Persist, info: _ClientInfo | None) -> M.Reply:
        self._enqueue(req)
        self._reap_quietly(req.local_rank)
        return M.StatusReply(**self._status(req.cursor))

    def _on_status(self, req: M.Status, info: _ClientInfo | None) -> M.Reply:
        if req.local_rank is not None:
            self._reap_quietly(req.local_rank)
        return M.StatusReply(**self._status(req.cursor))

    def _on_wait(self, req: M.Wait, info: _ClientInfo | None) -> M.Reply:
        return M.StatusReply(**self._wait(req.timeout_s, req.cursor))

    def _on_last_words(self, req: M.LastWords, info: _ClientInfo | None) -> M.Reply:
        step = self.save_shm_to_storage(timeout=req.timeout_s if req.timeout_s is not None else
                                        self.knobs.commit_timeout_s)
        return M.LastWordsReply(step=step, **self._status(req.cursor))

    def _on_delete_steps(self, req: M.DeleteSteps, info: _ClientInfo | None) -> M.Reply:
        if req.background:
            # Unlinking a GB-sized file takes a fraction of a second: never inside a trainer's save().
            with self._cv:
                self._inflight += 1
            self._commit_q.put(_DeleteJob(tuple(req.steps)))
            return M.DeleteStepsReply(scheduled=list(req.steps))
        # A step whose manifest is on storage but whose commit is still finishing here (a reader of the
        # manifests, such as an adapter, may ask at that moment) is deleted once its commit is done.
        deadline = time.monotonic() + self.knobs.commit_timeout_s
        with self._cv:
            while any(s not in self._committed and not self._step_done(s) for s in req.steps):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(timeout=min(left, 0.2))
            self._inflight += 1
        # On the commit thread, like every change to the commit records: a commit running now (another
        # step's) and this deletion never write the tracker at the same time, and the tracker ends up
        # naming the newest step that is left.
        done: Future[list[int]] = Future()
        self._commit_q.put(_DeleteJob(tuple(req.steps), newest=req.newest, done=done))
        try:
            deleted = done.result(timeout=max(1.0, deadline - time.monotonic()) + self.knobs.commit_timeout_s)
        except FutureTimeout:
            raise E.CheckpointTimeoutError(f"delete_steps({list(req.steps)}): the commits queued before it did not "
                                           f"finish within {self.knobs.commit_timeout_s:.0f} s") from None
        return M.DeleteStepsReply(deleted=deleted)

    def _on_delete_path(self, req: M.DeletePath, info: _ClientInfo | None) -> M.Reply:
        path = self.storage.normpath(req.path)
        steps = self._path_deletion(path)  # refusals raise CheckpointDirError, before anything is deleted
        if not (self.storage.exists(path) or self.storage.isdir(path)):
            return M.DeletePathReply(missing=True)
        with self._cv:
            self._inflight += 1
        self._commit_q.put(_DeletePathJob(path))
        return M.DeletePathReply(scheduled=steps)

    def _on_give_way(self, req: M.GiveWay, info: _ClientInfo | None) -> M.Reply:
        # Another job of this user is short of shared memory: an idle saver (clients came and went, none is
        # attached, no work) persists what is newer than its last commit and exits.
        with self._cv:
            idle = bool(self._ever_clients) and not self._clients and self._inflight == 0 and not self._stop.is_set()
            if req.dry_run:
                return M.GiveWayReply(idle=idle, idle_s=time.monotonic() - self._idle_since)
            if idle:
                self._signalled = True  # last words, then exit
                self._stop.set()
                self._cv.notify_all()
        return M.GiveWayReply(giving_way=idle)

    def _on_bye(self, req: M.Bye, info: _ClientInfo | None) -> M.Reply:
        """A goodbye: ``final`` (released: the last words come before the saver exits) or not (kept for a
        restart: persisted at once). Every intent keeps the newest snapshot (``serve_forever``)."""
        if info is not None:
            info.final = req.final
            info.said_bye = True
        return M.Ok()

    def _on_q_put(self, req: M.QueuePut, info: _ClientInfo | None) -> M.Reply:
        with self._cv:
            self._queues[req.name].append(req.item)
            self._cv.notify_all()
        return M.Ok()

    def _on_q_get(self, req: M.QueueGet, info: _ClientInfo | None) -> M.Reply:
        deadline = time.monotonic() + req.timeout_s
        with self._cv:
            while not self._queues[req.name]:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return M.QueueGetReply(found=False)
                self._cv.wait(timeout=left)
            return M.QueueGetReply(found=True, item=self._queues[req.name].popleft())

    def _on_q_size(self, req: M.QueueSize, info: _ClientInfo | None) -> M.Reply:
        with self._cv:
            return M.QueueSizeReply(size=len(self._queues[req.name]))

    def _on_d_update(self, req: M.DictUpdate, info: _ClientInfo | None) -> M.Reply:
        with self._cv:
            self._dicts[req.name].update(req.items)
        return M.Ok()

    def _on_d_get(self, req: M.DictGet, info: _ClientInfo | None) -> M.Reply:
        with self._cv:
            return M.DictGetReply(items=dict(self._dicts[req.name]))

    # One handler per request type (messages.REQUESTS lists them all; test_messages checks none is missing).
    _DISPATCH: ClassVar[dict[type[M.Request[Any]], Callable[..., M.Reply]]] = {
        M.Hello: _on_hello, M.Alloc: _on_alloc, M.Persist: _on_persist, M.Status: _on_status, M.Wait: _on_wait,
        M.LastWords: _on_last_words, M.DeleteSteps: _on_delete_steps, M.DeletePath: _on_delete_path,
        M.GiveWay: _on_give_way, M.Bye: _on_bye, M.QueuePut: _on_q_put, M.QueueGet: _on_q_get,
        M.QueueSize: _on_q_size, M.DictUpdate: _on_d_update, M.DictGet: _on_d_get, M.Inventory: _on_inventory,
        M.Fetch: _on_fetch, M.AwaitRecords: _on_await_records,
    }

