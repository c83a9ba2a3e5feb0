"""The saver of one job on one node: ``CheckpointSaver`` owns its parts and runs its life (start, serve, stop,
clean up).

Its parts, each an object with its own state, receive the one shared ``SaverState`` (``saver.state``) and
the parts they call, in their constructors (built in this order, each calling only those built before it):

- ``SegmentPool`` (``saver.segments``): the shared-memory segments, own and backups; allocation, spare slots.
- ``PersistQueues`` (``saver.persist``): a persist thread per local rank and the persist worker process.
- ``Records`` (``saver.housekeeping``): the start-up work on the commit records, and waiting for it.
- ``ReplicaService`` (``saver.replica``): the peer service of a multi-node job (backups, fetches).
- ``Recovery`` (``saver.recovery``): who persists what after a node loss.
- ``Uploader`` (``saver.uploader``): with a local tier, uploading its committed steps to the durable tier.
- ``Committer`` (``saver.committer``): the commit thread (commits on each tier, deletions).
- ``LastWords`` (``saver.lastwords``): persisting the newest snapshot at an end.
- ``ControlServer`` (``saver.control``): the trainers' socket, their sessions, the dispatch table.

Imports the layers below the saver and its parts. Its methods are called by the daemon's main thread
(``start``, ``serve_forever``, ``shutdown``) and a signal handler (``request_stop``)."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import time

from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.tiers import local_layout
from flashckpt.config import Knobs, dir_identity, is_default_runtime_dir, open_private_dir
from flashckpt.saver.committer import Committer
from flashckpt.saver.control import ControlServer
from flashckpt.saver.housekeeping import Records
from flashckpt.saver.lastwords import LastWords
from flashckpt.saver.persist import PersistQueues
from flashckpt.saver.recovery import Recovery
from flashckpt.saver.replica import ReplicaService
from flashckpt.saver.segments import SegmentPool
from flashckpt.saver.state import SaverState, log
from flashckpt.saver.uploader import Uploader
from flashckpt.storage.base import CheckpointStorage
from flashckpt.storage.registry import storage_for
from flashckpt.transport.ipc import SharedLock
from flashckpt.transport.spawn import SOCKET_NAME, SPAWN_LOCK, lock_job

__all__ = ["CheckpointSaver"]


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


class CheckpointSaver:
    """The saver of one job on one node.

    Args:
        job_dir: the job's runtime dir (segments, socket, locks); created 0700.
        checkpoint_dir: the checkpoint dir it persists into.
        storage: the storage backend (POSIX by default).
        knobs: environment knobs (read from the environment when None).
        local_dir: the job's node-local tier ("": none): persists the engine asks for are committed there
            first and uploaded to ``checkpoint_dir`` in the background (``saver.uploader``).
        local_keep: the locally committed steps kept (0: all).
    """

    def __init__(self, job_dir: str, checkpoint_dir: str, *, storage: CheckpointStorage | None = None,
                 knobs: Knobs | None = None, local_dir: str = "", local_keep: int = 2) -> None:
        knobs = knobs or Knobs.from_env()
        storage = storage or storage_for(checkpoint_dir)
        # The runtime dir is named by the job key (config.job_key): markers and manifests carry it.
        job = os.path.basename(os.path.normpath(job_dir))
        layout = CommitLayout(checkpoint_dir, storage, job=job)
        self.state = st = SaverState(job_dir, knobs, storage, layout, local=local_layout(local_dir, job) if local_dir
                                     else None, local_keep=local_keep)
        self.job_dir, self.knobs, self.storage, self.layout, self.stats = job_dir, knobs, storage, layout, st.stats
        self.pool = SegmentPool(st)
        self.persist = PersistQueues(st, self.pool)
        self.records = Records(st)
        self.replica = ReplicaService(st, self.pool, self.persist)
        self.recovery = Recovery(st, self.replica, self.persist)
        self.uploader = Uploader(st, self.records)
        self.committer = Committer(st, self.recovery, self.uploader)
        self.last_words = LastWords(st, self.pool, self.persist, self.records, self.recovery)
        self.control = ControlServer(st, pool=self.pool, persist=self.persist, committer=self.committer,
                                     last_words=self.last_words, records=self.records, replica=self.replica)
        self.committer.after_commit = self.control.after_commit
        self._dir_fd: int | None = None  # the job dir, checked: everything in it is reached through this fd
        self._sock_ino = 0  # the inode of the socket this saver bound (0: not bound)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Creates the runtime dir, adopts segments left by an earlier saver, binds the socket; the work on
        the commit records, which needs the store, runs on a thread of its own (``saver/housekeeping``)."""
        self._dir_fd = open_private_dir(self.job_dir)
        self.pool.adopt(self._dir_fd)
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
        self.control.sock = sock
        self._sock_ino = os.stat(SOCKET_NAME, dir_fd=self._dir_fd, follow_symlinks=False).st_ino
        st = self.state
        st.spawn(self.records.loop, "records")
        st.spawn(self.control.accept_loop, "accept")
        st.spawn(self.committer.loop, "commit")
        if st.local is not None:
            st.spawn(self.uploader.loop, "upload")
        st.spawn(self.pool.spare_keeper, "spare")
        log.info("saver %d serving %s for %s", os.getpid(), self.job_dir, self.layout.root)

    def serve_forever(self) -> None:
        """Runs until there is no client and no work: at once after final goodbyes, else after grace.

        Every end of a trainer keeps its newest snapshot: when every client said a final goodbye (``close()``,
        the end of a ``with`` block, an exit without ``close()``), the saver persists what is newer than the
        last commit (last words), then exits; a client that leaves otherwise (a crash, ``close(release=
        False)``) has it persisted at once and the snapshots kept for the grace period (``ControlServer``)."""
        st, control = self.state, self.control
        with st.cv:
            while not st.stop.is_set():
                gone = self._runtime_gone()
                if gone:
                    log.warning("%s: the snapshots in it are lost and no trainer can reach this saver; exiting (the "
                                "trainers start a new saver at their next call)", gone)
                    break
                if not st.clients and st.inflight == 0 and self._idle_exit():
                    break
                st.cv.wait(timeout=0.5)
            # Decided to exit: say so under the lock hello registers under, so a trainer attaching at
            # this instant is refused (and retries on the next saver) instead of joining a dying one.
            st.stop.set()
        if st.signalled and self.knobs.last_words:
            try:
                self.last_words.save_shm_to_storage(timeout=self.knobs.term_timeout_s)
            except Exception:
                log.exception("last-words persist before exiting failed")
        if control.agent is not None:
            control.agent.close()
        self.shutdown()

    def _idle_exit(self) -> bool:
        """Whether a saver with no client and no work exits now (sets ``signalled`` for last words first).
        Holds ``cv``."""
        st, control = self.state, self.control
        if control.ever_clients and control.session_final:
            st.signalled = True  # last words, then exit
            return True
        if control.agent is not None and control.agent.gone():
            log.info("the job's launcher (pid %d) exited: no restart can come; exiting", control.agent.pid)
            st.signalled = True
            return True
        if control.ever_clients and not self.pool.holds_snapshot():
            log.info("no client and no snapshot a restart could use: exiting")
            return True
        # The grace period applies after a crash (or a goodbye keeping the snapshots), while a snapshot is
        # held. A saver nobody attached to yet waits at least as long as its spawner does, so a short grace
        # cannot make it exit under the first trainer's hello. While the job's launcher lives, a restart of
        # its workers can still come (it restarts them or exits, and its exit ends this wait above): a slow
        # restart on a loaded machine never outlasts the snapshots it comes back for.
        grace = self.knobs.grace_s if control.ever_clients else max(self.knobs.grace_s, self.knobs.spawn_timeout_s)
        if time.monotonic() - st.idle_since >= grace and control.agent is None:
            log.info("no client for %.0f s: exiting", grace)
            return True
        return False

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

    def save_shm_to_storage(self, timeout: float | None = None) -> int | None:
        """Persists and commits the newest snapshot every persisting local rank holds, when newer than the
        last commit (``LastWords.save_shm_to_storage``); returns its step, or None."""
        return self.last_words.save_shm_to_storage(timeout)

    def request_stop(self, *, last_words: bool = False) -> None:
        """Asks ``serve_forever`` to return (signal-safe: only sets flags). With ``last_words`` the
        newest snapshot is persisted and committed first (SIGTERM)."""
        self.state.signalled = self.state.signalled or last_words
        self.state.stop.set()

    def shutdown(self, drain_timeout: float = 60.0) -> None:
        """Finishes running persists (bounded), stops serving, removes the job's segments, locks, socket."""
        st = self.state
        st.stop.set()
        self.pool.want_spares()  # the spare keeper sees the stop now
        with st.cv:
            deadline = time.monotonic() + drain_timeout
            while st.inflight > 0 and time.monotonic() < deadline:
                st.cv.wait(timeout=0.2)
            if st.inflight:
                log.error("exiting with %d persist(s) unfinished after %.0f s", st.inflight, drain_timeout)
        self.replica.stop()
        self.persist.close_workers()
        self.storage.close()
        gone = self._runtime_gone()
        spawn_lock: SharedLock | None = None
        if not gone:
            try:
                spawn_lock = lock_job(self.job_dir)
            except E.SaverError as e:  # the path no longer leads to a dir of ours: clean only through our fd
                log.error("%s; removing only this saver's own files, through the job dir it checked at start", e)
        try:
            self.control.close_socket()
            self.persist.stop()
            self.uploader.stop()
            st.commit_q.put(None)
            self.pool.close()
            self._remove_runtime(bool(gone), spawn_lock is not None)
        except OSError as e:
            log.warning("cleaning up %s: %s", self.job_dir, e)
        finally:
            # The job lock goes first: a saver this spawn lock lets start next must not find it held.
            self.records.release_hold()  # (the records thread takes it under cv, letting it go once stopped)
            if spawn_lock is not None:
                spawn_lock.release()
        log.info("saver %d exited; runtime dir %s removed", os.getpid(), self.job_dir)

    def _remove_runtime(self, gone: bool, locked: bool) -> None:
        """Removes the runtime dir's contents (all of them when ``locked``: the spawn lock is held, the dir
        with them) through the fd checked at start; ``gone``: its path no longer leads to this saver's dir."""
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
        if locked:
            os.rmdir(self.job_dir)  # rmdir never follows a symbolic link, and removes only an empty dir
        if locked and is_default_runtime_dir(os.path.dirname(self.job_dir)):
            try:
                os.rmdir(os.path.dirname(self.job_dir))  # our per-user root, when no other job uses it
            except OSError:
                pass
