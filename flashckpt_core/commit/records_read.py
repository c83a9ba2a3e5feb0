"""What the records beside a checkpoint dir hold, read through fds that never follow a symbolic link:
their binding (``dir.json``: the dir's inode number and path) and their committed manifests; the names
flashckpt gives its entries in ``<parent>/.flashckpt``. Reads only; torch-free.

Only an entry that is not there (``absent``: ENOENT, ENOTDIR, and ELOOP where a symbolic link is not
followed) counts as missing, and a record of the wrong content as damaged (its step is not committed);
any other error (EMFILE, EACCES, EIO...) leaves what the records hold unknown, and is raised
(``unreadable``): taken for "no records" it would make a load return an older step or none, and a
saver take the records for stale and set them aside.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.manifest import Manifest
from flashckpt.config import _DIR_FLAGS

__all__ = ["DIR_JSON", "MANIFEST", "RECORDS_FORMAT", "LOCK_NAME", "LEFTOVERS", "RETIRED", "ASIDE", "NEW",
           "read_binding", "bound_dir", "committed_at", "committed_in", "whole_steps", "describes", "absent",
           "unreadable"]

DIR_JSON = "dir.json"
MANIFEST = "manifest.json"
RECORDS_FORMAT = "flashckpt-records/1"
LOCK_NAME = ".lock"
ASIDE = ".flashckpt-stale-"  # records moved aside, being removed
NEW = ".flashckpt-new-"  # records being created
RETIRED = ".flashckpt-retired-"  # records of a dir whose name a new dir took (it may live on elsewhere)
OURS = (ASIDE, NEW, RETIRED)
LEFTOVERS = (ASIDE, NEW)


def absent(e: OSError, *, link: bool = False) -> bool:
    """Whether ``e`` says that the entry is not there (ENOENT; ENOTDIR: a file where a directory was
    expected; ENAMETOOLONG: a recorded name that cannot exist); with ``link`` (an open with
    ``O_NOFOLLOW``), ELOOP too: a symbolic link, never followed."""
    return e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG) or (link and e.errno == errno.ELOOP)


def unreadable(what: str, path: str, e: OSError) -> E.CheckpointDirError:
    """The error for commit records (or checkpoint files) that could not be read for a reason other than
    their absence: names the path, the errno and what to do, and says that nothing is taken for absent."""
    code = errno.errorcode.get(e.errno or 0, "") if e.errno else ""
    why = f"{code}: {e.strerror}" if code and e.strerror else str(e)
    if e.errno in (errno.EMFILE, errno.ENFILE):
        hint = ("Raise the open-files limit (ulimit -n; RLIMIT_NOFILE) or close files this process holds, then try "
                "again" if e.errno == errno.EMFILE else
                "The system's open-file table is full (fs.file-max): close files or raise it, then try again")
    elif e.errno in (errno.EACCES, errno.EPERM):
        hint = f"Give this user (uid {os.geteuid()}) access to it and to the directories above it, then try again"
    elif e.errno == errno.EIO:
        hint = "The storage reported an I/O error: check the disk or the network file system, then try again"
    else:
        hint = "Fix the cause, then try again"
    err = E.CheckpointDirError(
        f"could not {what} {path} ({why}): what is there cannot be known now, and is not taken for absent (a load "
        "would return an older step or none, a saver would set the commit records aside); nothing was loaded, "
        f"moved or removed for it. {hint}")
    err.errno = e.errno
    return err


def _lstat(path: str) -> os.stat_result | None:
    """``os.lstat(path)``; None when it is not there (``absent``), else ``unreadable`` raised."""
    try:
        return os.lstat(path)
    except OSError as e:
        if absent(e):
            return None
        raise unreadable("look up", path, e) from e


def _open_dir_at(dir_fd: int, name: str, *, where: str = "") -> int | None:
    """An fd of the directory ``name`` in ``dir_fd`` (``where``: the path of ``dir_fd``, for messages);
    None when it is not there, is not a directory or is a symbolic link (never followed).

    Raises:
        CheckpointDirError: it could not be opened otherwise (``unreadable``)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if absent(e, link=True):
            return None
        raise unreadable("open", os.path.join(where or _fd_path(dir_fd), name), e) from e


def _fd_path(fd: int) -> str:
    """The path of the open directory ``fd`` as the kernel knows it (for messages)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<directory fd {fd}>"


def _listdir(path: str | int, where: str = "") -> list[str]:
    """The names in the directory ``path`` (or open at that fd; ``where``: its path, for messages); []
    when it is not there.

    Raises:
        CheckpointDirError: it could not be listed (``unreadable``)."""
    try:
        return os.listdir(path)
    except OSError as e:
        if absent(e):
            return []
        raise unreadable("list", where or (path if isinstance(path, str) else _fd_path(path)), e) from e


def _open_file_at(dir_fd: int, name: str, where: str) -> int | None:
    """An fd of the file ``name`` in ``dir_fd`` (never following a symbolic link); None when absent."""
    try:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if absent(e, link=True):
            return None
        raise unreadable("open", os.path.join(where or _fd_path(dir_fd), name), e) from e


def _read_json_at(dir_fd: int, name: str, where: str = "") -> Any:
    """The JSON value of the file ``name`` in ``dir_fd``; None when it is absent or not JSON (damaged).

    Raises:
        CheckpointDirError: it could not be opened or read (``unreadable``)."""
    fd = _open_file_at(dir_fd, name, where)
    if fd is None:
        return None
    try:
        raw = os.read(fd, 1 << 16)
    except OSError as e:
        raise unreadable("read", os.path.join(where or _fd_path(dir_fd), name), e) from e
    finally:
        os.close(fd)
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _open_dir(path: str) -> int | None:
    """An fd of the directory ``path`` (its last component never followed); None when absent."""
    try:
        return os.open(path, _DIR_FLAGS)
    except OSError as e:
        if absent(e, link=True):
            return None
        raise unreadable("open", path, e) from e


def _read_binding_at(dir_fd: int, where: str = "") -> int | None:
    d = _read_json_at(dir_fd, DIR_JSON, where)
    ok = isinstance(d, dict) and d.get("format") == RECORDS_FORMAT and isinstance(d.get("ino"), int)
    return int(d["ino"]) if ok else None


def read_binding(records: str) -> int | None:
    """The inode number ``records``/dir.json binds them to; None when missing or damaged.

    Raises:
        CheckpointDirError: the records or their dir.json could not be read (``unreadable``)."""
    fd = _open_dir(records)
    if fd is None:
        return None
    try:
        return _read_binding_at(fd, records)
    finally:
        os.close(fd)


def _dir_of(top_fd: int, name: str, where: str = "") -> str:
    """The directory path the records ``name`` in ``top_fd`` (``where``: its path) were bound to ("" when
    not known: missing or damaged).

    Raises:
        CheckpointDirError: they could not be read (``unreadable``)."""
    fd = _open_dir_at(top_fd, name, where=where)
    if fd is None:
        return ""
    try:
        d = _read_json_at(fd, DIR_JSON, os.path.join(where or _fd_path(top_fd), name))
    finally:
        os.close(fd)
    return str(d.get("dir", "")) if isinstance(d, dict) else ""


def bound_dir(records: str) -> str:
    """The checkpoint dir that ``records``/dir.json names (its path when the records were bound); "" when
    not known (missing or damaged).

    Raises:
        CheckpointDirError: the records could not be read (``unreadable``)."""
    top, name = os.path.split(records)
    fd = _open_dir(top)
    if fd is None:
        return ""
    try:
        return _dir_of(fd, name, top)
    finally:
        os.close(fd)


def committed_at(records_fd: int, where: str = "") -> dict[int, Manifest]:
    """Step -> the sound manifest of each committed step in the records open at ``records_fd`` (``where``:
    their path, for messages), never following a symbolic link. A step without a manifest is not committed;
    one whose manifest is damaged is left out (a damaged step). Reads only.

    Raises:
        CheckpointDirError: the records could not be read (``unreadable``): never taken for "no step"."""
    where = where or _fd_path(records_fd)
    steps = _open_dir_at(records_fd, "steps", where=where)
    if steps is None:
        return {}
    base = os.path.join(where, "steps")
    out = {}
    try:
        for n in _listdir(steps, base):
            d = _open_dir_at(steps, n, where=base) if n.isdigit() else None
            if d is None:
                continue
            try:
                fd = _open_file_at(d, MANIFEST, os.path.join(base, n))
            finally:
                os.close(d)
            if fd is None:
                continue  # not committed
            try:
                raw = _read_all(fd)
            except OSError as e:
                raise unreadable("read", os.path.join(base, n, MANIFEST), e) from e
            finally:
                os.close(fd)
            try:
                out[int(n)] = Manifest.from_json(raw)
            except (ValueError, E.CheckpointCorruptError):
                continue  # damaged: a damaged step
    finally:
        os.close(steps)
    return out


def committed_in(records: str) -> dict[int, Manifest]:
    """``committed_at`` of the records dir ``records`` (not followed when it is a symbolic link); {} when
    there are none.

    Raises:
        CheckpointDirError: they could not be read (``unreadable``)."""
    fd = _open_dir(records)
    if fd is None:
        return {}
    try:
        return committed_at(fd, records)
    finally:
        os.close(fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def whole_steps(manifests: dict[int, Manifest], root: str) -> list[int]:
    """The steps of ``manifests`` whose every file is in ``root`` with the size it was committed with
    (symbolic links in ``root`` are followed: these are reads). Reads only.

    Raises:
        CheckpointDirError: a file could not be looked up for a reason other than its absence (EACCES,
            EIO...): whether the step is whole is unknown, and a step taken for gone would make its
            records look stale."""
    out = []
    for s, m in manifests.items():
        files = m.all_files()
        whole = bool(files)
        for f in files:
            path = os.path.join(root, f.path)
            try:
                size = os.stat(path).st_size
            except OSError as e:
                if absent(e):
                    whole = False
                    break
                raise unreadable("look up", path, e) from e
            if size != f.size:
                whole = False
                break
        if whole:
            out.append(s)
    return sorted(out)


def describes(records_fd: int, root: str) -> bool:
    """Whether the records open at ``records_fd`` are those of ``root`` as far as its files tell: ``root``
    holds every file of one of their committed steps (so a dir that merely got a reused inode number is
    not taken for theirs; records without a committed step have nothing to follow a dir with)."""
    return bool(whole_steps(committed_at(records_fd), root))
