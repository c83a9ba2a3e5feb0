"""The storage interface: the ABC of byte I/O (``CheckpointStorage``, its call order in its docstring), the
record of a persisted file (``FileRecord``) and its checksum. Backends are picked by URL in
``flashckpt.storage.registry``.

A checkpoint dir is a plain path or a URL. ``file://`` URLs and plain paths are served by
``PosixDiskStorage`` (``flashckpt.storage.posix``); other schemes by the backend registered for them: in code
(``register_storage``) or by an installed distribution through the entry-point group ``flashckpt.storage``
(name: the scheme; object: a ``CheckpointStorage`` subclass, built with ``from_url(url)``). See
docs/storage.md. Imports only the leaf layer and ``locations`` (``format.filewriter`` in ``write_parts``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import xxhash
from flashckpt import errors as E
from flashckpt.storage import locations
from flashckpt.storage.locations import local_dir, url_scheme

__all__ = ["FileRecord", "CheckpointStorage", "file_checksum", "HashingWriter", "url_scheme", "local_dir",
           "count_retry", "take_retries"]

_CHUNK = 8 << 20

_retries: dict[str, int] = {}  # kind -> retried requests of this process since ``take_retries``
_retries_lock = threading.Lock()


def count_retry(kind: str, n: int = 1) -> None:
    """Counts ``n`` retried requests of this process (``kind``: "throttled", "unreachable" or "error"), for
    the event stream: a backend calls it at each retry; a persist worker's counts travel to its saver with its
    replies; the saver takes the counts (``take_retries``) and reports them to the trainers as ``retry`` events."""
    with _retries_lock:
        _retries[kind] = _retries.get(kind, 0) + n


def take_retries() -> dict[str, int]:
    """The retries counted since the last call (kind -> count), and the count starts again."""
    global _retries
    with _retries_lock:
        out, _retries = _retries, {}
    return out


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
    """Byte I/O for the files and commit records of checkpoint dirs: one backend per URL scheme.

    Locations are absolute, in the checkpoint dir's form (``locations``): local paths for the POSIX
    backend, ``scheme://...`` URLs for the others. A backend stores and reads bytes; what to write where,
    and when a step counts as committed, is the commit layer's (``flashckpt.commit``): it reads the
    capabilities ``supports_rename``, ``posix_files`` and ``temp_suffix`` and calls only the methods below.

    A subclass should expect this sequence of calls (which processes make them in brackets):

    0) (any) ``from_url(url, **storage_options)`` builds it; ``normpath`` gives locations their canonical
       form.
    1) (the saver's persist worker) ``write_parts(path, parts)`` for each persisted file: it streams the
       parts (bytes and tensors viewing the snapshot in shared memory) to the store and makes the file
       visible under ``path`` at once and whole when it returns (POSIX: a temp file, fsync, rename; object
       stores: the completed upload); a failure leaves nothing under ``path``. ``write_file`` is the same
       for a file written locally first.
    2) (the saver: the commit protocol) small records with ``write_bytes`` (same guarantee) and
       ``write_new`` (create-if-absent), read back with ``read_bytes``/``listdir``/``exists``/``isdir``;
       at most ``move`` of a staged file into place before the manifest is written.
    3) (trainers, the CLI, adapters; any thread) reads: ``read_bytes``, ``read_into``, ``read_scatter``,
       ``open_read``, ``local_path``, ``size``, ``checksum``. Readers see a file whole or not at all.
    4) (the saver) deletions come last: ``remove``, ``remove_many``, ``remove_tree``, then
       ``prune_empty_dirs``.
    5) (``flashckpt gc``) ``tidy(root)`` removes what this backend's interrupted writes left; (any)
       ``close()`` releases connections.

    The defaults below are an object store's: no directories (``isdir``: any object below the prefix), no
    rename (``move`` copies, then removes). ``PosixDiskStorage`` overrides them. Only the saver and its
    persist worker write and remove; implementations must be safe to call from several threads at once
    for different locations.
    """

    #: whether ``move`` is an atomic rename (POSIX file systems); object stores have none
    supports_rename: bool = False

    #: whether locations are paths of this machine's file systems, with directories, symbolic links,
    #: inode numbers and ``flock`` (``PosixDiskStorage``). The commit layer reads it: records beside the
    #: checkpoint dir, bound to its inode and held by ``flock`` job locks, and confinement that resolves
    #: symbolic links (``flashckpt.commit.checkpoint_dir``); otherwise records inside the dir with lease
    #: objects, and lexical confinement.
    posix_files: bool = False

    #: what a user should check when the store refuses this process (the end of the message that says the
    #: checkpoint dir cannot be written)
    access_hint: str = "check the credentials and permissions for it"

    def first_contact(self) -> contextlib.AbstractContextManager[None]:
        """Requests made inside (on this thread) give up at the backend's bound for a first contact, not
        at a file's deadline: the checkpoint dir's probe before a saver starts (``prepare_dir``), so that
        a store that does not answer fails the start in seconds. Default: nothing changes (a file system
        answers or raises)."""
        return contextlib.nullcontext()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> CheckpointStorage:
        """The backend for checkpoint dirs under ``url`` with the user's ``storage_options`` (the resolver
        calls it); by default ``cls()``, which takes no options."""
        if options:
            raise E.InvalidArgumentError(f"storage_options {sorted(options)}: {cls.__name__} takes none")
        return cls()

    # -- locations -----------------------------------------------------------------------------------
    def normpath(self, location: str) -> str:
        """The canonical form of ``location`` (``locations.normpath``)."""
        return locations.normpath(location)

    # -- writing (the saver and its persist worker) -------------------------------------------------
    @abstractmethod
    def write_bytes(self, path: str, data: bytes) -> FileRecord:
        """Atomically creates or replaces ``path`` with ``data``."""

    def write_new(self, path: str, data: bytes) -> FileRecord:
        """Creates ``path`` with ``data`` only when it does not exist (a commit record two writers might
        race for). FileExistsError when it does. The default checks first (not atomic: a backend with an
        atomic create-if-absent overrides it)."""
        if self.exists(path):
            raise E.AlreadyExistsError(17, "exists", path)
        return self.write_bytes(path, data)

    def write_parts(self, path: str, parts: Sequence[Any], *,
                    crc_slots: dict[int, list[tuple[int, int]]] | None = None) -> FileRecord:
        """Atomically creates ``path`` with the concatenation of ``parts`` (``bytes``/``bytearray``/
        ``memoryview`` or CPU tensors; see ``filewriter.write_parts`` for ``crc_slots``, whose CRC-32s are
        filled in while the parts stream, so a backend must send ``parts[j]`` only after every earlier
        part). Returns the file's record (size, xxh3-64 of its bytes). The default writes a local temporary
        file through ``write_file``; object stores stream instead."""
        from flashckpt.format.filewriter import write_parts  # torch: never imported by the saver daemon itself

        return self.write_file(path, lambda tmp: write_parts(tmp, parts, crc_slots=crc_slots))

    def write_file(self, path: str, fill: Callable[[str], tuple[int, str] | None]) -> FileRecord:
        """Atomically creates ``path`` with what ``fill(tmp)`` writes into the local file ``tmp`` (``fill``
        may return the (size, xxh3 hex) it computed on the way). The default fills a local temporary
        file and uploads it with ``write_bytes`` (a backend that can stream overrides it)."""
        import tempfile

        fd, tmp = tempfile.mkstemp(prefix="flashckpt-")
        os.close(fd)
        try:
            fill(tmp)
            with open(tmp, "rb") as f:
                return self.write_bytes(path, f.read())
        finally:
            os.unlink(tmp)

    def move(self, src: str, dst: str) -> None:
        """Atomically replaces ``dst`` with the complete file ``src`` (which then no longer exists).
        Backends without a rename copy, then remove ``src`` (a reader sees ``dst`` whole either way)."""
        self.write_bytes(dst, self.read_bytes(src))
        self.remove(src)

    # -- reading -------------------------------------------------------------------------------------
    @abstractmethod
    def read_bytes(self, path: str) -> bytes:
        """The whole content of ``path``; FileNotFoundError when it does not exist."""

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fills ``out`` with ``len(out)`` bytes of ``path`` from ``offset`` (object stores: ranged
        reads, several at once). The default reads through ``open_read``."""
        with self.open_read(path) as f:
            f.seek(offset)
            got = 0
            while got < len(out):
                n = f.readinto(out[got:])  # type: ignore[attr-defined]
                if not n:
                    raise E.CheckpointCorruptError(f"{path}: {len(out) - got} bytes short at offset {offset + got}")
                got += n

    def read_scatter(self, path: str, segments: Sequence[tuple[int, memoryview]]) -> None:
        """Fills each ``(offset, out)`` of ``segments`` with ``len(out)`` bytes of ``path`` from ``offset``
        (object stores: ranges that cover several contiguous segments are one request, several at once).
        The default reads each segment with ``read_into``."""
        for offset, out in segments:
            if len(out):
                self.read_into(path, offset, out)

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether ``path`` exists. False only when it does not: an error that leaves it unknown (a
        refused request, EACCES, EIO...) is raised, never taken for absence."""

    def isdir(self, path: str) -> bool:
        """Whether ``path`` holds anything below it (object stores have no empty directories)."""
        return bool(self.listdir(path))

    @abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names directly below ``path`` (files and prefixes); [] when there is none."""

    @abstractmethod
    def checksum(self, path: str) -> tuple[int, str]:
        """(size, xxh3-64 hex) of the stored file; FileNotFoundError when it does not exist."""

    def size(self, path: str) -> int:
        """The size of the stored file in bytes; FileNotFoundError when it does not exist."""
        return len(self.read_bytes(path))

    def local_path(self, path: str) -> str | None:
        """A local file system path for ``path`` when the backend has one (for torch.load), else None."""
        return None

    def open_read(self, path: str) -> BinaryIO:
        """A readable, seekable binary stream of ``path`` (for ``torch.load``); the default reads it whole."""
        import io

        return io.BytesIO(self.read_bytes(path))

    # -- removing (the saver) ------------------------------------------------------------------------
    @abstractmethod
    def remove(self, path: str) -> None:
        """Removes a file; a missing file is not an error."""

    @abstractmethod
    def remove_tree(self, path: str) -> None:
        """Removes everything at and below ``path``; missing is not an error."""

    def remove_many(self, paths: Sequence[str]) -> None:
        """Removes files (object stores: in batches); missing ones are not an error."""
        for p in paths:
            self.remove(p)

    #: the suffix of the temporary name a write uses before its file is visible (removed with the file
    #: after a failure); None where writes have no temporary name (object stores)
    temp_suffix: str | None = None

    def prune_empty_dirs(self, dirs: Sequence[str], root: str) -> None:
        """Removes the directories in ``dirs`` and their parents up to (not including) ``root`` that the
        removals left empty. Object stores have no directories: nothing to do."""
        return None

    # -- the backend's own upkeep --------------------------------------------------------------------
    def close(self) -> None:
        """Releases what the backend holds (connections); it may be used again afterwards."""
        return None

    def tidy(self, root: str, *, dry_run: bool = False) -> list[str]:
        """``flashckpt gc``: removes what an interrupted write of this backend left under ``root`` (object
        stores: unfinished multipart uploads); returns what was removed (or would be), a line each."""
        return []
