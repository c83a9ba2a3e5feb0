"""The POSIX backend: local and network file systems with rename (``file://`` URLs and plain paths).

Every file is written to a temporary name, fsynced, renamed into place, and its directory fsynced; new
directories are made durable too. It declares ``posix_files``: the commit layer then keeps the commit
records beside the checkpoint dir (``commit.records_home.PosixRecords``) with ``flock`` job locks, and
resolves symbolic links when it confines a location (``commit.checkpoint_dir``).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Sequence
from typing import BinaryIO

import xxhash
from flashckpt import errors as E
from flashckpt.storage.base import CheckpointStorage, FileRecord, file_checksum
from flashckpt.util.durable import fsync_dir

__all__ = ["PosixDiskStorage"]


class PosixDiskStorage(CheckpointStorage):
    """Local or network file systems with POSIX rename semantics (``file://`` URLs and plain paths)."""

    supports_rename = True
    posix_files = True
    temp_suffix = ".flashckpt-tmp"

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb")

    def write_parts(self, path: str, parts: Sequence[object], *,
                    crc_slots: dict[int, list[tuple[int, int]]] | None = None) -> FileRecord:
        from flashckpt.format.filewriter import write_parts  # direct I/O into the temp file

        return self.write_file(path, lambda tmp: write_parts(tmp, parts, crc_slots=crc_slots))

    def _makedirs(self, d: str) -> None:
        if os.path.isdir(d):
            return
        missing = []
        p = d
        while p and not os.path.isdir(p):
            missing.append(p)
            p = os.path.dirname(p)
        os.makedirs(d, exist_ok=True)
        for m in reversed(missing):  # make the new directory entries durable too
            fsync_dir(os.path.dirname(m))

    def write_file(self, path: str, fill: Callable[[str], tuple[int, str] | None]) -> FileRecord:
        return self._publish(path, fill, exclusive=False)

    def write_bytes(self, path: str, data: bytes) -> FileRecord:
        return self._publish(path, self._filler(data), exclusive=False)

    def write_new(self, path: str, data: bytes) -> FileRecord:
        """Like ``write_bytes``, but the temp file is linked to ``path`` instead of renamed over it: ``link``
        never replaces, so an existing ``path`` is FileExistsError, atomically."""
        return self._publish(path, self._filler(data), exclusive=True)

    @staticmethod
    def _filler(data: bytes) -> Callable[[str], tuple[int, str]]:
        def fill(tmp: str) -> tuple[int, str]:
            with open(tmp, "wb") as f:
                f.write(data)
            return len(data), xxhash.xxh3_64_hexdigest(data)

        return fill

    def _publish(self, path: str, fill: Callable[[str], tuple[int, str] | None], *, exclusive: bool) -> FileRecord:
        """``fill``s the temp file ``<path><temp_suffix>``, fsyncs it, makes it ``path`` (rename, or link with
        ``exclusive``), fsyncs the directory. A failure leaves no temp file."""
        d = os.path.dirname(path)
        self._makedirs(d)
        tmp = f"{path}{self.temp_suffix}"
        try:
            known = fill(tmp)
            size, digest = known if known is not None else file_checksum(tmp)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            if exclusive:
                os.link(tmp, path)
                os.unlink(tmp)
            else:
                os.rename(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        fsync_dir(d)
        return FileRecord(path, size, digest)

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists (symbolic links followed). Only "not there" is False (ENOENT, ENOTDIR);
        an error that leaves it unknown (EACCES, EIO...) is raised: a manifest taken for absent would make
        its committed step look uncommitted."""
        try:
            os.stat(path)
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return False
        return True

    def listdir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):  # a parent that is a file: the path cannot exist
            pass

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def checksum(self, path: str) -> tuple[int, str]:
        return file_checksum(path)

    def local_path(self, path: str) -> str | None:
        return path

    def move(self, src: str, dst: str) -> None:
        d = os.path.dirname(dst)
        self._makedirs(d)
        os.replace(src, dst)
        fsync_dir(d)
        if os.path.dirname(src) != d:
            fsync_dir(os.path.dirname(src))

    # -- what differs from an object store ----------------------------------------------------------
    def normpath(self, location: str) -> str:
        return os.path.abspath(location)

    def isdir(self, path: str) -> bool:
        """Whether ``path`` is a directory (not a symbolic link to one). Only "not there" is False; an error
        that leaves it unknown (EACCES, EIO...) is raised, as by ``exists``."""
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return False
        return stat.S_ISDIR(st.st_mode)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            got = 0
            while got < len(out):
                n = os.preadv(fd, [out[got:]], offset + got)
                if n <= 0:
                    raise E.CheckpointCorruptError(f"{path}: {len(out) - got} bytes short at offset {offset + got}")
                got += n
        finally:
            os.close(fd)

    def prune_empty_dirs(self, dirs: Sequence[str], root: str) -> None:
        for d in sorted(set(dirs), key=len, reverse=True):
            while d.startswith(root + os.sep) and d != root:
                try:
                    os.rmdir(d)
                except OSError:
                    break
                d = os.path.dirname(d)
