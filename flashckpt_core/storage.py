"""Where persisted files go: the storage ABC, the POSIX backend (temp name, fsync, rename, dir fsync), and
the one resolver that picks a backend by URL (``storage_for``).

A checkpoint dir is a plain path or a URL. ``file://`` URLs and plain paths are served by
``PosixDiskStorage``; other schemes by the backend registered for them: in code (``register_storage``) or
by an installed distribution through the entry-point group ``flashckpt.storage`` (name: the scheme;
object: a ``CheckpointStorage`` subclass, built with ``from_url(url)``). See docs/storage.md.
"""

from __future__ import annotations

import os
import re
import shutil
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import xxhash

from . import errors as E
from ._protocol import fsync_dir

__all__ = ["FileRecord", "CheckpointStorage", "PosixDiskStorage", "file_checksum", "HashingWriter", "storage_for",
           "register_storage", "url_scheme", "local_dir", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "flashckpt.storage"

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

    #: whether ``move`` is an atomic rename (POSIX file systems); object stores have none
    supports_rename: bool = False

    @classmethod
    def from_url(cls, url: str) -> CheckpointStorage:
        """The backend for checkpoint dirs under ``url`` (the resolver calls it); by default ``cls()``."""
        return cls()

    def open_read(self, path: str) -> BinaryIO:
        """A readable binary stream of ``path`` (for ``torch.load``); the default reads it whole."""
        import io

        return io.BytesIO(self.read_bytes(path))


class PosixDiskStorage(CheckpointStorage):
    """Local or network file systems with POSIX rename semantics (``file://`` URLs and plain paths)."""

    supports_rename = True

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb")

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


# ---------------------------------------------------------------------------------------- the resolver
_REGISTRY: dict[str, type[CheckpointStorage]] = {"file": PosixDiskStorage}


def register_storage(scheme: str, backend: type[CheckpointStorage]) -> None:
    """Serves ``<scheme>://`` checkpoint dirs with ``backend`` in this process (installed distributions
    register through the entry-point group ``flashckpt.storage`` instead, which every process sees)."""
    if not (isinstance(backend, type) and issubclass(backend, CheckpointStorage)):
        raise E.InvalidArgumentTypeError(f"register_storage({scheme!r}, {backend!r}): a CheckpointStorage subclass "
                                         "is needed")
    _REGISTRY[scheme.lower()] = backend


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(url: str | os.PathLike[str]) -> str:
    """The scheme of a checkpoint dir: ``file`` for plain paths and ``file://`` URLs."""
    m = _URL.match(os.fspath(url))
    return m.group(1).lower() if m else "file"




def local_dir(checkpoint_dir: str | os.PathLike[str], what: str = "CheckpointEngine") -> str:
    """The local path ``checkpoint_dir`` names, as given (relative paths stay relative): a ``file://``
    URL becomes its absolute path; any other URL (``s3://``, ``gs://``, ``hdfs://``, ...) is refused.

    Raises:
        CheckpointDirError: an unsupported URL, a ``file://`` URL naming a host, or an empty path.
    """
    d = os.fspath(checkpoint_dir)
    if not isinstance(d, str):
        raise E.InvalidArgumentTypeError(f"{what}(checkpoint_dir={d!r}): a path (str or os.PathLike) is needed")
    m = _URL.match(d)
    if m is not None:
        scheme = m.group(1).lower()
        if scheme != "file":  # served by no backend yet: the S3 issue adds s3:// to the engine
            raise E.CheckpointDirError(
                f"{what}({d!r}): {scheme}:// storage is not supported yet; flashckpt writes to a local or mounted "
                "file system only (object stores such as S3 are planned). Pass a local directory, or mount the "
                "bucket (for example with mountpoint-s3 or s3fs) and pass the mount's path")
        url = urllib.parse.urlparse(d)
        if url.netloc not in ("", "localhost") or not url.path:
            raise E.CheckpointDirError(f"{what}({d!r}): a file:// URL names an absolute local path, as in "
                                       "file:///data/ckpt (three slashes); a host or a relative path is not allowed")
        return urllib.parse.unquote(url.path)
    if not d:
        raise E.CheckpointDirError(f"{what}(checkpoint_dir=''): give a directory")
    return d




def storage_for(url: str | os.PathLike[str]) -> CheckpointStorage:
    """The storage backend serving checkpoint dir ``url`` (a plain path or a URL).

    Raises:
        InvalidArgumentError: no backend serves the URL's scheme; the message lists those installed.
    """
    scheme = url_scheme(url)
    backend = _REGISTRY.get(scheme) or _from_entry_points(scheme)
    if backend is None:
        known = sorted(set(_REGISTRY) | _entry_point_names())
        raise E.InvalidArgumentError(
            f"no storage backend serves {os.fspath(url)!r} ({scheme}:// URLs); installed: "
            f"{', '.join(s + '://' for s in known)}. A backend registers for its scheme in the entry-point group "
            f"{ENTRY_POINT_GROUP!r} (or with flashckpt.storage.register_storage); see docs/storage.md")
    return backend.from_url(os.fspath(url))


def _entry_points() -> list[Any]:
    from importlib.metadata import entry_points

    return list(entry_points(group=ENTRY_POINT_GROUP))


def _entry_point_names() -> set[str]:
    return {ep.name.lower() for ep in _entry_points()}


def _from_entry_points(scheme: str) -> type[CheckpointStorage] | None:
    for ep in _entry_points():
        if ep.name.lower() == scheme:
            backend = ep.load()
            if not (isinstance(backend, type) and issubclass(backend, CheckpointStorage)):
                raise E.InvalidArgumentTypeError(f"the entry point {ep.name} = {ep.value} in group "
                                                 f"{ENTRY_POINT_GROUP!r} is not a CheckpointStorage subclass")
            _REGISTRY[scheme] = backend
            return backend
    return None
