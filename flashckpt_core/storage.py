"""Where persisted files go: a small ABC and the POSIX backend (temp name, fsync, rename, dir fsync)."""

from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import xxhash

from ._protocol import fsync_dir

__all__ = ["FileRecord", "CheckpointStorage", "PosixDiskStorage", "file_checksum", "HashingWriter"]

_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileRecord:
    """A persisted file: its path, size in bytes and xxh3-64 checksum (hex).

    Files of a ``FileSet`` also carry their ``name`` in the set, ``fmt`` ("torch" or "raw"), ``kind``
    ("file", "commit", "tracker") and, until the commit moves them into place, where they are ``staged``."""

    path: str
    size: int
    xxh3: str
    fmt: str = "torch"
    name: str = ""
    kind: str = "file"
    staged: str = ""


def file_checksum(path: str) -> tuple[int, str]:
    """(size, xxh3-64 hex) of a local file, read in chunks."""
    h = xxhash.xxh3_64()
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


class HashingWriter:
    """A binary file wrapper that checksums (xxh3-64) and counts what is written through it."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._h = xxhash.xxh3_64()
        self.size = 0

    def write(self, data: Any) -> int:
        self._h.update(data)
        n = self._f.write(data)
        self.size += n
        return n

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class CheckpointStorage(ABC):
    """The storage a saver persists to. Paths are absolute.

    Call order for one persisted file: the saver calls ``write_file(path, fill)``; the backend calls
    ``fill(tmp)`` to produce the complete content in a local temporary file (``fill`` may return the
    ``(size, xxh3 hex)`` it computed while writing, which spares a re-read) and then makes it durable
    and visible under ``path`` atomically; a reader never sees a partial file under ``path``. Only the
    saver process writes; trainers only read (``read_bytes``, ``local_path``). Implementations must be
    safe to call from several threads at once for different paths.
    """

    @abstractmethod
    def write_file(self, path: str, fill: Callable[[str], tuple[int, str] | None]) -> FileRecord:
        """Atomically creates ``path`` with the content ``fill`` writes to a temp file; returns its record."""

    @abstractmethod
    def write_bytes(self, path: str, data: bytes) -> FileRecord:
        """Atomically creates or replaces ``path`` with ``data``."""

    @abstractmethod
    def read_bytes(self, path: str) -> bytes:
        """The whole content of ``path``; FileNotFoundError when it does not exist."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names in the directory ``path``; [] when it does not exist."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Removes a file; a missing file is not an error."""

    @abstractmethod
    def remove_tree(self, path: str) -> None:
        """Removes a directory and everything below it; missing is not an error."""

    @abstractmethod
    def checksum(self, path: str) -> tuple[int, str]:
        """(size, xxh3-64 hex) of the stored file."""

    def move(self, src: str, dst: str) -> None:
        """Atomically replaces ``dst`` with the complete file ``src`` (which then no longer exists).
        Backends without a rename override this; the default copies, then removes ``src``."""
        self.write_bytes(dst, self.read_bytes(src))
        self.remove(src)

    def local_path(self, path: str) -> str | None:
        """A local file system path for ``path`` when the backend has one (for torch.load), else None."""
        return None


class PosixDiskStorage(CheckpointStorage):
    """Local or network file systems with POSIX rename semantics."""

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
        d = os.path.dirname(path)
        self._makedirs(d)
        tmp = f"{path}.flashckpt-tmp"
        try:
            known = fill(tmp)
            size, digest = known if known is not None else file_checksum(tmp)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        fsync_dir(d)
        return FileRecord(path, size, digest)

    def write_bytes(self, path: str, data: bytes) -> FileRecord:
        def fill(tmp: str) -> tuple[int, str]:
            with open(tmp, "wb") as f:
                f.write(data)
            return len(data), xxhash.xxh3_64_hexdigest(data)

        return self.write_file(path, fill)

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

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
