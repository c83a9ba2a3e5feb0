"""Where a checkpoint dir's commit records live, and their upkeep: binding, stale records, orphans.

The records of checkpoint dir ``D`` live beside it, in ``<parent(D)>/.flashckpt/<basename(D)>/``, so
``D`` holds exactly what the user's framework writes there, and on the same file system (a manifest
is written by a rename). They stay inside, in ``D/.flashckpt/``, when:

- ``D/.flashckpt`` exists (a checkpoint dir written by an older flashckpt keeps its records);
- ``D`` is a mount point or on another file system than its parent (a symbolic link to one), or ``/``:
  a commit moves staged files from the records into ``D`` by rename;
- the parent is not writable by this user, or its ``.flashckpt`` is not a real directory of this user
  (a symbolic link, a file, another user's: never followed nor shared);
- ``D``'s name is one flashckpt uses for its own entries beside checkpoint dirs.

Records that exist beside ``D`` are used first. The choice depends only on facts of the shared storage,
so every process of every node of a job picks the same place (``place``).

Beside records are bound to their directory: ``dir.json`` holds ``D``'s inode number (``st_ino`` only:
``st_dev`` differs between NFS clients), written as the records are created. A saver starting on ``D``
(``CommitLayout.claim``) finds them stale when ``D``'s inode differs (``D`` was deleted and made again)
or when no file of any committed step exists; with no job lock held in them, it moves them aside (a
rename to a hidden name in ``<parent>/.flashckpt``) and removes them, then starts afresh. Creating
records sweeps orphans: records whose checkpoint dir no longer exists and whose job locks nobody holds.
Records whose directory was renamed in the same parent (a sibling has the bound inode and no records
of its own) move to its new name instead of being removed.
``<parent>/.flashckpt`` goes once it is empty. Claims and sweeps of one parent take turns on the lock
``<parent>/.flashckpt/.lock``; everything there is reached through a checked ``O_NOFOLLOW`` fd, so no
symbolic link is ever followed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import errors as E
from ._lease import held
from .config import _DIR_FLAGS
from .manifest import Manifest

__all__ = ["META", "Placement", "place", "home", "records_dir", "locked_parent", "bind", "rebind", "read_binding",
           "bound_dir", "committed_at", "committed_in", "whole_steps", "describes", "moved", "bring", "live_jobs_at", "discard",
           "renamed_to", "retire", "settle", "sweep", "usable_top"]

log = logging.getLogger(__name__)

META = ".flashckpt"
DIR_JSON = "dir.json"
MANIFEST = "manifest.json"
RECORDS_FORMAT = "flashckpt-records/1"
LOCK_NAME = ".lock"
_ASIDE = ".flashckpt-stale-"  # records moved aside, being removed
_NEW = ".flashckpt-new-"  # records being created
_RETIRED = ".flashckpt-retired-"  # records of a dir whose name a new dir took (it may live on elsewhere)
_OURS = (_ASIDE, _NEW, _RETIRED)
LEFTOVERS = (_ASIDE, _NEW)
RETIRED = _RETIRED
_EFFECTIVE = os.access in os.supports_effective_ids

_logged: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Placement:
    """Where the records of a checkpoint dir live: ``path``, ``beside`` it or inside it, and why."""

    path: str
    beside: bool
    why: str


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


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
    except OSError:  # not there (yet)
        return False


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
    if name in (META, LOCK_NAME) or name.startswith(_OURS):
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
        if lock:
            with contextlib.suppress(FileExistsError):
                os.mkdir(top, 0o755)
        try:
            fd = os.open(top, _DIR_FLAGS)
        except FileNotFoundError:
            if not lock:
                raise
            continue  # removed by the last user of another parent lock between our mkdir and open
        except OSError as e:
            st = _lstat(top)
            raise E.CheckpointDirError(f"{(_unusable(top, st) if st else '') or f'{top}: {e}'}; flashckpt keeps "
                                       "the commit records of the checkpoint dirs beside it there") from e
        lfd = -1
        try:
            why = _unusable(top, os.fstat(fd))
            if why:
                raise E.CheckpointDirError(f"{why}; flashckpt keeps the commit records of the checkpoint dirs "
                                           "beside it there: remove it, or ask its owner")
            if not lock:
                break
            try:
                lfd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
            except FileNotFoundError:
                os.close(fd)
                continue
            while True:
                try:
                    fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise E.CheckpointDirError(f"{os.path.join(top, LOCK_NAME)} stayed locked for "
                                                   f"{timeout:.0f} s; is a flashckpt process hung there?") from None
                    time.sleep(0.005)
        except BaseException:
            if lfd >= 0:
                os.close(lfd)
            os.close(fd)
            raise
        if _same(lfd, LOCK_NAME, fd) and _same(fd, top, None):
            break
        os.close(lfd)  # the lock file or ``top`` was removed while we waited: take the new one
        os.close(fd)
    try:
        yield fd
    finally:
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


def _open_dir_at(dir_fd: int, name: str) -> int | None:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:  # missing, a symbolic link (ELOOP), not a directory
        return None


def _read_binding_at(dir_fd: int) -> int | None:
    d = _read_json_at(dir_fd, DIR_JSON)
    ok = isinstance(d, dict) and d.get("format") == RECORDS_FORMAT and isinstance(d.get("ino"), int)
    return int(d["ino"]) if ok else None


def read_binding(records: str) -> int | None:
    """The inode number ``records``/dir.json binds them to; None when missing or unreadable."""
    try:
        fd = os.open(records, _DIR_FLAGS)
    except OSError:
        return None
    try:
        return _read_binding_at(fd)
    finally:
        os.close(fd)


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
    tmp = f"{_NEW}{uuid.uuid4().hex}"
    os.mkdir(tmp, 0o755, dir_fd=top_fd)
    fd = os.open(tmp, _DIR_FLAGS, dir_fd=top_fd)
    try:
        _write_binding(fd, os.path.realpath(root), ino)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=top_fd, dst_dir_fd=top_fd)
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


def bound_dir(records: str) -> str:
    """The checkpoint dir that ``records``/dir.json names (its path when the records were bound); ""."""
    top, name = os.path.split(records)
    try:
        fd = os.open(top, _DIR_FLAGS)
    except OSError:
        return ""
    try:
        return _dir_of(fd, name)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ records under another name
def _read_json_at(dir_fd: int, name: str) -> Any:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return json.loads(os.read(fd, 1 << 16))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def committed_at(records_fd: int) -> dict[int, Manifest]:
    """Step -> the sound manifest of each committed step in the records open at ``records_fd`` (never
    following a symbolic link). Reads only."""
    steps = _open_dir_at(records_fd, "steps")
    if steps is None:
        return {}
    out = {}
    try:
        for n in os.listdir(steps):
            d = _open_dir_at(steps, n) if n.isdigit() else None
            if d is None:
                continue
            try:
                fd = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)
            except OSError:
                continue
            finally:
                os.close(d)
            try:
                out[int(n)] = Manifest.from_json(_read_all(fd))
            except (OSError, ValueError, E.CheckpointCorruptError):
                continue
            finally:
                os.close(fd)
    finally:
        os.close(steps)
    return out


def committed_in(records: str) -> dict[int, Manifest]:
    """``committed_at`` of the records dir ``records`` (not followed when it is a symbolic link)."""
    try:
        fd = os.open(records, _DIR_FLAGS)
    except OSError:
        return {}
    try:
        return committed_at(fd)
    finally:
        os.close(fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def whole_steps(manifests: dict[int, Manifest], root: str) -> list[int]:
    """The steps of ``manifests`` whose every file is in ``root`` with the size it was committed with
    (symbolic links in ``root`` are followed: these are reads). Reads only."""
    out = []
    for s, m in manifests.items():
        files = m.all_files()
        try:
            if files and all(os.stat(os.path.join(root, f.path)).st_size == f.size for f in files):
                out.append(s)
        except OSError:
            continue
    return sorted(out)


def describes(records_fd: int, root: str) -> bool:
    """Whether the records open at ``records_fd`` may be those of ``root``: they have no committed step,
    or ``root`` holds every file of one of them (so a dir that merely got a reused inode number is not
    taken for theirs)."""
    manifests = committed_at(records_fd)
    return not manifests or bool(whole_steps(manifests, root))


def _bound_here(top: str, name: str, ino: int, root: str) -> bool:
    """Whether ``top``/``name`` are records bound to inode ``ino`` that may be those of ``root``."""
    try:
        top_fd = os.open(top, _DIR_FLAGS)
    except OSError:
        return False
    try:
        fd = _open_dir_at(top_fd, name)
    finally:
        os.close(top_fd)
    if fd is None:
        return False
    try:
        return _read_binding_at(fd) == ino and describes(fd, root)
    finally:
        os.close(fd)


def moved(real: str, given: str) -> tuple[str, str] | None:
    """Records of the checkpoint dir whose real path is ``real``, kept under another name: (where, why),
    or None. Looked for, when the dir has no records of its own, among the records beside it bound to its
    inode (it was renamed in its parent, or came back there), and beside ``given`` (it is reached through
    a symbolic link, where versions that did not resolve links kept them). Records whose committed steps
    are not in the dir are not its (an inode number reused); several candidates are none (logged). Reads
    only."""
    try:
        st = os.stat(real)
    except OSError:
        return None
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
        for n in sorted(os.listdir(top)):
            if n in (name, LOCK_NAME) or n.startswith((_ASIDE, _NEW)):
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


def bring(top_fd: int, top: str, src: str, name: str) -> str:
    """Moves the records ``src`` (found by ``moved``) to ``name`` in ``top`` (open at ``top_fd``), the
    place of their dir now; returns where they are (``src`` itself when they cannot be moved: another file
    system, say). The caller holds the parent lock of ``top``."""
    try:
        if os.path.dirname(src) == top:
            os.rename(os.path.basename(src), name, src_dir_fd=top_fd, dst_dir_fd=top_fd)
        else:
            os.rename(src, name, dst_dir_fd=top_fd)
        os.fsync(top_fd)
    except OSError as e:
        log.warning("the commit records %s stay where they are (moving them to %s failed: %s)", src,
                    os.path.join(top, name), e)
        return src
    return os.path.join(top, name)


def live_jobs_at(top_fd: int, name: str) -> list[str]:
    """The jobs whose locks in the records ``name`` (in ``top_fd``) are held by a live saver."""
    fd = _open_dir_at(top_fd, name)
    if fd is None:
        return []
    try:
        jobs = _open_dir_at(fd, "jobs")
    finally:
        os.close(fd)
    if jobs is None:
        return []
    try:
        return sorted(n[:-5] for n in os.listdir(jobs) if n.endswith(".lock") and held(n, dir_fd=jobs))
    finally:
        os.close(jobs)


def discard(top_fd: int, name: str) -> None:
    """Moves the records ``name`` aside (one rename: readers see them whole or not at all), then removes
    them, never following a symbolic link."""
    aside = name if name.startswith(_ASIDE) else f"{_ASIDE}{uuid.uuid4().hex}"
    if aside != name:
        os.rename(name, aside, src_dir_fd=top_fd, dst_dir_fd=top_fd)
        os.fsync(top_fd)
    shutil.rmtree(aside, dir_fd=top_fd, ignore_errors=True)


def renamed_to(top_fd: int, parent: str, name: str) -> str | None:
    """The name of the directory in ``parent`` that the records ``name`` are bound to, when it is no
    longer ``name`` (the checkpoint dir was renamed in ``parent``), keeps its records beside it, has none
    of its own and holds their committed steps (``describes``); None otherwise. Reads only."""
    fd = _open_dir_at(top_fd, name)
    if fd is None:
        return None
    try:
        ino = _read_binding_at(fd)
        if ino is None:
            return None
        dev = os.stat(parent).st_dev
        with os.scandir(parent) as it:
            for e in it:
                if e.name == name or e.inode() != ino:
                    continue
                st = e.stat(follow_symlinks=False)
                if st.st_ino != ino or st.st_dev != dev or not stat.S_ISDIR(st.st_mode):
                    continue
                if not _rule(e.path, e.path).beside or _lstat(os.path.join(parent, META, e.name)) is not None:
                    return None  # it keeps its records inside, or has records of its own
                return e.name if describes(fd, e.path) else None
    finally:
        os.close(fd)
    return None


def retire(top_fd: int, name: str) -> str:
    """Moves the records ``name`` aside under a name of their own, kept (not removed): their directory's
    name now belongs to another directory, and it may live on elsewhere (moved out of its parent), so
    ``flashckpt adopt`` can still give them back to it; ``flashckpt gc`` removes them. Earlier retired
    records of the same directory path that no live job holds are removed (one set kept per path).
    Returns the new name. The caller holds the parent lock."""
    path = _dir_of(top_fd, name)
    for n in os.listdir(top_fd):
        if n.startswith(_RETIRED) and path and _dir_of(top_fd, n) == path and not live_jobs_at(top_fd, n):
            discard(top_fd, n)
    to = f"{_RETIRED}{uuid.uuid4().hex}"
    os.rename(name, to, src_dir_fd=top_fd, dst_dir_fd=top_fd)
    os.fsync(top_fd)
    return to


def _dir_of(top_fd: int, name: str) -> str:
    """The directory path the records ``name`` in ``top_fd`` were bound to ("" when unknown)."""
    fd = _open_dir_at(top_fd, name)
    if fd is None:
        return ""
    try:
        d = _read_json_at(fd, DIR_JSON)
    finally:
        os.close(fd)
    return str(d.get("dir", "")) if isinstance(d, dict) else ""


def settle(top_fd: int, parent: str, name: str, *, keep: bool, dry_run: bool = False) -> str:
    """Records ``name`` that are not (or no longer) those of ``<parent>/<name>``: moved to the directory
    they are bound to when it was renamed in ``parent`` (``renamed_to``; returns its name), else retired
    with ``keep`` (``retire``; returns ""), else removed (``discard``; returns ""). The caller holds the
    parent lock (``dry_run``: need not, and nothing changes)."""
    to = renamed_to(top_fd, parent, name)
    if dry_run:
        return to or ""
    if to:
        os.rename(name, to, src_dir_fd=top_fd, dst_dir_fd=top_fd)
        os.fsync(top_fd)
        return to
    if keep:
        retire(top_fd, name)
    else:
        discard(top_fd, name)
    return ""


def sweep(top_fd: int, parent: str, *, orphans: bool = False, dry_run: bool = False) -> list[tuple[str, str]]:
    """Upkeep of ``top_fd`` (``<parent>/.flashckpt``), leaving alone whatever a live job holds a lock in:
    records whose checkpoint dir ``<parent>/<name>`` no longer exists follow it when it was renamed in
    ``parent`` (``renamed_to``); leftovers of interrupted creations and removals are removed. With
    ``orphans`` (``flashckpt gc``) the records of directories that no longer exist and retired records
    are removed too: the directory may have been moved out of ``parent`` (its records do not follow it
    there), so nothing else removes them. Entries that are not flashckpt's records (no ``dir.json`` of
    ours), and symbolic links, are left alone. The caller holds the parent lock (``dry_run``: need not).

    Returns:
        (name, the name they moved to or "" when removed) of each (with ``dry_run``: would be).
    """
    out = []
    for name in sorted(os.listdir(top_fd)):
        if name == LOCK_NAME:
            continue
        leftover = name.startswith((_ASIDE, _NEW))
        retired = name.startswith(_RETIRED)
        if not (leftover or retired) and os.path.lexists(os.path.join(parent, name)):
            continue
        fd = _open_dir_at(top_fd, name)
        if fd is None:
            continue
        try:
            ours = leftover or _read_binding_at(fd) is not None
        finally:
            os.close(fd)
        if not ours or live_jobs_at(top_fd, name):
            continue
        if leftover or (retired and orphans):
            out.append((name, ""))
            if not dry_run:
                discard(top_fd, name)
        elif not retired:
            to = renamed_to(top_fd, parent, name)
            if to or orphans:
                out.append((name, settle(top_fd, parent, name, keep=False, dry_run=dry_run)))
    return out
