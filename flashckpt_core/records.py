"""Where a checkpoint dir's commit records live, and how a job holds them: one ``RecordsHome`` per backend.

``CommitLayout`` writes the commit protocol (markers, manifests, the tracker) into ``home.meta`` through
the storage backend; what depends on the kind of store is here:

- ``PosixRecords`` (file systems): beside the checkpoint dir where possible (``_records`` decides and keeps
  them bound to the dir's inode), job locks are ``flock``s on files in ``meta/jobs``;
- ``InsideRecords`` (object stores and any backend without a local file system): in ``<dir>/.flashckpt``,
  so deleting the prefix deletes them too; a job holds them with a lease object that its saver keeps
  alive (``ObjectLease``: rewritten every third of its time to live), since a store has no locks.

Call order: a saver starting on a checkpoint dir calls ``claim(job)`` (records readied, stale ones
removed, this job's lease taken and held for the saver's life); anyone calls ``job_alive``/``live_jobs``
(start-up clean-up leaves live jobs' steps alone) and ``stale_reason``; ``flashckpt gc`` calls ``tidy``.
Torch-free: the saver daemon uses it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

from . import _records, locations
from . import errors as E
from ._lease import Lease, held
from ._records import META

if TYPE_CHECKING:
    from .commit import CommitLayout
    from .storage import CheckpointStorage

__all__ = ["RecordsHome", "PosixRecords", "InsideRecords", "ObjectLease", "Held", "META"]

log = logging.getLogger(__name__)


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
    def claim(self, job: str, layout: CommitLayout) -> Held | None:
        """Readies the records for a saver of ``job`` starting on the checkpoint dir and takes the job's
        hold on them; None when it could not be taken (logged: other jobs may clean up this job's steps).

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

    def stale_reason(self, layout: CommitLayout) -> str | None:
        """Why the records describe files that are gone (every committed step's files are missing), or
        None. Reads only."""
        manifests = layout._committed_manifests()
        paths = [f.path for m in manifests.values() for f in m.all_files()]
        if paths and not any(self.storage.exists(locations.join(self.root, p)) for p in paths):
            return f"no file of their committed steps {sorted(manifests)} exists in {self.root}"
        return None

    def tidy(self, layout: CommitLayout, *, dry_run: bool = False) -> list[str]:
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

    def claim(self, job: str, layout: CommitLayout) -> Held | None:
        try:
            ttl = float(os.environ.get("FLASHCKPT_LEASE_TTL_S", "60") or 60)
        except ValueError:
            ttl = 60.0
        try:
            return ObjectLease(self.storage, self._lease_path(job), ttl_s=max(ttl, 1.0)).acquire()
        except OSError as e:
            raise E.CheckpointDirError(f"cannot write the commit records in {self.meta}: {e}") from e

    def job_alive(self, job: str) -> bool:
        if not job or "/" in job or job.startswith("."):
            return False
        return ObjectLease.alive(self.storage, self._lease_path(job))


# ------------------------------------------------------------------------------------------ file systems
class PosixRecords(RecordsHome):
    """Records beside the checkpoint dir where possible, bound to it (see ``_records``), with ``flock``
    job locks held shared by every live saver of a job."""

    def __init__(self, storage: CheckpointStorage, root: str) -> None:
        super().__init__(storage, root)
        self._meta = _records.records_dir(root)

    @property
    def meta(self) -> str:
        return self._meta

    def job_lock_path(self, job: str) -> str:
        return os.path.join(self.meta, "jobs", f"{job}.lock")

    def job_alive(self, job: str) -> bool:
        if not job or os.sep in job or job.startswith("."):
            return False
        try:
            return held(self.job_lock_path(job))
        except OSError:
            return False

    def claim(self, job: str, layout: CommitLayout) -> Held | None:
        """Beside the checkpoint dir, under the parent's lock: stale records (``stale_reason``) that no
        live job holds a lock in are moved aside and removed; the records are bound to the checkpoint
        dir (``dir.json``); creating them sweeps the parent's orphans. The records dir is chosen again
        here, so ``meta`` may change.

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
            top, name = os.path.split(self.meta)
            with _records.locked_parent(top) as top_fd:
                self._meta = _records.records_dir(self.root)  # again, under the lock
                if self.beside and self._renew(top_fd, name, layout):
                    return self._take_job_lock(job)  # before the parent lock goes: the records are in use
        return self._take_job_lock(job)

    def _renew(self, top_fd: int, name: str, layout: CommitLayout) -> bool:
        """Removes stale records, binds (or creates) them; False when, the stale ones gone, the rule
        now keeps the records inside (``meta`` changed)."""
        if os.path.isdir(self.meta):
            why = self.stale_reason(layout)
            if why:
                live = _records.live_jobs_at(top_fd, name)
                if live:
                    log.warning("the commit records in %s look stale (%s), but jobs %s hold their locks there; "
                                "left alone", self.meta, why, live)
                else:
                    to = _records.follow_or_discard(top_fd, os.path.dirname(self.root), name)
                    log.warning("the commit records in %s were stale (%s): %s; starting afresh", self.meta, why,
                                f"moved to {os.path.join(os.path.dirname(self.meta), to)}, the records of the "
                                "directory they describe, renamed since" if to else "removed")
                    self._meta = _records.records_dir(self.root)
                    if not self.beside:
                        return False
        if _records.bind(top_fd, name, self.root):
            for line in self._swept(top_fd):
                log.info("%s", line)
        return True

    def _swept(self, top_fd: int, *, dry_run: bool = False) -> list[str]:
        parent = os.path.dirname(self.root)
        top = os.path.join(parent, META)
        return [f"{os.path.join(top, n)}: the commit records of {os.path.join(parent, n)}, which no longer exists" +
                (f"; moved to {os.path.join(top, to)} (that directory was renamed to {to})" if to else "")
                for n, to in _records.sweep(top_fd, parent, dry_run=dry_run)]

    def _take_job_lock(self, job: str) -> Held | None:
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

    def stale_reason(self, layout: CommitLayout) -> str | None:
        """Why the records beside the checkpoint dir describe an earlier directory of its name (it was
        deleted and made again, or all its checkpoint files are gone), or None. Reads only."""
        if not self.beside:
            return None
        try:
            ino = os.stat(self.root).st_ino
        except OSError:
            return f"the checkpoint dir {self.root} does not exist"
        bound = _records.read_binding(self.meta)
        if bound is not None and bound != ino:
            return (f"they were written for an earlier directory {self.root} (inode {bound}; now {ino}), "
                    "which was deleted")
        return super().stale_reason(layout)

    def tidy(self, layout: CommitLayout, *, dry_run: bool = False) -> list[str]:
        """Removes this checkpoint dir's stale records and the orphans beside it (records of sibling dirs
        that no longer exist), when no live job holds a lock in them."""
        parent = os.path.dirname(self.root)
        top = os.path.join(parent, META)
        if not _records.usable_top(top):
            return []
        with _records.locked_parent(top, lock=not dry_run) as top_fd:
            name = os.path.basename(self.root)
            why = self.stale_reason(layout) if os.path.isdir(self.meta) and self.beside and os.path.isdir(self.root) \
                else None
            done = []
            if why and not _records.live_jobs_at(top_fd, name):
                to = _records.follow_or_discard(top_fd, parent, name, dry_run=dry_run)
                done.append(f"{self.meta}: stale, {why}" + (f"; moved to {os.path.join(top, to)}" if to else ""))
            return done + self._swept(top_fd, dry_run=dry_run)

