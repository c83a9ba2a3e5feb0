"""Where a checkpoint dir's commit records live, and how a job holds them: one ``RecordsHome`` per backend.

``CommitLayout`` writes the commit protocol (markers, manifests, the tracker) into ``home.meta`` through
the storage backend; what depends on the kind of store is here:

- ``PosixRecords`` (file systems): beside the checkpoint dir where possible (``_records`` decides and keeps
  them bound to the dir's inode), job locks are ``flock``s on files in ``meta/jobs``;
- ``InsideRecords`` (object stores and any backend without a local file system): in ``<dir>/.flashckpt``,
  so deleting the prefix deletes them too; a job holds them with a lease object that its saver keeps
  alive (``ObjectLease``: rewritten every third of its time to live), since a store has no locks.

``home_for(storage, root)`` picks one by the backend's capability ``posix_files``. Call order: a saver
starting on a checkpoint dir calls ``claim(job)`` (records readied, stale ones removed, this job's lease
taken and held for the saver's life); anyone calls ``job_alive``/``live_jobs`` (start-up clean-up leaves
live jobs' steps alone) and ``stale_reason``; ``flashckpt gc`` calls ``tidy``.
Torch-free: the saver daemon uses it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import threading
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

from flashckpt import errors as E
from flashckpt.commit import records_store as _records
from flashckpt.commit import records_upkeep as upkeep
from flashckpt.commit.records_read import unreadable
from flashckpt.config import knob
from flashckpt.format.names import META
from flashckpt.storage import locations
from flashckpt.util.lease import Lease, held

if TYPE_CHECKING:
    from flashckpt.commit.manifest import Manifest
    from flashckpt.storage.base import CheckpointStorage, FileRecord

__all__ = ["home_for", "Steps", "RecordsHome", "PosixRecords", "InsideRecords", "ObjectLease", "Held"]

log = logging.getLogger(__name__)


def home_for(storage: CheckpointStorage, root: str) -> RecordsHome:
    """Where the commit records of checkpoint dir ``root`` on ``storage`` live and how jobs hold them: beside
    the dir with ``flock`` job locks on a file system (the backend's ``posix_files``: ``PosixRecords``),
    else inside it with lease objects (``InsideRecords``)."""
    return PosixRecords(storage, root) if storage.posix_files else InsideRecords(storage, root)


class Steps(Protocol):
    """What a home reads of the steps its records describe (``CommitLayout`` is one)."""

    def committed_manifests(self) -> dict[int, Manifest]: ...

    def step_dir(self, step: int) -> str: ...


class Held(Protocol):
    """What ``claim`` returns: a job's hold on the records, released when its saver exits."""

    def release(self) -> None: ...


class RecordsHome(ABC):
    """The records of checkpoint dir ``root`` on ``storage``: where they are (``meta``) and who holds them."""

    def __init__(self, storage: CheckpointStorage, root: str) -> None:
        self.storage = storage
        self.root = root

    @property
    @abstractmethod
    def meta(self) -> str:
        """The records dir (may change at ``claim``: read it after)."""

    @property
    def beside(self) -> bool:
        """Whether the records live beside the checkpoint dir (else inside it, in ``.flashckpt``)."""
        return self.meta != locations.join(self.root, META)

    def jobs_dir(self) -> str:
        return locations.join(self.meta, "jobs")

    @abstractmethod
    def claim(self, job: str, layout: Steps) -> Held | None:
        """Readies the records for a saver of ``job`` starting on the checkpoint dir and takes the job's
        hold on them (with what else the backend keeps for the saver's life); None when it could not be
        taken (logged: other jobs may clean up this job's steps).

        Raises:
            CheckpointDirError: the records cannot be used (the message says why)."""

    @abstractmethod
    def job_alive(self, job: str) -> bool:
        """Whether a saver of ``job`` holds the records now; "" (unknown) is never alive."""

    def live_jobs(self, *, exclude: str = "") -> list[str]:
        """Jobs (other than ``exclude``) whose savers hold the records now."""
        names = self.storage.listdir(self.jobs_dir())
        jobs = {n.rsplit(".", 1)[0] for n in names if n.endswith((".lock", ".lease"))}
        return sorted(j for j in jobs if j != exclude and self.job_alive(j))

    def stale_reason(self, layout: Steps) -> str | None:
        """Why the records describe files that are gone (every committed step's files are missing), or
        None. Reads only."""
        manifests = layout.committed_manifests()
        paths = [locations.join(self.root, f.path) for m in manifests.values() for f in m.all_files()]
        if paths and not any(self._exists(p) for p in paths):
            return f"no file of their committed steps {sorted(manifests)} exists in {self.root}"
        return None

    def _exists(self, path: str) -> bool:
        """``storage.exists``; an error that leaves it unknown is raised (``unreadable``): files taken for
        gone would make the records look stale, and a saver would set them aside."""
        try:
            return self.storage.exists(path)
        except OSError as e:
            raise unreadable("look up", path, e) from e

    def before_commit(self, layout: Steps, step: int, files: list[FileRecord]) -> None:
        """Called by a commit of ``step`` with its files (all ranks', staged ones in place) just before its
        manifest is written; may raise ``PersistError`` (the step is not committed). Nothing by default."""
        return None

    def tidy(self, layout: Steps, *, dry_run: bool = False) -> list[str]:
        """``flashckpt gc``: removes stale records that no live job holds, and what the backend's
        interrupted writes left (``CheckpointStorage.tidy``); returns what was removed (or would be)."""
        done = []
        if self.storage.isdir(self.meta):
            why = self.stale_reason(layout)
            if why and not self.live_jobs():
                if not dry_run:
                    self.storage.remove_tree(self.meta)
                done.append(f"{self.meta}: stale, {why}")
        return done + self.storage.tidy(self.root, dry_run=dry_run)


# ------------------------------------------------------------------------------------------ object stores
class ObjectLease:
    """A job's hold on records in a store without locks: an object naming its holder and when the hold
    expires, rewritten by a daemon thread every third of ``ttl_s`` until ``release`` removes it. A holder
    that dies stops rewriting it: the hold lapses ``ttl_s`` later."""

    def __init__(self, storage: CheckpointStorage, path: str, *, ttl_s: float) -> None:
        self.storage, self.path, self.ttl_s = storage, path, ttl_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        body = {"host": socket.gethostname(), "pid": os.getpid(), "expires": time.time() + self.ttl_s,
                "ttl_s": self.ttl_s}
        self.storage.write_bytes(self.path, json.dumps(body).encode())

    def acquire(self) -> ObjectLease:
        self._write()
        self._thread = threading.Thread(target=self._keep, name="flashckpt-lease", daemon=True)
        self._thread.start()
        return self

    def _keep(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._write()
            except Exception as e:  # retried at the next beat; a lapse only lets others clean up
                log.warning("could not renew the job lease %s: %s", self.path, e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        try:
            self.storage.remove(self.path)
        except OSError as e:
            log.warning("could not remove the job lease %s: %s (it lapses by itself)", self.path, e)

    @staticmethod
    def alive(storage: CheckpointStorage, path: str) -> bool:
        """Whether the lease at ``path`` exists and has not expired (a damaged one counts as alive for one
        time to live after it was written, as far as the store tells: it is kept, not trusted)."""
        try:
            d = json.loads(storage.read_bytes(path))
            return isinstance(d, dict) and float(d.get("expires", 0)) > time.time()
        except FileNotFoundError:
            return False
        except (OSError, ValueError, TypeError):
            return True


class InsideRecords(RecordsHome):
    """Records in ``<root>/.flashckpt`` with ``ObjectLease`` holds (the default of every backend without a
    local file system). FLASHCKPT_LEASE_TTL_S sets the lease's time to live (default 60 s)."""

    @property
    def meta(self) -> str:
        return locations.join(self.root, META)

    def _lease_path(self, job: str) -> str:
        return locations.join(self.jobs_dir(), f"{job}.lease")

    def claim(self, job: str, layout: Steps) -> Held | None:
        ttl = float(knob("lease_ttl_s"))
        try:
            return ObjectLease(self.storage, self._lease_path(job), ttl_s=ttl).acquire()
        except OSError as e:
            raise E.CheckpointDirError(f"cannot write the commit records in {self.meta}: {e}") from e

    def job_alive(self, job: str) -> bool:
        if not job or "/" in job or job.startswith("."):
            return False
        return ObjectLease.alive(self.storage, self._lease_path(job))


# ------------------------------------------------------------------------------------------ file systems
class _Hold:
    """A saver's hold on beside records: its job lock, and an fd of the checkpoint dir, which keeps the
    dir's inode number from being reused while the saver lives (a dir deleted and made again always gets
    another one, so ``before_commit`` always tells)."""

    def __init__(self, lock: Lease | None, dir_fd: int | None) -> None:
        self.lock, self.dir_fd = lock, dir_fd

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None


class PosixRecords(RecordsHome):
    """Records beside the checkpoint dir where possible, bound to it (see ``_records``), with ``flock``
    job locks held shared by every live saver of a job."""

    def __init__(self, storage: CheckpointStorage, root: str) -> None:
        super().__init__(storage, root)
        self._meta = _records.records_dir(root)
        self._hold: _Hold | None = None

    @property
    def meta(self) -> str:
        return self._meta

    def job_lock_path(self, job: str) -> str:
        return os.path.join(self.meta, "jobs", f"{job}.lock")

    def job_alive(self, job: str) -> bool:
        """Whether a saver of ``job`` holds its lock in the records now.

        Raises:
            CheckpointDirError: the lock could not be probed (EMFILE, EACCES...): a live job taken for dead
                would have its half-written steps removed."""
        if not job or os.sep in job or job.startswith("."):
            return False
        path = self.job_lock_path(job)
        try:
            return held(path)
        except OSError as e:
            raise unreadable("probe the job lock", path, e) from e

    def claim(self, job: str, layout: Steps) -> Held | None:
        """Beside the checkpoint dir, under the parent's lock: records found under another name (the dir
        was renamed in its parent, or is reached through a symbolic link) are moved to its name; stale
        records (``stale_reason``) that no live job holds a lock in are set aside (retired when the dir's
        name now belongs to another directory, removed when their files are gone) and the run starts
        afresh; the records are bound to the checkpoint dir (``dir.json``); creating them moves the records
        of sibling dirs renamed since. The records dir is chosen again here, so ``meta`` may change.

        Raises:
            CheckpointDirError: ``<parent>/.flashckpt`` cannot be used (a symbolic link, another
                user's), or the checkpoint dir cannot be created.
        """
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise E.CheckpointDirError(f"cannot create the checkpoint dir {self.root}: {e}") from e
        self._meta = _records.records_dir(self.root)
        if self.beside:
            top, name = os.path.split(_records.home(self.root))
            with _records.locked_parent(top) as top_fd:
                if self._at_home(top_fd, top, name) and self._renew(top_fd, top, name, layout):
                    return self._take_hold(job)  # before the parent lock goes: the records are in use
        return self._take_hold(job)

    def _at_home(self, top_fd: int, top: str, name: str) -> bool:
        """Chooses the records dir again (under the parent lock) and moves records found under another
        name (``_records.moved``) to ``name``. False when they stay elsewhere (they could not be moved)."""
        self._meta = _records.records_dir(self.root)
        want = os.path.join(top, name)
        if self.beside and self.meta != want:
            src, why = self.meta, _records.place(self.root).why
            self._meta = upkeep.bring(top_fd, top, src, name)
            if self.meta == want:
                log.warning("the commit records of %s were in %s (%s); moved to %s", self.root, src, why, want)
        return not self.beside or self.meta == want

    def _renew(self, top_fd: int, top: str, name: str, layout: Steps) -> bool:
        """Sets stale records aside, binds (or creates) them; False when, the stale ones gone, the rule
        now keeps the records inside (``meta`` changed)."""
        st = _records._lstat(self.meta)
        if st is not None and stat.S_ISDIR(st.st_mode):
            bound, ino = _records.read_binding(self.meta), os.stat(self.root).st_ino
            why = self.stale_reason(layout)
            if why:
                live = upkeep.live_jobs_at(top_fd, name)
                if live:
                    log.warning("the commit records in %s look stale (%s), but jobs %s hold their locks there; "
                                "left alone", self.meta, why, live)
                else:
                    other = bound is not None and bound != ino  # the name now belongs to another directory
                    to = upkeep.settle(top_fd, os.path.dirname(top), name, keep=other)
                    log.warning("the commit records in %s were stale (%s): %s; starting afresh", self.meta, why,
                                f"moved to {os.path.join(top, to)}, the records of the directory they describe, "
                                "renamed since" if to else
                                "kept aside until `flashckpt gc`: if that directory was moved elsewhere, "
                                f"`flashckpt adopt <its new path> --from {self.root}` gives them back to it"
                                if other else "removed")
                    if not self._at_home(top_fd, top, name) or not self.beside:
                        return False
            elif bound is not None and bound != ino:
                log.warning("the commit records in %s were bound to another directory (%s, inode %d), but %s "
                            "(inode %d) holds the files of their committed steps %s: it is a copy or a move of "
                            "that directory with its records; they are bound to %s now", self.meta,
                            _records.bound_dir(self.meta) or "?", bound, self.root, ino, self._whole(layout),
                            self.root)
        if _records.bind(top_fd, name, self.root):
            for line in self._swept(top_fd):
                log.info("%s", line)
        return True

    def _whole(self, layout: Steps) -> list[int]:
        """The committed steps whose every file the checkpoint dir holds with its committed size."""
        return _records.whole_steps(layout.committed_manifests(), os.path.realpath(self.root))

    def _swept(self, top_fd: int, *, orphans: bool = False, dry_run: bool = False) -> list[str]:
        top = os.path.dirname(_records.home(self.root))
        parent = os.path.dirname(top)
        out = []
        for n, to in upkeep.sweep(top_fd, parent, orphans=orphans, dry_run=dry_run):
            was = _records.bound_dir(os.path.join(top, n)) or os.path.join(parent, n)
            if to:
                out.append(f"{os.path.join(top, n)}: the commit records of {was}, renamed to "
                           f"{os.path.join(parent, to)}; moved to {os.path.join(top, to)}")
            elif n.startswith(_records.LEFTOVERS):
                out.append(f"{os.path.join(top, n)}: left by an interrupted creation or removal of commit records")
            else:
                out.append(f"{os.path.join(top, n)}: the commit records of {was}, which " +
                           ("a new directory replaced" if n.startswith(_records.RETIRED) else "no longer exists") +
                           f" (if it was moved or copied elsewhere, `flashckpt adopt <its new path> --from {was}` "
                           "gives it its steps first)")
        return out

    def _take_hold(self, job: str) -> Held | None:
        lock = self._take_job_lock(job)
        try:
            fd: int | None = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if self.beside else None
        except OSError:
            fd = None
        self._hold = _Hold(lock, fd)
        return self._hold

    def _take_job_lock(self, job: str) -> Lease | None:
        path = self.job_lock_path(job)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            lock = Lease(path, shared=True)
            if lock.try_acquire(timeout=10.0):
                return lock
            log.warning("could not take the job lock %s; other jobs may clean up this job's steps", path)
        except OSError as e:
            log.warning("could not take the job lock %s (%s); other jobs may clean up this job's steps", path, e)
        return None

    def stale_reason(self, layout: Steps) -> str | None:
        """Why the records beside the checkpoint dir describe an earlier directory of its name (it was
        deleted and made again, or all its checkpoint files are gone), or None. Records bound to another
        directory whose committed steps the checkpoint dir holds whole are its (a copy, or a move, with its
        records): not stale. Reads only."""
        if not self.beside:
            return None
        try:
            ino = os.stat(self.root).st_ino
        except (FileNotFoundError, NotADirectoryError):
            return f"the checkpoint dir {self.root} does not exist"
        except OSError as e:
            raise unreadable("look up the checkpoint dir", self.root, e) from e
        bound = _records.read_binding(self.meta)
        if bound is not None and bound != ino and not self._whole(layout):
            return (f"they were written for an earlier directory {self.root} (inode {bound}; now {ino}), "
                    "which was deleted (or moved elsewhere)")
        return super().stale_reason(layout)

    def before_commit(self, layout: Steps, step: int, files: list[FileRecord]) -> None:
        """Checks, before ``step``'s manifest is written, that its files are in the checkpoint dir, and
        that the records are still bound to it. A checkpoint dir deleted under this job (and made again by
        its persists, or by a user) leaves the records bound to the deleted one: they are bound to the dir
        as it is now, and the committed steps whose files went with the deleted dir are dropped, so the
        step is loadable after this process.

        Raises:
            PersistError: a file of the step is gone (the dir was deleted after it was written)."""
        missing = [f.path for f in files if not os.path.exists(os.path.join(self.root, f.path))]
        if missing:
            raise E.PersistError(f"step {step}: {len(missing)} of its files are gone from {self.root} (for example "
                                 f"{missing[0]}): was the checkpoint dir deleted while the step was persisted? The "
                                 "step is not committed; save it again")
        if not self.beside or _records.read_binding(self.meta) == os.stat(self.root).st_ino:
            return
        top, name = os.path.split(self.meta)
        with _records.locked_parent(top):
            bound, ino = _records.read_binding(self.meta), os.stat(self.root).st_ino
            if bound == ino:
                return
            gone = [s for s in layout.committed_manifests() if s != step and s not in self._whole(layout)]
            for s in gone:
                self.storage.remove_tree(layout.step_dir(s))  # their files went with the deleted dir
            _records.rebind(self.meta, self.root)
            if self._hold is not None:
                if self._hold.dir_fd is not None:
                    os.close(self._hold.dir_fd)
                self._hold.dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        log.warning("the checkpoint dir %s was deleted and made again while this job saved to it (its commit "
                    "records were bound to the deleted one, inode %s): they describe the new one (inode %d) now; "
                    "committed steps %s, whose files went with the deleted dir, no longer count", self.root, bound,
                    ino, gone)

    def tidy(self, layout: Steps, *, dry_run: bool = False) -> list[str]:
        """Removes this checkpoint dir's stale records (records of a renamed dir move to its new name), the
        records of sibling dirs that no longer exist and retired records, when no live job holds a lock in
        them."""
        top, name = os.path.split(_records.home(self.root))
        if not _records.usable_top(top):
            return []
        with _records.locked_parent(top, lock=not dry_run) as top_fd:
            why = self.stale_reason(layout) if os.path.isdir(self.meta) and self.beside and os.path.isdir(self.root) \
                else None
            done = []
            if why and self.meta == os.path.join(top, name) and not upkeep.live_jobs_at(top_fd, name):
                to = upkeep.settle(top_fd, os.path.dirname(top), name, keep=False, dry_run=dry_run)
                done.append(f"{self.meta}: stale, {why}" + (f"; moved to {os.path.join(top, to)}" if to else ""))
            return done + self._swept(top_fd, orphans=True, dry_run=dry_run)
