"""The upkeep of the records beside checkpoint dirs (see ``_records``): records moved to the name of
their dir (``bring``, ``renamed_to``), set aside (``retire``) or removed (``discard``), and the sweep of
``<parent>/.flashckpt`` (``sweep``). Every function takes an fd of ``<parent>/.flashckpt`` checked by
``_records.locked_parent`` and never follows a symbolic link; the caller holds the parent lock (unless
a ``dry_run`` changes nothing). Records that cannot be read (``_records_read.unreadable``: EMFILE, EACCES,
EIO...) are an error raised to the caller, never taken for absent or for another directory's: nothing is
moved, set aside or removed on that basis. Torch-free: the saver daemon uses it.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import uuid

from flashckpt.commit.records_read import (
    ASIDE,
    LEFTOVERS,
    LOCK_NAME,
    RETIRED,
    _dir_of,
    _fd_path,
    _listdir,
    _lstat,
    _open_dir_at,
    _read_binding_at,
    absent,
    describes,
    unreadable,
)
from flashckpt.commit.records_store import _rule
from flashckpt.format.names import META
from flashckpt.util.lease import held

__all__ = ["bring", "live_jobs_at", "discard", "renamed_to", "retire", "settle", "sweep"]

log = logging.getLogger(__name__)


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
    """The jobs whose locks in the records ``name`` (in ``top_fd``) are held by a live saver.

    Raises:
        CheckpointDirError: the locks could not be read (``unreadable``): a job taken for dead would let
            its records be set aside."""
    fd = _open_dir_at(top_fd, name)
    if fd is None:
        return []
    try:
        jobs = _open_dir_at(fd, "jobs")
    finally:
        os.close(fd)
    if jobs is None:
        return []
    where = os.path.join(_fd_path(top_fd), name, "jobs")
    try:
        return sorted(n[:-5] for n in os.listdir(jobs) if n.endswith(".lock") and held(n, dir_fd=jobs))
    except OSError as e:
        raise unreadable("look at the job locks in", where, e) from e
    finally:
        os.close(jobs)


def discard(top_fd: int, name: str) -> None:
    """Moves the records ``name`` aside (one rename: readers see them whole or not at all), then removes
    them, never following a symbolic link."""
    aside = name if name.startswith(ASIDE) else f"{ASIDE}{uuid.uuid4().hex}"
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
        try:
            dev = os.stat(parent).st_dev
            with os.scandir(parent) as it:
                entries = [e for e in it if e.name != name and e.inode() == ino]
        except OSError as err:
            raise unreadable("list", parent, err) from err
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError as err:
                if absent(err):
                    continue
                raise unreadable("look up", e.path, err) from err
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
    for n in _listdir(top_fd):
        if n.startswith(RETIRED) and path and _dir_of(top_fd, n) == path and not live_jobs_at(top_fd, n):
            discard(top_fd, n)
    to = f"{RETIRED}{uuid.uuid4().hex}"
    os.rename(name, to, src_dir_fd=top_fd, dst_dir_fd=top_fd)
    os.fsync(top_fd)
    return to


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
    for name in sorted(_listdir(top_fd)):
        if name == LOCK_NAME:
            continue
        leftover = name.startswith(LEFTOVERS)
        retired = name.startswith(RETIRED)
        if not (leftover or retired) and _lstat(os.path.join(parent, name)) is not None:
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
