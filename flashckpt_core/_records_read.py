"""What the records beside a checkpoint dir hold, read through fds that never follow a symbolic link:
their binding (``dir.json``: the dir's inode number and path) and their committed manifests; the names
flashckpt gives its entries in ``<parent>/.flashckpt``. Reads only; torch-free.
"""

from __future__ import annotations

import json
import os
from typing import Any

from . import errors as E
from .config import _DIR_FLAGS
from .manifest import Manifest

__all__ = ["META", "DIR_JSON", "MANIFEST", "RECORDS_FORMAT", "LOCK_NAME", "LEFTOVERS", "RETIRED", "ASIDE", "NEW",
           "read_binding", "bound_dir", "committed_at", "committed_in", "whole_steps", "describes"]

META = ".flashckpt"
DIR_JSON = "dir.json"
MANIFEST = "manifest.json"
RECORDS_FORMAT = "flashckpt-records/1"
LOCK_NAME = ".lock"
ASIDE = ".flashckpt-stale-"  # records moved aside, being removed
NEW = ".flashckpt-new-"  # records being created
RETIRED = ".flashckpt-retired-"  # records of a dir whose name a new dir took (it may live on elsewhere)
OURS = (ASIDE, NEW, RETIRED)
LEFTOVERS = (ASIDE, NEW)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _open_dir_at(dir_fd: int, name: str) -> int | None:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:  # missing, a symbolic link (ELOOP), not a directory
        return None


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
    """Whether the records open at ``records_fd`` are those of ``root`` as far as its files tell: ``root``
    holds every file of one of their committed steps (so a dir that merely got a reused inode number is
    not taken for theirs; records without a committed step have nothing to follow a dir with)."""
    return bool(whole_steps(committed_at(records_fd), root))
