"""Where a checkpoint dir's commit records live, and their upkeep: binding, stale records, moves, orphans.

The records of checkpoint dir ``D`` live beside it, in ``<parent(D)>/.flashckpt/<basename(D)>/`` of
``D``'s real path (symbolic links resolved: a dir reached through a link and through its real path has
one set of records), so ``D`` holds exactly what the user's framework writes there, and on the same
file system (a manifest is written by a rename). They stay inside, in ``D/.flashckpt/``, when:

- ``D/.flashckpt`` exists (a checkpoint dir written by an older flashckpt keeps its records);
- ``D`` is a mount point or on another file system than its parent, or ``/``: a commit moves staged
  files from the records into ``D`` by rename;
- the parent is not writable by this user, or its ``.flashckpt`` is not a real directory of this user
  (a symbolic link, a file, another user's: never followed nor shared);
- ``D``'s name is one flashckpt uses for its own entries beside checkpoint dirs.

Records that exist beside ``D`` are used first; when there are none, records bound to ``D``'s inode
under another name are ``D``'s (``moved``: ``D`` was renamed in its parent, or is reached through a link
beside which an older version kept them), provided ``D`` holds every file of one of their committed
steps. The choice depends only on facts of the shared storage, so every process of every node of a job
picks the same place (``place``).

Beside records are bound to their directory: ``dir.json`` holds ``D``'s inode number (``st_ino`` only:
``st_dev`` differs between NFS clients) and its path. A saver starting on ``D`` (``CommitLayout.claim``)
moves records found under another name to ``D``'s name (``bring``), and finds records stale when
``D``'s inode differs and ``D`` does not hold their committed steps (``D`` was deleted, or moved away,
and another directory took its name), or when no file of any committed step exists. With no job lock
held in them, stale records go to the directory they are bound to when it was renamed in the parent
(``renamed_to``); else those bound to another directory are retired (``retire``: kept aside under a
hidden name, for ``flashckpt adopt``, until ``flashckpt gc``), since that directory may live on
elsewhere, and those whose files are gone are removed (moved aside by one rename, so readers see them
whole or not at all, then removed); the run starts afresh. Records bound to another inode whose
committed steps ``D`` holds whole are ``D``'s (a copy, a move or a restore with its records): bound to
``D`` again. Creating records moves those of sibling dirs renamed since; records whose directory no
longer exists are never removed by a claim (it may have been moved out of the parent, where its
records cannot follow it), only by ``flashckpt gc`` (``sweep(orphans=True)``). ``<parent>/.flashckpt``
goes once it is empty. Claims and sweeps of one parent take turns on the lock
``<parent>/.flashckpt/.lock``; everything there is reached through a checked ``O_NOFOLLOW`` fd, so no
symbolic link is ever followed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from flashckpt import errors as E
from flashckpt.commit.records_read import (
    ASIDE,
    DIR_JSON,
    LEFTOVERS,
    LOCK_NAME,
    MANIFEST,
    NEW,
    OURS,
    RECORDS_FORMAT,
    RETIRED,
    _listdir,
    _lstat,
    _open_dir,
    _open_dir_at,
    _read_binding_at,
    absent,
    bound_dir,
    committed_at,
    committed_in,
    describes,
    read_binding,
    unreadable,
    whole_steps,
)
from flashckpt.config import _DIR_FLAGS
from flashckpt.format.names import META

__all__ = ["DIR_JSON", "MANIFEST", "RECORDS_FORMAT", "LOCK_NAME", "LEFTOVERS", "RETIRED", "ASIDE",
           "Placement", "place", "home", "records_dir", "locked_parent", "bind", "rebind", "read_binding", "bound_dir",
           "committed_at", "committed_in", "whole_steps", "describes", "moved", "usable_top"]

log = logging.getLogger(__name__)

_EFFECTIVE = os.access in os.supports_effective_ids
_logged: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Placement:
    """Where the records of a checkpoint dir live: ``path``, ``beside`` it or inside it, and why."""

    path: str
    beside: bool
    why: str


def _unusable(top: str, st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return f"{top} is a symbolic link, which flashckpt never follows"
    if not stat.S_ISDIR(st.st_mode):
        return f"{top} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{top} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    return ""


def _other_fs(root: str, parent: str) -> bool:
    try:
        return os.stat(root).st_dev != os.stat(parent).st_dev or os.path.ismount(root)
    except OSError as e:
        if absent(e):  # not there (yet)
            return False
        raise unreadable("look up", root, e) from e


def usable_top(top: str) -> bool:
    """Whether ``top`` (``<parent>/.flashckpt``) exists and may hold records: a real directory of ours."""
    st = _lstat(top)
    return st is not None and not _unusable(top, st)


def place(root: str) -> Placement:
    """Where the records of checkpoint dir ``root`` live (see the module docstring). Symbolic links in
    ``root`` are resolved first, so a dir reached through a link and through its real path has one
    place. Records that exist for the dir under another name (``moved``) are used when it has none of its
    own. Reads only."""
    given = os.path.abspath(root)
    real = os.path.realpath(given)
    p = _rule(real, given)
    if p.beside and _lstat(p.path) is None:
        found = moved(real, given)
        if found is not None:
            return Placement(found[0], True, found[1])
    return p


def home(root: str) -> str:
    """Where the records of ``root`` live when beside it: ``<parent>/.flashckpt/<name>`` of its real path."""
    parent, name = os.path.split(os.path.realpath(os.path.abspath(root)))
    return os.path.join(parent, META, name)


def _rule(real: str, given: str) -> Placement:
    """``place``'s rule for the dir whose real path is ``real`` (``given``: as the caller names it)."""
    parent, name = os.path.split(real)
    inside = os.path.join(given, META)

    def at_inside(why: str) -> Placement:
        return Placement(inside, False, why)

    if not name:
        return at_inside("the checkpoint dir is /")
    if name in (META, LOCK_NAME) or name.startswith(OURS):
        return at_inside(f"its name {name!r} is one flashckpt uses for its own entries beside checkpoint dirs")
    top = os.path.join(parent, META)
    beside = os.path.join(top, name)
    top_st = _lstat(top)
    if top_st is not None:
        why = _unusable(top, top_st)
        if why:
            return at_inside(why)
        st = _lstat(beside)
        if st is not None:
            if stat.S_ISDIR(st.st_mode):
                return Placement(beside, True, "its records are there")
            return at_inside(f"{beside} is not a directory")
    if _lstat(inside) is not None:
        return at_inside(f"{inside} exists (records of an older flashckpt, or kept inside before)")
    if _other_fs(real, parent):
        return at_inside(f"it is a mount point or on another file system than {parent} (a commit moves files "
                         "between the records and the checkpoint dir by rename)")
    writable = top if top_st is not None else parent
    if not os.access(writable, os.W_OK | os.X_OK, effective_ids=_EFFECTIVE):
        return at_inside(f"{writable} is not writable by this user")
    return Placement(beside, True, f"flashckpt keeps the records of the checkpoint dirs in {parent} in {top}")


def records_dir(root: str) -> str:
    """The records dir of checkpoint dir ``root`` (``place``); logs the choice once per process."""
    p = place(root)
    key = (os.path.abspath(root), p.path)
    if key not in _logged:
        _logged.add(key)
        log.log(logging.DEBUG if p.beside else logging.INFO, "commit records of %s are in %s: %s",
                key[0], p.path, p.why)
    return p.path


def _same(fd: int, name: str, dir_fd: int | None) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_ino, st.st_dev) == (own.st_ino, own.st_dev)


def _open_top(top: str, *, lock: bool) -> int | None:
    """An fd of ``top``, created 0755 first with ``lock``; None when it is to be opened again.

    Raises:
        CheckpointDirError: ``top`` is a symbolic link, not a directory, or another user's."""
    if lock:
        with contextlib.suppress(FileExistsError):
            os.mkdir(top, 0o755)
    try:
        return os.open(top, _DIR_FLAGS)
    except FileNotFoundError:
        if not lock:
            raise
        return None  # removed by the last user of another parent lock between our mkdir and open
    except OSError as e:
        st = _lstat(top)
        why = _unusable(top, st) if st else ""
        if not why:
            raise unreadable("open", top, e) from e
        raise E.CheckpointDirError(f"{why}; flashckpt keeps the commit records of the checkpoint dirs beside it "
                                   "there") from e


def _check_top(top: str, fd: int) -> None:
    """Raises CheckpointDirError unless the opened ``top`` is a real directory of this user."""
    why = _unusable(top, os.fstat(fd))
    if why:
        raise E.CheckpointDirError(f"{why}; flashckpt keeps the commit records of the checkpoint dirs "
                                   "beside it there: remove it, or ask its owner")


def _take_lock(fd: int, top: str, deadline: float, timeout: float) -> int | None:
    """An fd of ``top``'s lock file (``fd``: ``top``'s), locked by this process; None when ``top`` was
    removed meanwhile (try again).

    Raises:
        CheckpointDirError: the lock stayed held until ``deadline`` (``timeout`` seconds after the start)."""
    try:
        lfd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
    except FileNotFoundError:
        return None
    try:
        while True:
            try:
                fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return lfd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise E.CheckpointDirError(f"{os.path.join(top, LOCK_NAME)} stayed locked for "
                                               f"{timeout:.0f} s; is a flashckpt process hung there?") from None
                time.sleep(0.005)
    except BaseException:
        os.close(lfd)
        raise


def _leave_top(top: str, fd: int, lfd: int, *, lock: bool) -> None:
    """Closes ``locked_parent``'s fds; with ``lock``, first removes the lock file (waiters find their file
    gone and start over), and ``top`` when empty."""
    try:
        if lock:
            os.unlink(LOCK_NAME, dir_fd=fd)  # waiters find their file gone and start over
            if not os.listdir(fd):
                os.rmdir(top)  # only when empty: a claim that just started there keeps it
    except OSError:
        pass
    if lfd >= 0:
        os.close(lfd)
    os.close(fd)


@contextlib.contextmanager
def locked_parent(top: str, *, timeout: float = 60.0, lock: bool = True) -> Iterator[int]:
    """An fd of ``top`` (``<parent>/.flashckpt``), created 0755 when missing, checked to be a real
    directory of this user, and, with ``lock``, with its lock (the file ``.lock`` in it) held. On leaving,
    the lock file is removed (a waiter finds it gone and takes a new one), and ``top`` when empty.

    Raises:
        CheckpointDirError: ``top`` is a symbolic link, not a directory, another user's, or its lock is
            held for ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        fd = _open_top(top, lock=lock)
        if fd is None:
            continue
        lfd = -1
        try:
            _check_top(top, fd)
            if not lock:
                break
            got = _take_lock(fd, top, deadline, timeout)
        except BaseException:
            os.close(fd)
            raise
        if got is None:
            os.close(fd)
            continue
        lfd = got
        if _same(lfd, LOCK_NAME, fd) and _same(fd, top, None):
            break
        os.close(lfd)  # the lock file or ``top`` was removed while we waited: take the new one
        os.close(fd)
    try:
        yield fd
    finally:
        _leave_top(top, fd, lfd, lock=lock)


def _write_binding(dir_fd: int, root: str, ino: int) -> None:
    body = json.dumps({"format": RECORDS_FORMAT, "dir": root, "ino": ino, "time": time.time()}).encode()
    tmp = f"{DIR_JSON}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, DIR_JSON, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def bind(top_fd: int, name: str, root: str) -> bool:
    """Binds the records ``name`` in ``top_fd`` to the checkpoint dir ``root`` (its inode in
    ``dir.json``), creating them when missing: made complete under a temporary name, then renamed into
    place. Records bound to another inode are bound to ``root`` again (the caller found that ``root``
    holds their committed steps: a copy or a move with its records). Returns True when it created them.
    The caller holds the parent lock."""
    ino = os.stat(root).st_ino
    fd = _open_dir_at(top_fd, name)
    if fd is not None:
        try:
            if _read_binding_at(fd) != ino:
                _write_binding(fd, os.path.realpath(root), ino)
        finally:
            os.close(fd)
        return False
    tmp = f"{NEW}{uuid.uuid4().hex}"
    os.mkdir(tmp, 0o755, dir_fd=top_fd)
    fd = os.open(tmp, _DIR_FLAGS, dir_fd=top_fd)
    try:
        _write_binding(fd, os.path.realpath(root), ino)
    finally:
        os.close(fd)
    try:
        os.rename(tmp, name, src_dir_fd=top_fd, dst_dir_fd=top_fd)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        # Made meanwhile by a writer that needs no parent lock (a saver of another node putting the job's
        # peer book into them, say): they are these records, bound here instead.
        fd = os.open(tmp, _DIR_FLAGS, dir_fd=top_fd)
        try:
            for n in os.listdir(fd):  # its dir.json (and a temp file of it, at most)
                os.unlink(n, dir_fd=fd)
        finally:
            os.close(fd)
        os.rmdir(tmp, dir_fd=top_fd)
        return bind(top_fd, name, root)
    os.fsync(top_fd)
    return True


def rebind(records: str, root: str) -> None:
    """Binds the records dir ``records`` to ``root`` as it is now (its inode). The caller holds the parent
    lock."""
    fd = os.open(records, _DIR_FLAGS)
    try:
        _write_binding(fd, os.path.realpath(root), os.stat(root).st_ino)
    finally:
        os.close(fd)


def _bound_here(top: str, name: str, ino: int, root: str) -> bool:
    """Whether ``top``/``name`` are records bound to inode ``ino`` that may be those of ``root``.

    Raises:
        CheckpointDirError: they could not be read (``unreadable``)."""
    top_fd = _open_dir(top)
    if top_fd is None:
        return False
    try:
        fd = _open_dir_at(top_fd, name, where=top)
    finally:
        os.close(top_fd)
    if fd is None:
        return False
    try:
        return _read_binding_at(fd, os.path.join(top, name)) == ino and describes(fd, root)
    finally:
        os.close(fd)


def moved(real: str, given: str) -> tuple[str, str] | None:
    """Records of the checkpoint dir whose real path is ``real``, kept under another name: (where, why),
    or None. Looked for, when the dir has no records of its own, among the records beside it bound to its
    inode (it was renamed in its parent, or came back there), and beside ``given`` (it is reached through
    a symbolic link, where versions that did not resolve links kept them). Records whose committed steps
    are not in the dir are not its (an inode number reused); several candidates are none (logged). Reads
    only.

    Raises:
        CheckpointDirError: the dir or records beside it could not be read (``unreadable``): records not
            found for that reason would leave the dir without its committed steps."""
    try:
        st = os.stat(real)
    except OSError as e:
        if absent(e):
            return None
        raise unreadable("look up", real, e) from e
    if not stat.S_ISDIR(st.st_mode):
        return None
    found: list[tuple[str, str]] = []
    lex_parent, lex_name = os.path.split(given)
    lex_top = os.path.join(lex_parent, META)
    if given != real and lex_name and usable_top(lex_top) and _bound_here(lex_top, lex_name, st.st_ino, real):
        found.append((os.path.join(lex_top, lex_name), f"its records are beside {given}, the link it is reached by"))
    parent, name = os.path.split(real)
    top = os.path.join(parent, META)
    if usable_top(top):
        for n in sorted(_listdir(top)):
            if n in (name, LOCK_NAME) or n.startswith(LEFTOVERS):
                continue
            other = _lstat(os.path.join(parent, n))
            if other is not None and other.st_ino == st.st_ino:
                continue
            if _bound_here(top, n, st.st_ino, real):
                found.append((os.path.join(top, n), f"its records are in {os.path.join(top, n)}, bound to it: it "
                              f"was named {bound_dir(os.path.join(top, n)) or n} before"))
    if len(found) > 1:
        key = (real, "several")
        if key not in _logged:
            _logged.add(key)
            log.warning("several commit records are bound to %s: %s; using none of them (remove the wrong ones, "
                        "or run `flashckpt adopt`)", real, [f for f, _w in found])
        return None
    return found[0] if found else None

