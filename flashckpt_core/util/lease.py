"""Leases: ``flock``s held for a process's life, released by the kernel when the process dies.

Two uses:

- A writer lease (``writer-rNNN.lease`` in the job's runtime dir): exclusive. The one engine that writes
  a local rank's shared-memory segment holds it, so a second writer (another engine in the process,
  another job with the same job key) is refused instead of writing the same slots.
- A job lease (``jobs/<job key>.lock`` in the checkpoint dir's commit records; see ``_records``): shared. Every saver of a job
  holds it while alive; another job's start-up clean-up asks ``held`` and leaves the steps of a live
  job alone.

A lease file names its holder (JSON: pid, what holds it) for the error a refused writer gets. A
process that forks (DataLoader workers) does not pass its leases on: the child closes its copies at
once, so a crashed trainer's lease is free for its restart even while its forked children linger.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
import time
import weakref
from typing import Any

__all__ = ["Lease", "held", "live_holder", "read_holder", "describe_holder", "pid_running"]

_live: weakref.WeakSet[Lease] = weakref.WeakSet()
_live_lock = threading.Lock()


def _close_in_child() -> None:
    # A forked child shares the parent's open file descriptions: closing its copies drops its share of
    # the lock without releasing the parent's.
    for lease in list(_live):
        fd, lease._fd = lease._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


os.register_at_fork(after_in_child=_close_in_child)


class Lease:
    """An ``flock`` on ``path`` (created 0600), exclusive or shared, taken without blocking.

    Args:
        path: the lease file.
        shared: take a shared lock (several holders) instead of an exclusive one.
    """

    def __init__(self, path: str, *, shared: bool = False) -> None:
        self.path = path
        self.shared = shared
        self._fd: int | None = None

    def try_acquire(self, holder: dict[str, Any] | None = None, *, timeout: float = 0.0) -> bool:
        """Takes the lease; False when another holder keeps it for ``timeout`` seconds. An exclusive
        holder writes ``holder`` (plus its pid) into the file. Retries when the file was unlinked by its
        last holder while this one waited on it, so two holders never hold two different files."""
        deadline = time.monotonic() + timeout
        delay = 0.002
        op = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, op)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= deadline:
                    return False
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
                continue
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            if not self.shared:
                body = json.dumps({"pid": os.getpid(), **(holder or {})}).encode()
                os.ftruncate(fd, 0)
                try:
                    os.pwrite(fd, body, 0)
                except OSError as e:  # a full file system: the flock is the lease; the body only names it
                    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                        os.close(fd)
                        raise
            self._fd = fd
            with _live_lock:
                _live.add(self)
            return True

    def release(self, *, unlink: bool = True) -> None:
        """Gives the lease up; with ``unlink``, removes its file when no one else holds it."""
        fd, self._fd = self._fd, None
        with _live_lock:
            _live.discard(self)
        if fd is None:
            return
        try:
            if unlink:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no other holder: the file may go
                    if os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                        os.unlink(self.path)
                except OSError:
                    pass
        finally:
            os.close(fd)

    def locked(self) -> bool:
        return self._fd is not None


def held(path: str, *, dir_fd: int | None = None) -> bool:
    """Whether some process holds a lease on ``path`` (shared or exclusive; relative to ``dir_fd``
    when given). A symbolic link is never followed (never held)."""
    return _probe(path, fcntl.LOCK_EX, dir_fd)


def live_holder(path: str, *, exit_wait: float = 10.0) -> dict[str, Any] | None:
    """What the holder of the exclusive lease ``path`` wrote about itself (``{}`` when nothing readable), when
    a process other than this one holds it; None when nobody holds it or this process does. A holder whose
    named pid has exited is given ``exit_wait`` seconds to let go (a killed process's threads may still be
    closing its files); one that keeps it is a process that pid forked without closing its copy, or a
    process of another pid namespace: still a holder.

    The probe takes a shared lock for an instant, never blocking: probes never exclude one another, and a
    writer that tries to take the lease at that instant retries for a moment (``snapshot_writer``)."""
    if not _held_exclusively(path):
        return None
    holder = read_holder(path)
    pid = holder.get("pid")
    if pid == os.getpid():
        return None
    if isinstance(pid, int) and not pid_running(pid):
        deadline = time.monotonic() + exit_wait
        delay = 0.002
        while _held_exclusively(path):
            if time.monotonic() >= deadline:
                return holder
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return None
    return holder


def _held_exclusively(path: str) -> bool:
    """Whether some process holds an exclusive ``flock`` on ``path`` (probed with a shared one, at once
    dropped). A symbolic link is never followed (never held)."""
    return _probe(path, fcntl.LOCK_SH, None)


def _probe(path: str, op: int, dir_fd: int | None) -> bool:
    """Whether a non-blocking ``flock(op)`` on ``path`` is refused (the lock taken, if any, is dropped at
    once); False when ``path`` is missing or a symbolic link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        return False
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's lock


def read_holder(path: str) -> dict[str, Any]:
    """What the exclusive holder of ``path`` wrote about itself ({} when unreadable)."""
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read() or b"{}")
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def describe_holder(holder: dict[str, Any]) -> str:
    """Who holds a lease, from what it wrote about itself (``read_holder``): its pid, and its rank and
    checkpoint dir where it named them, for messages."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or not pid:
        who = "another process"
    elif pid == os.getpid():
        who = f"this process (pid {pid})"
    elif not pid_running(pid):
        who = f"a process that pid {pid} (exited) forked and that still holds its lease"
    else:
        who = f"pid {pid}"
    extra = ", ".join(f"{k} {holder[k]}" for k in ("rank", "checkpoint_dir") if k in holder)
    return f"{who} ({extra})" if extra else who


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return raw[raw.rfind(b")") + 2:][:1] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
